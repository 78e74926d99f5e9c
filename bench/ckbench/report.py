"""What a run reports: results.json's content, the targets and their verdicts, the markdown
tables (results.md, also printed) and the bytes-over-saves chart."""

from __future__ import annotations

from typing import Any

from . import report_overhead, report_restore, report_training
from .harness import Bench
from .util import GiB, fmt_b, fmt_s, machine_info, median

Medians = dict[str, dict[str, float | None]]


# ---------------------------------------------------------------------------------------------
# results and targets


def medians(b: Bench) -> Medians:
    return {s: {n: median(v) for n, v in d.items()} for s, d in b.times.items()}


def results(b: Bench) -> dict[str, Any]:
    med = medians(b)
    first_bytes = {
        k.split("/", 1)[1]: median(v)
        for k, v in b.sizes.items()
        if k.startswith("first_save_bytes/")
    }
    res = {
        "machine": machine_info(),
        "config": {
            "size_mb": b.args.size_mb,
            "rounds": b.args.rounds,
            "seed": b.args.seed,
            "saves": b.args.saves,
            "systems": b.args.systems,
            "skip": b.args.skip,
            "train_saves": b.args.train_saves,
            "train_every": b.args.train_every,
            "train_dim": b.args.train_dim,
            "train_layers": b.args.train_layers,
        },
        "state": b.extra.get("state"),
        "systems": b.status,
        "times": b.times,
        "medians": med,
        "first_save_bytes": first_bytes,
        **{k: v for k, v in b.extra.items() if k != "state"},
    }
    res["targets"] = targets(b, res)
    return res


def ratio(a: float | None, c: float | None) -> float | None:
    return None if a is None or c is None or c == 0 else a / c


def target_row(name: str, value: float | None, limit: float, kind: str = "max") -> dict[str, Any]:
    """A target: ``value`` at most ``limit`` (``kind`` "max") or at least it ("min")."""
    met = value is not None and (value <= limit if kind == "max" else value >= limit)
    verdict = "n/a" if value is None else "PASS" if met else "MISS"
    return {"target": name, "value": value, "limit": limit, "kind": kind, "verdict": verdict}


def _compaction_rate(b: Bench) -> float | None:
    """Raw MB compaction rewrote per CPU-second it used (issue 21: at least 200 per core)."""
    comp = getattr(b.systems.get("ckstore"), "compactions", None) or []
    cpu = sum(c.get("cpu_seconds") or 0.0 for c in comp)
    return sum(c["raw_bytes"] for c in comp) / cpu / 1e6 if cpu else None


def targets(b: Bench, res: dict[str, Any]) -> list[dict[str, Any]]:
    med = res["medians"]
    S = b.state_bytes

    def m(s: str, n: str) -> float | None:
        return med.get(s, {}).get(n)

    fsb = res["first_save_bytes"]
    first_stats = b.extra.get("ckstore_first_stats") or [{}]
    incr_stats = b.extra.get("ckstore_incr_stats") or [{}]
    new_first = median([s["new_bytes"] for s in first_stats if s])
    new_incr = median([s["new_bytes"] for s in incr_stats if s])
    curves = b.extra.get("bytes_curves", {})
    rss = b.extra.get("peak_rss", {}).get("ckstore", {})
    ml = b.extra.get("minilm", {})
    row = target_row
    return [
        row(
            "first take time / safetensors+fsync",
            ratio(m("first_save", "ckstore"), m("first_save", "safetensors")),
            0.75 if S >= GiB else 1.0,
        ),
        row(
            "first take stored bytes / safetensors file",
            ratio(new_first, fsb.get("safetensors")),
            0.90,
        ),
        row(
            "take after 10% changed / safetensors+fsync",
            ratio(m("incremental_save", "ckstore"), m("incremental_save", "safetensors")),
            0.25,
        ),
        row("new bytes after 10% changed / state", ratio(new_incr, S), 0.12),
        row(
            f"bytes on disk after {b.args.saves} saves / one state",
            ratio(curves["ckstore"][-1], S) if "ckstore" in curves else None,
            1.10,
        ),
        row(
            f"bytes on disk after {b.args.saves} saves, all compacted / one state",
            ratio(b.extra.get("bytes_compacted", {}).get("ckstore"), S),
            1.10,
        ),
        *report_restore.targets(b, med, row),
        row(
            "take peak RSS above live / state",
            rss.get("save", {}).get("peak_above_live_fraction"),
            0.10,
        ),
        row(
            "read_object 64 MiB / full restore",
            ratio(m("read_one_tensor", "ckstore"), m("restore", "ckstore")),
            0.10,
        ),
        row("compaction: raw MB per CPU-second", _compaction_rate(b), 200, "min"),
        row("MiniLM fp32 stored / raw", ml.get("fp32", {}).get("stored_fraction"), 0.85),
        row("MiniLM bf16 stored / raw", ml.get("bf16", {}).get("stored_fraction"), 0.70),
        row(
            "async_take blocking, staging reused / sync take",
            ratio(m("async_block_again", "ckstore"), m("first_save", "ckstore")),
            0.10,
        ),
        row(
            "first async_take of a process blocking / sync take",
            ratio(m("async_block", "ckstore"), m("first_save", "ckstore")),
            0.30,
        ),
        row(
            "async_take blocking, staging reused / one memcpy of the state",
            ratio(m("async_block_again", "ckstore"), m("memcpy", "ckstore")),
            1.2,
        ),
        row(
            "first async_take of a process, after prepare_staging / one memcpy",
            ratio(m("async_block_prepared", "ckstore"), m("memcpy", "ckstore")),
            2.0,
        ),
        row(
            "first async_take after a restore (a restarted job) / one memcpy",
            ratio(m("async_block_restored", "ckstore"), m("memcpy", "ckstore")),
            2.0,
        ),
        *budget_rows(b),
    ]


