"""The restore's targets (issue 33: resume as fast as the peers that verify nothing) and the
figures behind them that the main table does not show."""

from __future__ import annotations

from typing import Any

from .harness import Bench
from .util import fmt_b, fmt_s, median

Medians = dict[str, dict[str, float | None]]


def _ratio(a: float | None, c: float | None) -> float | None:
    return None if a is None or c is None or c == 0 else a / c


def _share(checked: float | None, unchecked: float | None) -> float | None:
    """The part of ``checked`` that the checks cost: 1 - unchecked / checked (at least 0)."""
    return (
        None
        if checked is None or unchecked is None or not checked
        else max(0.0, 1.0 - unchecked / checked)
    )


def figures(b: Bench, med: Medians) -> dict[str, float | None]:
    """The restore's measured ratios, by name (what the targets and the notes use)."""

    def m(s: str, n: str) -> float | None:
        return med.get(s, {}).get(n)

    def sz(key: str) -> float | None:
        return median(b.sizes.get(key, []))

    stored = sz("restore_stored_bytes/ckstore")
    fsb = median(b.sizes.get("first_save_bytes/ckstore", []))
    cold = m("restore_cold", "ckstore")
    seq = median(b.extra.get("sequential_read", {}).get("ckstore", []))
    checked, unchecked = m("restore", "ckstore"), m("restore_unchecked", "ckstore")
    check_pass, copy_pass = m("restore_check_pass", "ckstore"), m("restore_copy_pass", "ckstore")
    floor = None if check_pass is None or copy_pass is None else check_pass + copy_pass
    return {
        "atomic_vs_torch": _ratio(checked, m("restore", "torch.save")),
        "nonatomic_vs_torch": _ratio(m("restore_nonatomic", "ckstore"), m("restore", "torch.save")),
        "atomic_vs_dcp": _ratio(checked, m("restore", "dcp")),
        "cold_vs_torch": _ratio(cold, m("restore_cold", "torch.save")),
        "cold_bandwidth_share": _ratio(fsb / cold if fsb and cold else None, seq),
        "cold_read_vs_stored": _ratio(sz("cold_read_bytes/ckstore"), fsb),
        "warm_read_vs_stored": _ratio(sz("restore_read_bytes/ckstore"), stored),
        "weights_vs_safetensors": _ratio(
            m("restore_model", "ckstore"), m("restore_model", "safetensors")
        ),
        "tensor_vs_safetensors": _ratio(
            m("read_one_tensor", "ckstore"), m("read_one_tensor", "safetensors")
        ),
        "resume_vs_torch": _ratio(m("resume", "ckstore"), m("resume", "torch.save")),
        "resume_script_vs_torch": _ratio(
            m("resume_script", "ckstore"), m("resume_script", "torch.save")
        ),
        "atomic_vs_floor": _ratio(checked, floor),
        "nonatomic_vs_floor": _ratio(m("restore_nonatomic", "ckstore"), copy_pass),
        "floor_vs_torch": _ratio(floor, m("restore", "torch.save")),
        "check_share": _share(checked, unchecked),
        "nonatomic_check_share": _share(
            m("restore_nonatomic", "ckstore"), m("restore_nonatomic_unchecked", "ckstore")
        ),
        "floor_check_share": _ratio(check_pass, floor),
    }


def targets(b: Bench, med: Medians, row: Any) -> list[dict[str, Any]]:
    """Issue 33's restore targets, as rows of ``row(name, value, limit, kind)``."""
    f = figures(b, med)
    rss = b.extra.get("peak_rss", {}).get("ckstore", {})
    return [
        row("restore in place (atomic) / torch.load(mmap)+copy_", f["atomic_vs_torch"], 1.5),
        row("restore(atomic=False) / torch.load(mmap)+copy_", f["nonatomic_vs_torch"], 1.3),
        row(
            "restore in place (atomic) / its floor here (check pass + copy pass)",
            f["atomic_vs_floor"],
            1.2,
        ),
        row(
            "restore(atomic=False) / a copy pass here (no check in it)",
            f["nonatomic_vs_floor"],
            1.2,
        ),
        row("restore in place (atomic) / DCP", f["atomic_vs_dcp"], 0.5),
        row("cold restore (atomic) / cold torch.load(mmap)+copy_", f["cold_vs_torch"], 0.9),
        row(
            "cold restore: stored bytes per second / sequential read",
            f["cold_bandwidth_share"],
            0.90,
            "min",
        ),
        row("cold restore: bytes read from disk / stored", f["cold_read_vs_stored"], 1.05),
        row("warm restore (atomic): pack bytes read / stored", f["warm_read_vs_stored"], 1.0),
        row("check's share of a warm restore(atomic=False)", f["nonatomic_check_share"], 0.10),
        row(
            "check's share of a warm atomic restore / the check pass's share of its floor",
            _ratio(f["check_share"], f["floor_check_share"]),
            1.2,
        ),
        row(
            "weights-only restore / the weights read from safetensors",
            f["weights_vs_safetensors"],
            1.2,
        ),
        row("read one 64 MiB tensor / safetensors", f["tensor_vs_safetensors"], 1.2),
        row("resume end to end / torch.save", f["resume_vs_torch"], 1.05),
        row(
            "resume as a script does (nn.Module + AdamW built) / torch.save",
            f["resume_script_vs_torch"],
            1.05,
        ),
        row(
            "restore peak RSS above live / state",
            rss.get("restore", {}).get("peak_above_live_fraction"),
            0.10,
        ),
    ]


