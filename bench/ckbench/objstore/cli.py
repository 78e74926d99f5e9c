"""Arguments, the interleaved rounds on the object store, the scaling part, the tables and
``<out>/results.json`` / ``results.md`` (``bench/objstore.py`` calls :func:`main`).

Every round gives each system a fresh prefix and runs, system by system (the order rotates
every round): the first save, one training step on the trainable head (about 10% of the
bytes), the save after it, then a restore in place into a live destination (checked bit for bit
in the first round). Medians over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import UTC, datetime
from functools import partial
from typing import Any

import torch

from ..harness import Bench
from ..states import flat_tensors, mutate, scramble
from ..util import BENCH_DIR, MiB, fmt_b, machine_info, median
from . import scaling, server
from .systems import SYSTEMS, TS_NOTE, make

PHASES = (
    ("first_save", "first save"),
    ("incremental_save", "save after 10% changed"),
    ("restore", "restore in place"),
)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--size-mb",
        type=int,
        default=256,
        help="state size in MiB (default 256: a 270 MiB state; about 200 MiB at least)",
    )
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default 2)")
    ap.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help=f"comma-separated subset of {','.join(SYSTEMS)}",
    )
    ap.add_argument(
        "--writers",
        default="1,2,4",
        help="writer processes in the scaling part (default 1,2,4; '' skips it)",
    )
    ap.add_argument(
        "--dcp-threads",
        type=int,
        default=4,
        help="DCP FsspecWriter thread_count (default 4, as ckstore's 4 pack uploads in flight)",
    )
    ap.add_argument(
        "--timeout", type=float, default=300, help="seconds before a scaling job is killed"
    )
    ap.add_argument("--out", default=str(BENCH_DIR / "out" / "objstore"), help="output directory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--verbose", action="store_true", help="print tracebacks of failing systems")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(args.systems) - set(SYSTEMS)
    if unknown:
        parser().error(f"unknown systems {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    writers = [int(w) for w in args.writers.split(",") if w.strip()]
    torch.manual_seed(args.seed)
    b = Bench(args)
    b.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    load = {"start": os.getloadavg()}
    notes: list[str] = []
    with server.running() as obj:
        b.log(f"SeaweedFS S3 gateway at {obj.endpoint_url} (loopback only), bucket {obj.bucket}")
        setup_systems(b, obj, notes)
        b.setup_state()
        for r in range(args.rounds):
            one_round(b, obj, r)
        scale = run_scaling(b, obj, writers)
    load["end"] = os.getloadavg()
    res = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "loadavg_1_5_15min": load,
        "args": {k: v for k, v in vars(args).items()},
        "state": b.extra["state"],
        "status": b.status,
        "notes": notes,
        "times": b.times,
        "medians": {ph: {n: median(v) for n, v in by.items()} for ph, by in b.times.items()},
        "stored_bytes": b.sizes,
        "scaling": scale,
        "total_seconds": time.perf_counter() - t0,
    }
    md = markdown(b, res)
    (b.out / "results.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    (b.out / "results.md").write_text(md)
    print()
    print(md)
    b.log(f"wrote {b.out / 'results.json'}, {b.out / 'results.md'} in {res['total_seconds']:.0f} s")
    return 0


def setup_systems(b: Bench, obj: server.ObjectStore, notes: list[str]) -> None:
    for n in b.args.systems:
        s = make(n, obj, b.args.dcp_threads)
        try:
            s.setup()
        except Exception as exc:  # noqa: BLE001 - unavailable systems are reported, not fatal
            b.status[n] = f"unavailable: {type(exc).__name__}: {exc}"[:400]
            b.log(f"  {n}: {b.status[n]}")
            continue
        b.status[n] = "ok"
        b.systems[n] = s  # type: ignore[assignment]
    if "dcp" in b.systems:
        notes.append(
            f"DCP: FsspecWriter(thread_count={b.args.dcp_threads}) on s3fs, endpoint in client_kwargs"
        )
    if "torchsnapshot" in b.systems:
        notes.append(TS_NOTE)
        b.log(f"  note: {TS_NOTE}")


def one_round(b: Bench, obj: server.ObjectStore, r: int) -> None:
    order = b.order(r)
    b.log(f"round {r + 1}/{b.args.rounds}: order {', '.join(order)}")
    prefixes = {n: f"round{r}/{n}" for n in order}
    handles: dict[str, Any] = {}
    for n in order:
        try:
            b.systems[n].prepare(prefixes[n])  # type: ignore[call-arg]
        except Exception as exc:  # noqa: BLE001
            b.fail(n, "prepare", exc)
    for i, phase in enumerate(("first_save", "incremental_save")):
        if i == 1:
            mutate(b.state, b.trainable, seed=1000 + r)
        for n in order:
            h = b.timed(phase, n, partial(b.systems[n].save, b.state, prefixes[n], i))  # type: ignore[call-arg]
            if h is not None:
                handles[n] = h
                b.log(f"  {n:<14} {phase:<17} {b.times[phase][n][-1]:6.2f} s")
    for n in order:
        if n not in handles or not b.ok(n):
            continue
        b.sizes.setdefault(n, []).append(obj.stored_bytes(prefixes[n]))
        scramble(b.dest)
        if b.timed(
            "restore", n, partial(b.systems[n].restore, handles[n], b.dest)
        ) is None and not b.ok(n):
            continue
        b.log(f"  {n:<14} {'restore':<17} {b.times['restore'][n][-1]:6.2f} s")
        if r == 0:
            verify(b, n)


def verify(b: Bench, n: str) -> None:
    want, got = flat_tensors(b.state), flat_tensors(b.dest)
    bad = [k for k, t in want.items() if not torch.equal(t, got[k])]
    if bad:
        b.fail(
            n, "verify", AssertionError(f"{len(bad)} tensors differ after restore, e.g. {bad[0]}")
        )


def run_scaling(b: Bench, obj: server.ObjectStore, writers: list[int]) -> dict[str, Any]:
    """Each writer count for both systems before the next (the order alternating), so a change
    in the machine's load hits both alike."""
    out: dict[str, Any] = {}
    names = [s for s in ("ckstore", "dcp") if b.ok(s)]
    for i, w in enumerate(writers):
        for n in names if i % 2 == 0 else names[::-1]:
            b.log(f"scaling: {n} first save from {w} writer process(es)")
            res = scaling.first_save(
                obj,
                n,
                w,
                b.size,
                b.args.seed,
                b.args.dcp_threads,
                b.args.timeout,
                prefix=f"scale/{n}/{w}",
            )
            out.setdefault(n, {})[str(w)] = res
            b.log(f"  {res}")
    return out