def budget_rows(b: Bench) -> list[dict[str, Any]]:
    """One row per staging budget measured: async_take's peak RSS above the live state over
    the budget plus the largest chunk (at most 1)."""
    rows = []
    for f, r in b.extra.get("budget", {}).get("budgets", {}).items():
        value = r["peak_above_live"] / (r["budget"] + r["chunk_bytes"]) if "budget" in r else None
        rows.append(
            target_row(
                f"async_take peak RSS above live / (budget + chunk), budget {f}x", value, 1.0
            )
        )
    return rows


# ---------------------------------------------------------------------------------------------
# the markdown report


MAIN_PHASES = ("rounds", "bytes", "rss", "budget", "resume", "minilm", "profile")


def markdown(b: Bench, res: dict[str, Any]) -> str:
    """The main tables (when a phase other than training ran), then the training section."""
    ran = b.extra.get("phase_seconds", {})
    L = main_tables(b, res) if any(p in ran for p in MAIN_PHASES) or not ran else []
    tr = b.extra.get("training")
    if tr:
        L += ([""] if L else []) + report_training.markdown(tr)
    elif "training" in ran:
        L += ["", f"training: {b.extra.get('phase_errors', {}).get('training', 'no results')}"]
    ov = b.extra.get("overhead")
    if ov:
        L += ([""] if L else []) + report_overhead.markdown(ov)
    elif "overhead" in ran:
        L += ["", f"overhead: {b.extra.get('phase_errors', {}).get('overhead', 'no results')}"]
    return "\n".join(L) + "\n"


def main_tables(b: Bench, res: dict[str, Any]) -> list[str]:
    peers = [n for n in b.args.systems if n != "ckstore"]
    L = header(b, res)
    L.append("| scenario | ckstore | " + " | ".join(peers) + " |")
    L.append("|---|---|" + "---|" * len(peers))
    L += time_rows(b, res["medians"], peers)
    L += byte_rows(b, res["first_save_bytes"], peers)
    L += rss_rows(b, peers)
    L.append("")
    L += notes(b, res["medians"])
    L += report_restore.notes(b, res["medians"])
    L += problems(b, res["systems"])
    L.append("")
    L += target_table(res["targets"])
    return L


def header(b: Bench, res: dict[str, Any]) -> list[str]:
    mi = res["machine"]
    st = res["state"] or {}
    return [
        f"### ckstore bench: {fmt_b(st.get('bytes'))} state, {b.args.rounds} rounds, medians",
        "",
        f"Machine: {mi['cpu_count']} CPUs ({mi['cpu_model']}), {mi['ram_bytes'] / GiB:.0f} GiB RAM, "
        f"Python {mi['python']}, torch {mi['torch']}, {mi['platform']}. Local disk, warm page cache; "
        f"every system fsyncs its files and directories.",
        f"State: {st.get('params')} fp32 params + Adam (exp_avg, exp_avg_sq, step), {st.get('tensors')} "
        f"tensors; 2-D weight shapes {st.get('weight_shapes_2d')}; {st.get('changed_fraction', 0):.1%} "
        f"of the bytes change between saves.",
        "",
        "Cells: peer's figure, then ckstore / peer (below 1.0x: ckstore is faster or smaller).",
        "",
    ]