def notes(b: Bench, med: Medians) -> list[str]:
    """The restore figures outside the table: the checks' cost, the bytes a restore reads."""
    L = []
    ck = {k: v.get("ckstore") for k, v in med.items()}
    for name, unchecked_name, kind in (
        ("restore", "restore_unchecked", "an atomic restore"),
        ("restore_nonatomic", "restore_nonatomic_unchecked", "restore(atomic=False)"),
    ):
        checked, unchecked = ck.get(name), ck.get(unchecked_name)
        share = _share(checked, unchecked)
        if share is not None:
            L.append(
                f"Checks: {kind} took {fmt_s(checked)}, {fmt_s(unchecked)} with the check of "
                f"each chunk skipped (a benchmark's switch): the checks are {share:.0%} of it."
            )
    check_pass = med.get("restore_check_pass", {}).get("ckstore")
    copy_pass = med.get("restore_copy_pass", {}).get("ckstore")
    torch_load = med.get("restore", {}).get("torch.save")
    first = med.get("restore_check_pass_first", {}).get("ckstore")
    if first is not None and check_pass is not None:
        L.append(
            f"The floor's check pass before any restore (the page cache the takes left): "
            f"{fmt_s(first)}; after the restores: {fmt_s(check_pass)}."
        )
    if check_pass is not None and copy_pass is not None:
        floor = check_pass + copy_pass
        vs = f", {floor / torch_load:.2f}x torch.load(mmap)+copy_" if torch_load else ""
        encoded = median(b.sizes.get("floor_encoded_bytes/ckstore", [])) or 0
        L.append(
            f"Floor of an atomic restore here (bench/ckbench/floor.py: one XXH3 pass over the "
            f"snapshot's stored payloads through new mappings and one read of them into place, "
            f"on the restore's threads): {fmt_s(check_pass)} + {fmt_s(copy_pass)} = "
            f"{fmt_s(floor)}{vs}"
            + (
                f"; {fmt_b(encoded)} of the payloads are encoded (decoding not in it)"
                if encoded
                else ""
            )
            + "."
        )
    w_check = med.get("restore_model_check_pass", {}).get("ckstore")
    w_copy = med.get("restore_model_copy_pass", {}).get("ckstore")
    w_st = med.get("restore_model", {}).get("safetensors")
    if w_check is not None and w_copy is not None:
        vs = f", {(w_check + w_copy) / w_st:.2f}x safetensors' weights" if w_st else ""
        L.append(
            f"Floor of an atomic restore of the weights alone (model/**, the same two passes "
            f"over their payloads): {fmt_s(w_check)} + {fmt_s(w_copy)} = "
            f"{fmt_s(w_check + w_copy)}{vs}."
        )
    dense, dense_one = ck.get("restore_compacted"), ck.get("restore_compacted_nonatomic")
    if dense is not None and dense_one is not None and torch_load:
        right = b.extra.get("restore_compacted_correct", {})
        L.append(
            f"A compacted snapshot (every chunk dense, as an older checkpoint is): an atomic "
            f"restore {fmt_s(dense)} ({dense / torch_load:.2f}x torch.load(mmap)+copy_), "
            f"atomic=False {fmt_s(dense_one)} ({dense_one / torch_load:.2f}x); past the memory "
            f"budget an atomic restore decodes each chunk twice (checked before anything is "
            f"touched, then into place)"
            + ("" if all(right.values()) else "; !! RESTORED BYTES DIFFER")
            + "."
        )
    stored = median(b.sizes.get("restore_stored_bytes/ckstore", []))
    atomic = median(b.sizes.get("restore_read_bytes/ckstore", []))
    one = median(b.sizes.get("restore_read_bytes_nonatomic/ckstore", []))
    if stored and atomic is not None:
        L.append(
            f"Pack bytes a warm restore reads from the store (counted at the storage boundary): "
            f"atomic {fmt_b(atomic)} ({atomic / stored:.2f}x the {fmt_b(stored)} stored), "
            f"atomic=False {fmt_b(one)} ({(one or 0) / stored:.2f}x)."
        )
    return L
