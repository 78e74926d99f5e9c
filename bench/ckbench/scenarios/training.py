"""Full training: a small transformer trained for real with AdamW (every weight changes at every
step), a save every ``--train-every`` steps for ``--train-saves`` saves, in two variants saved at
the same points of the same run: ``fp32`` (fp32 weights + fp32 AdamW state) and ``bf16`` (a
bfloat16 copy of the weights, weights only). See ``ckbench.training_model``.

Per system and variant: bytes each save adds to the system's directory (as a fraction of the
raw bytes of that save's state), the time of each save (durable, as in every scenario), and the
restore time of the last snapshot (for ckstore+delta, the deepest delta chain) against that of
the first (full) one, median of ``RESTORE_REPS``, each restore checked bitwise on its first run.
ckstore+delta (``take(..., delta_base="parent")``) joins ckstore when this ckstore's
``Store.take`` accepts ``delta_base``; otherwise it is skipped with a note.

Results: ``b.extra["training"]`` (with its targets, see ``ckbench.report_training``).
"""

from __future__ import annotations

import gc
import shutil
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ..harness import Bench
from ..report_training import targets
from ..states import copy_into, empty_like_state, iter_tensors, scramble, state_bytes
from ..systems import SYSTEM_CLASSES, Ckstore
from ..training_model import TrainConfig, Trainer, bf16_weights, fp32_state
from ..util import dir_bytes, fmt_b, median

VARIANTS = ("fp32", "bf16")
DELTA = "ckstore+delta"
RESTORE_REPS = 5

Key = tuple[str, str]  # (variant, system)


def training(b: Bench) -> None:
    """The phase. The objects alive when it starts (torch and the systems' modules), and again
    after the first save (the modules the systems import on first use), are frozen out of the
    garbage collector meanwhile: the full collection before each timed operation
    (``Bench.timed``) then takes milliseconds, not a quarter of a second."""
    freeze()
    try:
        run_training(b)
    finally:
        gc.unfreeze()