def time_rows(b: Bench, med: Medians, peers: list[str]) -> list[str]:
    def cell_t(s: str, n: str) -> str:
        v, c = med.get(s, {}).get(n), med.get(s, {}).get("ckstore")
        if not b.ok(n) and v is None:
            return "unavailable"
        if v is None:
            return "n/a"
        return fmt_s(v) + (f" ({c / v:.2f}x)" if c is not None and v else "")

    return [
        f"| {label} | {fmt_s(med.get(s, {}).get('ckstore'))} | "
        + " | ".join(cell_t(s, n) for n in peers)
        + " |"
        for s, label in (
            ("first_save", "first save (durable)"),
            ("incremental_save", "save after 10% changed"),
            ("restore", "restore in place"),
            ("restore_cold", "restore in place, cold (files evicted from the page cache)"),
            ("restore_after_cold", "restore in place, warm again after its cold restore"),
            ("restore_model", "restore the weights alone (model/**)"),
            ("read_one_tensor", "read one 64 MiB tensor"),
            ("resume", "resume: fresh process, restore, first step"),
            ("resume_script", "resume as a script does (nn.Module + AdamW built first)"),
        )
    ]


def byte_rows(b: Bench, fsb: dict[str, float | None], peers: list[str]) -> list[str]:
    def cell_b(v: float | None, c: float | None, n: str) -> str:
        if v is None:
            return "unavailable" if not b.ok(n) else "n/a"
        return fmt_b(v) + (f" ({c / v:.2f}x)" if c is not None and v else "")

    first_stats = b.extra.get("ckstore_first_stats") or []
    ck_first = median([s["new_bytes"] for s in first_stats]) if first_stats else fsb.get("ckstore")
    curves = b.extra.get("bytes_curves", {})
    ckc = curves.get("ckstore", [None])[-1]
    return [
        f"| bytes written by first save | {fmt_b(ck_first)} | "
        + " | ".join(cell_b(fsb.get(n), ck_first, n) for n in peers)
        + " |",
        f"| bytes on disk after {b.args.saves} saves | {fmt_b(ckc)} | "
        + " | ".join(cell_b(curves.get(n, [None])[-1], ckc, n) for n in peers)
        + " |",
    ]


def rss_rows(b: Bench, peers: list[str]) -> list[str]:
    rss = b.extra.get("peak_rss", {})
    rows = []
    for op in ("save", "restore"):
        ck = rss.get("ckstore", {}).get(op, {}).get("peak_above_live")
        cells = []
        for n in peers:
            v = rss.get(n, {}).get(op, {}).get("peak_above_live")
            if v is None:
                cells.append("unavailable" if not b.ok(n) or n not in rss else "n/a")
            else:
                show = ck is not None and v > 0.01 * b.state_bytes
                cells.append(f"+{v / b.state_bytes:.0%}" + (f" ({ck / v:.2f}x)" if show else ""))
        rows.append(
            f"| peak RSS above live state, {op} | "
            + (f"+{ck / b.state_bytes:.0%}" if ck is not None else "n/a")
            + " | "
            + " | ".join(cells)
            + " |"
        )
    return rows


