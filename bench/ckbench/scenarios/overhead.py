"""The training-loop scenario: what a checkpoint every k steps costs a training job that goes on.

A small transformer (``training_model.TinyGPT``, its vocabulary sized so that its fp32 weights
and AdamW state come to ``--overhead-mb``) trains on the CPU with torch on
``--overhead-threads`` threads (default 1: the other cores are the host's spare capacity, as
the CPUs beside a GPU are), or on a GPU with ``--overhead-device cuda`` (then every system
stages into pinned memory: ckstore's arena, DCP's cached staging, the torch.save copies). Each system of ``async_systems`` and ``plain`` (no checkpoint)
runs in turn for every interval k of ``--overhead-ks``, the order rotating every cycle:

    a run is ``run_steps(k)`` training steps, each timed, with a checkpoint started every k
    steps: the previous one's background work is waited for first (``wait``, as a training
    loop must before it stages again), checkpoints past the last two are deleted (``tidy``,
    timed on its own), then ``begin`` (``block``: the call training waits for); after the
    last step the last checkpoint is waited for (``wait_end``) and tidied. A run's wall clock
    is everything between its first ``begin`` and its end, less its tidies: retention is
    reported per take beside it, not counted in the overhead.

Per system and k (``report_overhead`` summarises): the blocking of each checkpoint (the first
of the process apart, from the warm-up), the mean slowdown of the 10 steps after a take against
the steps at the same places of the ``plain`` run of the same cycle, the wall-clock overhead of
the run against the ``plain`` run of the same cycle (each a median over cycles, with its spread),
and the CPU seconds the process spent outside the training thread per checkpoint. One memcpy
of the state (into memory already touched, with the trainer's threads) is timed as the unit
blocking is held against.

Results: ``b.extra["overhead"]``.
"""

from __future__ import annotations

import gc
import math
import os
import resource
import shutil
import socket
import statistics
import time
from typing import Any

import torch

from ..async_systems import ASYNC_SYSTEMS, AsyncSystem, CkstoreAsync
from ..harness import Bench
from ..report_overhead import targets
from ..training_model import TrainConfig, Trainer, fp32_state
from ..util import MiB, fmt_b, fmt_s

AFTER = 10
"""Steps after a take whose slowdown is reported."""
WARMUP_STEPS = 5


def overhead(b: Bench) -> None:
    """The phase (see the module docstring)."""
    a = b.args
    threads = torch.get_num_threads()
    torch.set_num_threads(a.overhead_threads)
    group = _one_rank_group() if "dcp-process" in a.overhead_systems else False
    gc.collect()
    gc.freeze()
    try:
        b.extra["overhead"] = run(b, group)
    finally:
        gc.unfreeze()
        torch.set_num_threads(threads)
        if group:
            torch.distributed.destroy_process_group()