def run_training(b: Bench) -> None:
    a = b.args
    cfg = TrainConfig(
        dim=a.train_dim, layers=a.train_layers, heads=max(1, a.train_dim // 64), seed=a.seed
    )
    n_saves, every = a.train_saves, a.train_every
    names = training_systems(b)
    t = Trainer(cfg)
    b.log(
        f"full training: {sum(p.numel() for p in t.model.parameters()) / 1e6:.1f}M params "
        f"({fmt_b(t.param_bytes())} fp32), AdamW, a save every {every} steps, {n_saves} saves; "
        f"systems {', '.join(names)}"
    )
    roots = {(v, n): b.fresh("training", v, n.replace("+", "_")) for v in VARIANTS for n in names}
    for (_v, n), root in roots.items():
        try:
            b.systems[n].prepare(root)
        except Exception as exc:  # noqa: BLE001
            b.fail(n, "training prepare", exc)
    rec: dict[Key, dict[str, Any]] = {
        k: {
            "take_seconds": [],
            "stored_bytes": [],
            "ckstore_new_bytes": [],
            "restore_first_seconds": [],
            "restore_last_seconds": [],
            "restore_correct": None,
        }
        for k in roots
    }
    handles: dict[Key, dict[int, Any]] = {k: {} for k in roots}
    raw: dict[str, list[int]] = {v: [] for v in VARIANTS}
    refs: dict[str, dict[int, Any]] = {v: {} for v in VARIANTS}
    losses, train_s = [], 0.0
    for i in range(n_saves):
        t0 = time.perf_counter()
        losses.append(t.steps(every))
        train_s += time.perf_counter() - t0
        states = {"fp32": fp32_state(t), "bf16": bf16_weights(t)}
        order = names[i % len(names) :] + names[: i % len(names)]
        for v, st in states.items():
            raw[v].append(state_bytes(st))
            if i in (0, n_saves - 1):
                refs[v][i] = clone(st)
            for n in order:
                save_one(b, v, n, st, roots[(v, n)], i, rec[(v, n)], handles[(v, n)])
        b.log(f"  save {i + 1}/{n_saves} at step {t.step}, loss {losses[-1]:.3f}")
        if i == 0:
            freeze()
    for v in VARIANTS:
        restore_all(b, v, names, refs[v], rec, handles, n_saves)
    for (v, n), root in roots.items():
        sys_ = b.systems[n]
        if isinstance(sys_, Ckstore):
            try:
                rec[(v, n)]["compacted_added"] = sys_.compacted_added(root)
            except Exception as exc:  # noqa: BLE001
                b.fail(n, "training compaction", exc)
    for (_v, n), root in roots.items():
        try:
            b.systems[n].close(root)
        except Exception:  # noqa: BLE001
            pass
    shutil.rmtree(b.work / "training", ignore_errors=True)
    out = summarize(b, cfg, t, names, rec, raw, losses, train_s)
    out["targets"] = targets(out)
    b.extra["training"] = out


def freeze() -> None:
    gc.collect()
    gc.freeze()


def training_systems(b: Bench) -> list[str]:
    """The selected systems that are available, with ckstore+delta right after ckstore (set up
    here when --systems did not name it; skipped with a note when unavailable)."""
    names = [n for n in b.args.systems if n in b.systems and b.ok(n)]
    if "ckstore" in names and DELTA not in b.status:
        sys_ = SYSTEM_CLASSES[DELTA]()
        try:
            sys_.setup()
            b.systems[DELTA], b.status[DELTA] = sys_, "ok"
        except Exception as exc:  # noqa: BLE001
            b.status[DELTA] = f"unavailable: {type(exc).__name__}: {exc}"[:400]
            b.log(f"  note: {DELTA} skipped ({b.status[DELTA]})")
    if b.ok(DELTA) and DELTA not in names:
        names.insert(names.index("ckstore") + 1 if "ckstore" in names else 0, DELTA)
    return names


def clone(state: Any) -> Any:
    out = empty_like_state(state)
    copy_into(state, out)
    return out


def save_one(
    b: Bench,
    v: str,
    n: str,
    state: dict[str, Any],
    root: Path,
    i: int,
    r: dict[str, Any],
    hs: dict[int, Any],
) -> None:
    before = dir_bytes(root)
    scen = f"training_{v}_take"
    h = b.timed(scen, n, partial(b.systems[n].save, state, root, i))
    if h is None:
        return
    b.systems[n].settle(root)  # bytes counted once ckstore's compaction of the older saves is done
    hs[i] = h
    r["take_seconds"].append(b.times[scen][n][-1])
    r["stored_bytes"].append(dir_bytes(root) - before)
    sys_ = b.systems[n]
    if isinstance(sys_, Ckstore):
        r["ckstore_new_bytes"].append(sys_.last_stats.get("new_bytes"))
        if "max_depth" in sys_.last_stats:
            r.setdefault("max_depth", []).append(sys_.last_stats["max_depth"])
            r["depth_limit"] = sys_.last_stats["depth_limit"]


def restore_all(
    b: Bench,
    v: str,
    names: list[str],
    refs: dict[int, Any],
    rec: dict[Key, dict[str, Any]],
    handles: dict[Key, dict[int, Any]],
    n_saves: int,
) -> None:
    """Restore the first and the last snapshot of every system ``RESTORE_REPS`` times into one
    live destination (scrambled before each), systems rotating; the first of each is checked."""
    if not refs:
        return
    dest = empty_like_state(refs[0])
    for rep in range(RESTORE_REPS):
        for j, n in enumerate(names[rep % len(names) :] + names[: rep % len(names)]):
            pair = [(0, "first"), (n_saves - 1, "last")]
            if (rep + j) % 2:
                pair.reverse()
            for i, label in pair:
                h = handles[(v, n)].get(i)
                if h is None or i not in refs:
                    continue
                scramble(dest)
                scen = f"training_{v}_restore_{label}"
                done = len(b.times.get(scen, {}).get(n, []))
                b.timed(scen, n, partial(b.systems[n].restore, h, dest))
                if len(b.times.get(scen, {}).get(n, [])) == done:
                    continue  # failed (or the system failed before)
                r = rec[(v, n)]
                r[f"restore_{label}_seconds"].append(b.times[scen][n][-1])
                if rep == 0:
                    same = equal(dest, refs[i])
                    r["restore_correct"] = (
                        same if r["restore_correct"] is None else r["restore_correct"] and same
                    )
                    if not same:
                        b.log(f"  !! {n} restored wrong bytes for the {label} {v} snapshot")


def equal(a: Any, ref: Any) -> bool:
    got = dict(iter_tensors(a))
    want = dict(iter_tensors(ref))
    return got.keys() == want.keys() and all(
        got[k].dtype == t.dtype and torch.equal(got[k], t) for k, t in want.items()
    )


def summarize(
    b: Bench,
    cfg: TrainConfig,
    t: Trainer,
    names: list[str],
    rec: dict[Key, dict[str, Any]],
    raw: dict[str, list[int]],
    losses: list[float],
    train_s: float,
) -> dict[str, Any]:
    n_params = sum(p.numel() for p in t.model.parameters())
    out: dict[str, Any] = {
        "model": {
            "kind": "TinyGPT (pre-norm nn.TransformerEncoder, causal, untied head)",
            "dim": cfg.dim,
            "layers": cfg.layers,
            "heads": cfg.heads,
            "vocab": cfg.vocab,
            "params": n_params,
            "param_bytes_fp32": n_params * 4,
        },
        "train": {
            "optimizer": f"AdamW(lr={cfg.lr}, weight_decay={cfg.weight_decay})",
            "batch": cfg.batch,
            "seq": cfg.seq,
            "every": b.args.train_every,
            "saves": b.args.train_saves,
            "restore_reps": RESTORE_REPS,
            "steps": t.step,
            "loss_at_saves": losses,
            "train_seconds": train_s,
        },
        "variants": {
            "fp32": "fp32 weights + fp32 AdamW state (step, exp_avg, exp_avg_sq)",
            "bf16": "bfloat16 copy of the weights of the same fp32 run, weights only",
        },
        "systems": names,
        "delta_status": b.status.get(DELTA, "not selected (needs ckstore in --systems)"),
        "unavailable": {n: s for n, s in b.status.items() if n != DELTA and s != "ok"},
    }
    for v in VARIANTS:
        raws = raw[v]
        per: dict[str, Any] = {}
        for n in names:
            r = rec[(v, n)]
            sb = r["stored_bytes"]
            fr = [s / x for s, x in zip(sb, raws)]
            rf, rl = median(r["restore_first_seconds"]), median(r["restore_last_seconds"])
            dense = r.get("compacted_added")
            dense_fr = (
                [s / x for s, x in zip(dense, raws)] if dense and len(dense) == len(raws) else None
            )
            per[n] = {
                **r,
                "stored_fraction": fr,
                "first_stored_fraction": fr[0] if fr else None,
                "later_stored_fraction": sum(fr[1:]) / len(fr[1:]) if len(fr) > 1 else None,
                "later_compacted_fraction": sum(dense_fr[1:]) / len(dense_fr[1:])
                if dense_fr and len(dense_fr) > 1
                else None,
                "take_first_seconds": r["take_seconds"][0] if r["take_seconds"] else None,
                "take_later_seconds": median(r["take_seconds"][1:]),
                "restore_first_median": rf,
                "restore_last_median": rl,
                "restore_last_over_first": rl / rf if rf and rl is not None else None,
                "complete": len(sb) == len(raws),
            }
        out[v] = {"raw_bytes": raws, "systems": per}
    return out