# ---------------------------------------------------------------------------------------------
# the tables


def _cell(seconds: float | None, nbytes: int) -> str:
    if seconds is None:
        return "n/a"
    return f"{seconds:.2f} s ({nbytes / MiB / seconds:.0f} MiB/s)"


def _ratio(a: float | None, c: float | None) -> str:
    return f"{a / c:.2f}" if a is not None and c else "n/a"


def markdown(b: Bench, res: dict[str, Any]) -> str:
    names = [n for n in SYSTEMS if n in b.args.systems]
    label = {n: make(n, None, b.args.dcp_threads).label for n in names}  # type: ignore[arg-type]
    S = b.state_bytes
    med = res["medians"]
    lines = [
        f"#### ckstore on an object store (SeaweedFS S3 on loopback): {fmt_b(S)} state, "
        f"{b.args.rounds} rounds, medians",
        "",
        "| phase | " + " | ".join(label[n] for n in names) + " | ckstore / DCP |",
        "|---|" + "---:|" * (len(names) + 1),
    ]
    for ph, title in PHASES:
        m = med.get(ph, {})
        cells = [_cell(m.get(n), S) for n in names]
        lines.append(
            f"| {title} | " + " | ".join(cells) + f" | {_ratio(m.get('ckstore'), m.get('dcp'))} |"
        )
    stored = {n: median(v) for n, v in res["stored_bytes"].items()}
    lines.append(
        "| bytes in the bucket after both saves | "
        + " | ".join(fmt_b(stored.get(n)) for n in names)
        + f" | {_ratio(stored.get('ckstore'), stored.get('dcp'))} |"
    )
    scale = res["scaling"]
    if scale:
        sysn = [n for n in ("ckstore", "dcp") if n in scale]
        writers = sorted({int(w) for n in sysn for w in scale[n]})
        lines += [
            "",
            f"#### first save of the {fmt_b(S)} state from N writer processes "
            "(a gloo job; each rank holds 1/N of every tensor)",
            "",
            "| writers | " + " | ".join(label[n] for n in sysn) + " | ckstore / DCP |",
            "|---:|" + "---:|" * (len(sysn) + 1),
        ]
        for w in writers:
            sec = {n: scale[n].get(str(w), {}).get("seconds") for n in sysn}
            lines.append(
                f"| {w} | "
                + " | ".join(_cell(sec[n], S) for n in sysn)
                + f" | {_ratio(sec.get('ckstore'), sec.get('dcp'))} |"
            )
    lines.append("")
    for n in names:
        if b.status.get(n) != "ok":
            lines.append(f"- {n}: {b.status.get(n)}")
    for n, by in scale.items():
        for w, r in by.items():
            if "error" in r:
                lines.append(f"- {n} with {w} writers: {r['error']}")
    lines += [f"- {note}" for note in res["notes"]]
    mach = res["machine"]
    lines.append(
        f"- {mach['cpu_count']} CPUs ({mach['cpu_model']}), torch {mach['torch']}, "
        f"MiB/s = state bytes / seconds; ratios are ckstore's time (or bytes) / DCP's; "
        "ckstore's SQLite index is local and not in the bucket's bytes"
    )
    lines.append(
        "- load average (1 min) at the start and the end: "
        f"{res['loadavg_1_5_15min']['start'][0]:.1f}, {res['loadavg_1_5_15min']['end'][0]:.1f}"
    )
    return "\n".join(lines) + "\n"