def notes(b: Bench, med: Medians) -> list[str]:
    """The figures outside the table: store open, async_take, non-atomic restore, MiniLM."""
    L = []
    ab, sy = med.get("async_block", {}).get("ckstore"), med.get("first_save", {}).get("ckstore")
    at = med.get("async_total", {}).get("ckstore")
    so = med.get("store_open", {}).get("ckstore")
    if so is not None:
        L.append(f"Opening a new ckstore store (untimed above): {fmt_s(so)}.")
    again = med.get("async_block_again", {}).get("ckstore")
    prepared, mc = (
        med.get("async_block_prepared", {}).get("ckstore"),
        med.get("memcpy", {}).get("ckstore"),
    )
    L.append(
        f"async_take: the first of a process blocks {fmt_s(ab)} (its staging memory is new), "
        f"{fmt_s(prepared)} after prepare_staging, "
        f"{fmt_s(med.get('async_block_restored', {}).get('ckstore'))} as a restarted job's first "
        f"(after a restore), the next ones {fmt_s(again)} (they reuse it); "
        f"the first is done after {fmt_s(at)}; synchronous take {fmt_s(sy)}; one memcpy of the "
        f"state {fmt_s(mc)}."
    )
    for f, r in b.extra.get("budget", {}).get("budgets", {}).items():
        if "budget" in r:
            L.append(
                f"async_take under a staging budget of {f}x the state ({fmt_b(r['budget'])}): peak RSS "
                f"+{fmt_b(r['peak_above_live'])} above the live state ({r['samples']} samples); "
                f"blocks {fmt_s(r['blocks'][0])}, then {fmt_s(r['blocks'][1])} "
                f"(predicted from the first: {fmt_s(r['predicted'])})."
            )
    rn, tl = (
        med.get("restore_nonatomic", {}).get("ckstore"),
        med.get("restore", {}).get("torch.save"),
    )
    if rn is not None:
        L.append(
            f"restore(atomic=False), one pass straight into place: {fmt_s(rn)}"
            + (f" ({rn / tl:.2f}x torch.load(mmap)+copy_)." if tl else ".")
        )
    seq = {n: median(v) for n, v in b.extra.get("sequential_read", {}).items()}
    if seq:
        reads = {n: median(b.sizes.get(f"cold_read_bytes/{n}", [])) for n in seq}
        L.append(
            "Cold restores: sequential read of each system's files, evicted, "
            + ", ".join(f"{n} {v / 1e9:.2f} GB/s" for n, v in seq.items())
            + "; bytes each cold restore read from the disk: "
            + ", ".join(f"{n} {fmt_b(v)}" for n, v in reads.items() if v is not None and v >= 0)
            + "."
        )
        cn = med.get("restore_cold_nonatomic", {}).get("ckstore")
        if cn is not None:
            L.append(
                f"ckstore cold restore(atomic=False): {fmt_s(cn)}, "
                f"{fmt_b(median(b.sizes.get('cold_read_bytes_nonatomic/ckstore', [])))} read from the disk."
            )
    comp = b.extra.get("compactions") or []
    if comp:
        raw = sum(c["raw_bytes"] for c in comp)
        secs = sum(c["seconds"] for c in comp)
        loose, dense = sum(c["loose_bytes"] for c in comp), sum(c["dense_bytes"] for c in comp)
        threads = max(c["threads"] for c in comp)
        rate = raw / secs / 1e6 if secs else None
        cpu = sum(c.get("cpu_seconds") or 0.0 for c in comp)
        L.append(
            f"Background compaction after ckstore's takes (waited for untimed, so it runs in no timing): "
            f"{len(comp)} run(s), {fmt_b(raw)} raw rewritten in {fmt_s(secs)}"
            + (
                f" = {rate:.0f} MB/s on {threads} threads ({rate / threads:.0f} MB/s per thread)"
                if rate
                else ""
            )
            + (f", {raw / cpu / 1e6:.0f} MB per CPU-second ({fmt_s(cpu)} of CPU)" if cpu else "")
            + (f"; loose {fmt_b(loose)} -> dense {fmt_b(dense)}." if loose else ".")
        )
    ml = b.extra.get("minilm", {})
    if "fp32" in ml:
        L.append(
            f"Real MiniLM-L6 weights ({ml['tensors']} tensors): ckstore stores fp32 at "
            f"{ml['fp32']['stored_fraction']:.1%} of raw (plain zstd-1 {ml['fp32']['plain_zstd1_fraction']:.1%}), "
            f"bf16 at {ml['bf16']['stored_fraction']:.1%} (plain zstd-1 {ml['bf16']['plain_zstd1_fraction']:.1%})."
        )
    elif ml:
        L.append(f"MiniLM: {ml.get('error')}")
    return L


def problems(b: Bench, systems: dict[str, str]) -> list[str]:
    """Unavailable systems, and systems that restored wrong bytes or not in place."""
    L = [f"- {n}: {s}" for n, s in systems.items() if s != "ok"]
    for key, label in (
        ("restore_correct", "restored bytes equal"),
        ("restore_in_place", "restored in place"),
    ):
        d = b.extra.get(key, {})
        wrong = [n for n, v in d.items() if not v]
        if wrong:
            L.append(f"- {label}: NO for {', '.join(wrong)}")
    return L


def target_table(rows: list[dict[str, Any]]) -> list[str]:
    L = ["| target | measured | limit | verdict |", "|---|---|---|---|"]
    for t in rows:
        v = "n/a" if t["value"] is None else f"{t['value']:.3f}"
        limit = f"{'>= ' if t.get('kind') == 'min' else ''}{t['limit']}"
        L.append(f"| {t['target']} | {v} | {limit} | {t['verdict']} |")
    return L


# ---------------------------------------------------------------------------------------------
# the chart


def chart(b: Bench) -> str | None:
    """bytes_over_saves.png from the bytes-over-saves curves; its path, or None."""
    curves = b.extra.get("bytes_curves", {})
    if not curves:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # noqa: BLE001
        b.log(f"  no chart: {exc}")
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for n, c in curves.items():
        ax.plot(
            range(1, len(c) + 1),
            [x / GiB for x in c],
            marker="o",
            label=n,
            linewidth=2.5 if n == "ckstore" else 1.5,
        )
    ax.axhline(b.state_bytes / GiB, color="grey", linestyle=":", label="one state (raw)")
    ax.set_xlabel("save number (10% of the weights changed between saves)")
    ax.set_ylabel("bytes on disk (GiB)")
    ax.set_title(f"Bytes on disk over successive saves ({fmt_b(b.state_bytes)} state)")
    ax.set_xticks(range(1, b.args.saves + 1))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = b.out / "bytes_over_saves.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