def config_for(state_mb: int, dim: int = 384, layers: int = 4, device: str = "cpu") -> TrainConfig:
    """A model whose fp32 weights + AdamW moments (12 bytes a parameter) come to about
    ``state_mb`` MiB: the blocks fixed by ``dim`` and ``layers``, the vocabulary (embedding and
    untied head) sized to the rest."""
    seq = 32
    rest = layers * (12 * dim * dim + 13 * dim) + seq * dim + 2 * dim
    vocab = max(256, int((state_mb * MiB / 12 - rest) / (2 * dim)))
    return TrainConfig(
        dim=dim,
        layers=layers,
        heads=max(1, dim // 64),
        vocab=vocab,
        seq=seq,
        batch=2,
        device=device,
    )


def run_steps(k: int) -> int:
    """Steps in a run at interval ``k``: at least 20, a multiple of k."""
    return k * max(1, math.ceil(20 / k))


def run(b: Bench, group: bool) -> dict[str, Any]:
    a = b.args
    cfg = config_for(a.overhead_mb, device=a.overhead_device)
    t = Trainer(cfg)
    t.steps(WARMUP_STEPS)
    state = fp32_state(t)
    nbytes = _tensor_bytes(state)
    b.log(
        f"training loop: {sum(p.numel() for p in t.model.parameters()) / 1e6:.1f}M params, "
        f"state {fmt_b(nbytes)}, torch on {torch.get_num_threads()} thread(s) of "
        f"{os.cpu_count()} CPUs; intervals {a.overhead_ks}, {a.overhead_cycles} cycles at k=10"
    )
    systems = _setup(b, group)
    out: dict[str, Any] = {
        "model": {
            "dim": cfg.dim,
            "layers": cfg.layers,
            "vocab": cfg.vocab,
            "seq": cfg.seq,
            "device": cfg.device,
        },
        "state_bytes": nbytes,
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "memcpy_samples": _memcpy(state),
        "first_block": {},
        "runs": {},
        "unavailable": {},
    }
    for name, sys_ in list(systems.items()):
        try:
            out["first_block"][name] = _first(t, sys_)
        except Exception as exc:  # noqa: BLE001 - a failing peer must not stop the run
            _drop(b, systems, name, exc, out)
    for k in a.overhead_ks:
        cycles = a.overhead_cycles if k == AFTER else max(2, math.ceil(a.overhead_cycles / 3))
        for c in range(cycles):
            names = list(systems)
            order = names[c % len(names) :] + names[: c % len(names)]
            for name in order:
                if name not in systems:
                    continue
                try:
                    rec = one_run(t, systems[name], k)
                except Exception as exc:  # noqa: BLE001
                    _drop(b, systems, name, exc, out)
                    continue
                out["runs"].setdefault(str(k), {}).setdefault(name, []).append(rec)
            b.log(f"  k={k} cycle {c + 1}/{cycles}: " + _line(out["runs"][str(k)], c))
            out["memcpy_samples"] += _memcpy(fp32_state(t))  # the unit drifts with the VM
    for sys_ in systems.values():
        try:
            sys_.close()
        except Exception:  # noqa: BLE001
            pass
    shutil.rmtree(b.work / "overhead", ignore_errors=True)
    out["memcpy_seconds"] = statistics.median(out["memcpy_samples"])
    out["summary"] = summarize(out)
    out["targets"] = targets(out)
    return out


def _setup(b: Bench, group: bool) -> dict[str, AsyncSystem]:
    systems: dict[str, AsyncSystem] = {}
    for name in ["plain", *b.args.overhead_systems]:
        sys_ = ASYNC_SYSTEMS[name]()
        if isinstance(sys_, CkstoreAsync):
            sys_.no_dist = bool(group)
        try:
            if name == "dcp-process" and not group:
                raise RuntimeError("no one-rank process group could be started")
            sys_.setup(b.fresh("overhead", name.replace(".", "_")))
            systems[name] = sys_
        except Exception as exc:  # noqa: BLE001
            b.status[f"overhead:{name}"] = f"unavailable: {type(exc).__name__}: {exc}"[:400]
            b.log(f"  {name}: {b.status[f'overhead:{name}']}")
    return systems


def _drop(
    b: Bench, systems: dict[str, AsyncSystem], name: str, exc: BaseException, out: dict[str, Any]
) -> None:
    b.log(f"  !! {name} failed: {type(exc).__name__}: {exc}")
    out["unavailable"][name] = f"{type(exc).__name__}: {exc}"[:400]
    systems.pop(name, None)


def _first(t: Trainer, sys_: AsyncSystem) -> float:
    """The blocking of the system's first checkpoint in this process (then a few steps and its
    end, untimed)."""
    t0 = time.perf_counter()
    at = t.step
    h = sys_.begin(fp32_state(t), at)
    block = time.perf_counter() - t0
    t.steps(WARMUP_STEPS)
    sys_.end(h)
    sys_.tidy(at)
    return block


def one_run(t: Trainer, sys_: AsyncSystem, k: int) -> dict[str, Any]:
    """One run of ``run_steps(k)`` steps with a checkpoint every ``k`` (see the module
    docstring); the figures of each part."""
    n = run_steps(k)
    gc.collect()
    steps, blocks, waits, reports, tidies = [], [], [], [], []
    cpu, delay = [], []  # the training thread's CPU seconds and run-queue waits per step
    handle: Any = None
    at = first_step = t.step
    cpu0, main0 = _process_cpu(), time.thread_time()
    t0 = time.perf_counter()
    for j in range(n):
        if j % k == 0:
            w0 = time.perf_counter()
            if handle is not None:
                reports.append(sys_.end(handle))
            w1 = time.perf_counter()
            if handle is not None:
                tidies.append(_timed(sys_.tidy, at))
            at = t.step
            b0 = time.perf_counter()
            handle = sys_.begin(fp32_state(t), at)
            blocks.append(time.perf_counter() - b0)
            waits.append(w1 - w0)
        s0, c0, d0 = time.perf_counter(), time.thread_time(), _run_delay()
        t.steps(1)
        steps.append(time.perf_counter() - s0)
        cpu.append(time.thread_time() - c0)
        delay.append(_run_delay() - d0)
    e0 = time.perf_counter()
    if handle is not None:
        reports.append(sys_.end(handle))
    end = time.perf_counter()
    background_cpu = (_process_cpu() - cpu0) - (time.thread_time() - main0)
    if handle is not None:
        tidies.append(_timed(sys_.tidy, at))
    takes = len(blocks) if sys_.name != "plain" else 0
    return {
        "k": k,
        "first_step": first_step,
        "steps": steps,
        "step_cpu": cpu,
        "step_run_delay": delay,
        "block": blocks if takes else [],
        "wait": waits if takes else [],
        "wait_end": end - e0,
        "seconds": end - t0 - sum(tidies[:-1]),  # the last one ran after ``end``
        "tidy": tidies if takes else [],
        "takes": takes,
        "background_cpu": background_cpu,
        "reports": [r for r in reports if r],
    }


def _timed(fn: Any, *args: Any) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def _run_delay() -> float:
    """Seconds this thread has waited for a CPU while runnable (Linux schedstat; 0 elsewhere):
    with its CPU time, it splits a step's wall time into running, waiting for a core, and
    sleeping (the GIL, for a training thread that does no I/O)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def _process_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _tensor_bytes(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_tensor_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_tensor_bytes(v) for v in state)
    return 0


def _tensors(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in _tensors(v)]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in _tensors(v)]
    return []


def _memcpy(state: dict[str, Any], reps: int = 5) -> list[float]:
    """Seconds to copy every tensor of ``state`` into memory already touched, with the
    trainer's torch threads, ``reps`` times: the unit an async take's blocking is held against
    (sampled before the runs and after every cycle, its median over all of them)."""
    src = _tensors(state)
    pin = any(s.is_cuda for s in src)  # from a GPU: into pinned memory, as the peers stage
    dst = [torch.empty(s.shape, dtype=s.dtype, pin_memory=pin).copy_(s) for s in src]
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for d, s in zip(dst, src):
            d.copy_(s, non_blocking=pin)
        if pin:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def _one_rank_group() -> bool:
    """A one-rank gloo process group (DCP's process-based async save needs one); False when
    none can be started."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    except Exception:  # noqa: BLE001 - dcp-process is then reported unavailable
        return False
    return True


# ---------------------------------------------------------------------------------------------
# summary


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _spread(xs: list[float]) -> dict[str, float | int | None]:
    if not xs:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def _after(rec: dict[str, Any], field: str = "steps") -> list[float]:
    """A figure of the steps of a run that follow a take by at most AFTER steps (at k >= AFTER:
    the first AFTER of each interval)."""
    k = rec["k"]
    return [s for j, s in enumerate(rec[field]) if j % k < AFTER]


def _parts(rec: dict[str, Any]) -> dict[str, float]:
    """The mean seconds per step after a take: running, waiting for a core, and neither
    (sleeping: waiting for the GIL)."""
    wall, cpu, delay = (_mean(_after(rec, f)) for f in ("steps", "step_cpu", "step_run_delay"))
    return {"cpu": cpu, "run_delay": delay, "sleep": max(0.0, wall - cpu - delay)}


def summarize(out: dict[str, Any]) -> dict[str, Any]:
    """Per k and system: blocking, slowdown of the steps after a take, wall-clock overhead,
    background CPU per take; each paired with the plain run of the same cycle."""
    summary: dict[str, Any] = {}
    memcpy = out["memcpy_seconds"]
    for k, by_sys in out["runs"].items():
        plain = by_sys.get("plain", [])
        per: dict[str, Any] = {}
        for name, recs in by_sys.items():
            if name == "plain":
                continue
            pairs = list(zip(recs, plain))
            blocks = [x for r in recs for x in r["block"]]
            slow = [_mean(_after(r)) / _mean(_after(p)) - 1 for r, p in pairs if int(k) >= AFTER]
            wall = [r["seconds"] / p["seconds"] - 1 for r, p in pairs]
            extra = [
                {f: _parts(r)[f] - _parts(p)[f] for f in ("cpu", "run_delay", "sleep")}
                for r, p in pairs
                if int(k) >= AFTER
            ]
            per[name] = {
                "block": _spread(blocks),
                "block_over_memcpy": statistics.median(blocks) / memcpy if blocks else None,
                "slowdown_after": _spread(slow),
                "overhead": _spread(wall),
                "background_cpu_per_take": _spread(
                    [r["background_cpu"] / r["takes"] for r in recs if r["takes"]]
                ),
                "step_extra": {
                    f: _spread([e[f] for e in extra]) for f in ("cpu", "run_delay", "sleep")
                },
                "wait_per_take": _spread([_mean(r["wait"][1:] + [r["wait_end"]]) for r in recs]),
                "tidy_per_take": _spread([x for r in recs for x in r.get("tidy", [])]),
            }
        summary[k] = {
            "plain_step": _spread([s for p in plain for s in p["steps"]]),
            "systems": per,
        }
    first = out["first_block"]
    summary["first_block_over_memcpy"] = {n: v / memcpy for n, v in first.items() if n != "plain"}
    return summary


def _line(by_sys: dict[str, list[dict[str, Any]]], c: int) -> str:
    parts = []
    plain = by_sys.get("plain", [])
    p = plain[c] if c < len(plain) else None
    for name, recs in by_sys.items():
        r = recs[c] if c < len(recs) else None
        if r is None:
            continue
        text = f"{name} {fmt_s(r['seconds'])}"
        if p is not None and name != "plain":
            text += f" ({r['seconds'] / p['seconds'] - 1:+.1%}"
            if r["block"]:
                text += f", block {fmt_s(statistics.median(r['block']))}"
            text += ")"
        parts.append(text)
    return "; ".join(parts)
