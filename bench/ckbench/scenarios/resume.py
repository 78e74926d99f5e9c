"""Resume after a failure: a fresh process builds the model, restores the latest snapshot and runs
its first training step, timed end to end (interpreter start and imports included), for every
system side by side. Each system saves twice first (untimed; the second save is the latest
snapshot); the children run interleaved, ``--rounds`` times, the order rotating every round.

The child builds its model two ways, each timed in every round:

* ``resume`` (``tensors``): bare tensors of the state's shapes, nothing else (the scenario's
  figure since it was added).
* ``resume_script`` (``module``): what a training script builds before it resumes: an
  ``nn.Module`` of the state's shapes (embeddings, pre-norm blocks of ``Linear`` and
  ``LayerNorm``, their default initialisation) and an AdamW optimizer over its parameters,
  with the moments allocated as AdamW's ``load_state_dict`` would. The optimizer's first
  construction imports ``torch._dynamo`` (about 3 s and 800 modules here, the same for every
  system), so compare this row's differences (``resume_diff_ms``), not only its ratios.

The two differ in more than the build. Right after ``import torch`` the interpreter's cyclic
garbage collector is one or two young collections from a full one (about 0.1 s over torch's
167k objects), which the next 8-11k objects a process keeps trigger. With bare tensors it
falls on whatever allocates next: ckstore's import, not ``torch.load``'s few objects. A script
that builds its optimizer pays it (and two more) there, for every system. ``resume_phases``
has each phase, and ``full_gc_in_restore`` the seconds of full collections inside the restore
phase.

The scenario writes the bytecode of ckstore and of this bench first (an install's pip does):
a child that found it stale would compile the source in its timed import."""

from __future__ import annotations

import gc
import json
import shutil
import subprocess
import sys
import time
from typing import Any

import torch
from torch import nn

from ..harness import Bench
from ..states import READ_KEY, empty_like_shapes, model_shapes, mutate
from ..systems import SYSTEM_CLASSES
from ..util import BENCH_DIR, fmt_s, fresh_bytecode

ENTRY = BENCH_DIR / "run.py"
RESULT_PREFIX = "RESUME "
BUILDS = {"tensors": "resume", "module": "resume_script"}
"""How the child builds its model -> the scenario its times are recorded under."""


def resume(b: Bench) -> None:
    b.log("resume in a fresh process (build the model, restore the latest snapshot, first step)")
    fresh_bytecode()
    roots = {}
    for n in b.order(0):
        if not b.ok(n):
            continue
        root = b.fresh("resume", n.replace("+", "_"))
        try:
            b.systems[n].prepare(root)
            b.systems[n].save(b.state, root, 0)
            mutate(b.state, b.trainable, seed=9000)
            b.systems[n].save(b.state, root, 1)
            b.systems[n].close(root)
            roots[n] = root
        except Exception as exc:  # noqa: BLE001
            b.log(f"  !! {n}: saving for the resume scenario failed: {type(exc).__name__}: {exc}")
    phases: dict[str, dict[str, list[dict[str, float]]]] = {}
    for r in range(b.args.rounds):
        for build, scenario in BUILDS.items():
            for n in [n for n in b.order(r) if n in roots]:
                try:
                    wall, res = run_child(b, n, str(roots[n]), build)
                except Exception as exc:  # noqa: BLE001
                    b.log(f"  !! {n} resume child ({build}) failed: {exc}")
                    continue
                b.record(scenario, n, wall)
                phases.setdefault(scenario, {}).setdefault(n, []).append(res)
    for scenario, by_system in phases.items():
        for n, rows in by_system.items():
            med = {k: sorted(r[k] for r in rows)[len(rows) // 2] for k in rows[0]}
            b.log(f"  {scenario} {n}: " + ", ".join(f"{k} {fmt_s(v)}" for k, v in med.items()))
    b.extra["resume_phases"] = phases
    for scenario in BUILDS.values():
        diff = _median_diff(b, scenario)
        if diff is not None:
            b.extra.setdefault("resume_diff_ms", {})[scenario] = diff
            b.log(f"  {scenario}: ckstore - torch.save = {diff:+.0f} ms (medians)")
    for root in roots.values():
        shutil.rmtree(root, ignore_errors=True)


def _median_diff(b: Bench, scenario: str) -> float | None:
    """ckstore's median time minus torch.save's in ``scenario``, in ms (None: one is missing)."""
    times = b.times.get(scenario, {})
    ck, ts = times.get("ckstore"), times.get("torch.save")
    if not ck or not ts:
        return None
    return (sorted(ck)[len(ck) // 2] - sorted(ts)[len(ts) // 2]) * 1e3


def run_child(b: Bench, n: str, root: str, build: str) -> tuple[float, dict[str, float]]:
    cmd = [
        sys.executable,
        str(ENTRY),
        "--child-op",
        "resume",
        "--child-system",
        n,
        "--child-dir",
        root,
        "--size-mb",
        str(b.args.size_mb),
        "--child-build",
        build,
    ]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=b.args.child_timeout)
    wall = time.perf_counter() - t0
    line = [ln for ln in p.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if p.returncode != 0 or not line:
        err = (p.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"child exited {p.returncode}: {err}")
    return wall, json.loads(line[-1][len(RESULT_PREFIX) :])


def first_step(state: dict[str, Any]) -> None:
    """One optimizer-like step over every parameter and its Adam moments."""
    with torch.no_grad():
        for k, p in state["model"].items():
            st = state["optim"]["state"][k]
            st["exp_avg"].mul_(0.9)
            st["exp_avg_sq"].mul_(0.999)
            p.add_(st["exp_avg"], alpha=-1e-3)
            st["step"].add_(1.0)


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.Module()
        self.attn.qkv = nn.Linear(d, 3 * d)
        self.attn.out = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Module()
        self.mlp.up = nn.Linear(d, 4 * d)
        self.mlp.down = nn.Linear(4 * d, d)


class _Model(nn.Module):
    """A GPT-shaped module whose parameters have the names and shapes of
    :func:`~ckbench.states.model_shapes` (the bench state's ``model``)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        super().__init__()
        vocab, d = shapes[READ_KEY]
        n_layers = len({k.split(".")[1] for k in shapes if k.startswith("layers.")})
        self.embed = nn.Embedding(vocab, d)
        self.pos_embed = nn.Embedding(shapes["pos_embed.weight"][0], d)
        self.layers = nn.ModuleList(_Block(d) for _ in range(n_layers))
        self.final_norm = nn.LayerNorm(d)


def module_state(shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """The destination a training script resumes into: the parameters of a freshly built
    module with an AdamW optimizer over them, and the moments AdamW's ``load_state_dict``
    would allocate (laid out as :func:`~ckbench.states.empty_like_shapes` does)."""
    model = _Model(shapes)
    params = dict(model.named_parameters())
    if {k: tuple(p.shape) for k, p in params.items()} != shapes:
        raise AssertionError("the resume model's parameters do not match the bench state")
    torch.optim.AdamW(params.values(), lr=1e-4)
    state = empty_like_shapes(shapes)
    state["model"] = {k: p.detach() for k, p in params.items()}
    return state


class _CollectorClock:
    """Seconds the cyclic garbage collector spent in full (generation 2) collections since it
    was made: where the interpreter's full collection falls (see the module's docstring)."""

    def __init__(self) -> None:
        self.full = 0.0
        self._start = 0.0
        gc.callbacks.append(self._tick)

    def _tick(self, phase: str, info: dict[str, int]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.full += time.perf_counter() - self._start


def child_main(system: str, directory: str, size_mb: int, build: str = "tensors") -> int:
    """The child: build (``module`` or ``tensors``), restore the latest snapshot, step; print
    the phases on one line."""
    from pathlib import Path

    collections = _CollectorClock()
    t0 = time.perf_counter()
    sys_ = SYSTEM_CLASSES[system]()
    sys_.setup()
    t1 = time.perf_counter()
    shapes = model_shapes(size_mb << 20)
    state = module_state(shapes) if build == "module" else empty_like_shapes(shapes)
    t2 = time.perf_counter()
    full_before = collections.full
    root = Path(directory)
    sys_.prepare(root)
    sys_.restore(sys_.handle(root, 1), state)
    t3 = time.perf_counter()
    full_in_restore = collections.full - full_before
    first_step(state)
    t4 = time.perf_counter()
    sys_.close(root)
    res = {"import": t1 - t0, "build": t2 - t1, "restore": t3 - t2, "step": t4 - t3}
    res["full_gc_in_restore"] = full_in_restore
    print(RESULT_PREFIX + json.dumps(res), flush=True)
    return 0
