"""The shared state of one benchmark run: the systems, the state being saved, the timings and
the extra results, and the bookkeeping every scenario uses (timing, failure, fresh folders)."""

from __future__ import annotations

import argparse
import gc
import shutil
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .states import (
    READ_KEY,
    build_state,
    choose_trainable,
    empty_like_state,
    flat_tensors,
    state_bytes,
)
from .systems import SYSTEM_CLASSES, Ckstore, System
from .util import MiB, fmt_b


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = Path(args.out).resolve()
        self.work = self.out / "work"
        self.size = args.size_mb * MiB
        self.systems: dict[str, System] = {}
        self.status: dict[str, str] = {}
        self.times: dict[str, dict[str, list[float]]] = {}
        self.extra: dict[str, Any] = {}
        self.sizes: dict[str, list[int]] = {}
        self.state: dict[str, Any] = {}
        self.dest: dict[str, Any] = {}
        self.state_bytes = 0
        self.trainable: list[str] = []

    # -- bookkeeping
    def log(self, msg: str) -> None:
        print(msg, flush=True)

    def fail(self, name: str, where: str, exc: BaseException) -> None:
        reason = f"unavailable: {where}: {type(exc).__name__}: {exc}".replace("\n", " ")[:400]
        if self.status.get(name) == "ok":
            self.status[name] = reason
        self.log(f"  !! {name} failed in {where}: {type(exc).__name__}: {exc}")
        if self.args.verbose:
            traceback.print_exc()

    def ok(self, name: str) -> bool:
        return self.status.get(name) == "ok"

    def record(self, scenario: str, name: str, seconds: float) -> None:
        self.times.setdefault(scenario, {}).setdefault(name, []).append(seconds)

    def timed(self, scenario: str, name: str, fn: Callable[[], Any]) -> Any:
        """Run fn, record its wall time; on error mark the system unavailable and return None."""
        if not self.ok(name):
            return None
        gc.collect()
        try:
            t0 = time.perf_counter()
            r = fn()
            dt = time.perf_counter() - t0
        except Exception as exc:  # noqa: BLE001 - a failing peer must not stop the run
            self.fail(name, scenario, exc)
            return None
        self.record(scenario, name, dt)
        return r

    def fresh(self, *parts: str) -> Path:
        p = self.work.joinpath(*parts)
        shutil.rmtree(p, ignore_errors=True)
        p.mkdir(parents=True)
        return p

    def order(self, r: int) -> list[str]:
        """The available systems in the order of round ``r`` (rotated by one every round)."""
        names = [n for n in self.args.systems if n in self.systems]
        k = r % len(names) if names else 0
        return names[k:] + names[:k]

    def ckstore(self) -> Ckstore:
        ck = self.systems["ckstore"]
        assert isinstance(ck, Ckstore)
        return ck

    # -- setup
    def setup(self, state: bool = True) -> None:
        """The systems, an empty work folder and (when ``state``) the synthetic state."""
        self.setup_systems()
        shutil.rmtree(self.work, ignore_errors=True)
        self.work.mkdir(parents=True)
        if state:
            self.setup_state()

    def setup_systems(self) -> None:
        for n in self.args.systems:
            sys_ = SYSTEM_CLASSES[n]()
            try:
                sys_.setup()
                self.status[n] = "ok"
                self.systems[n] = sys_
            except Exception as exc:  # noqa: BLE001
                self.status[n] = f"unavailable: {type(exc).__name__}: {exc}"[:400]
                self.log(f"  {n}: {self.status[n]}")

    def setup_state(self) -> None:
        t0 = time.perf_counter()
        self.state = build_state(self.size, self.args.seed)
        self.state_bytes = state_bytes(self.state)
        self.trainable = choose_trainable(self.state, 0.10)
        changed = sum(3 * self.state["model"][k].numel() * 4 for k in self.trainable)
        shapes = sorted({tuple(t.shape) for t in self.state["model"].values() if t.dim() == 2})
        self.extra["state"] = {
            "bytes": self.state_bytes,
            "tensors": len(flat_tensors(self.state)),
            "params": len(self.state["model"]),
            "weight_shapes_2d": [list(s) for s in shapes],
            "read_key": f"model/{READ_KEY}",
            "read_key_bytes": self.state["model"][READ_KEY].numel() * 4,
            "trainable_params": self.trainable,
            "changed_bytes_per_step": changed,
            "changed_fraction": changed / self.state_bytes,
            "build_seconds": time.perf_counter() - t0,
        }
        self.log(
            f"state: {fmt_b(self.state_bytes)} in {self.extra['state']['tensors']} tensors; "
            f"{len(self.trainable)} trainable params = {changed / self.state_bytes:.1%} of the bytes "
            f"change per step; built in {self.extra['state']['build_seconds']:.1f} s"
        )
        self.dest = empty_like_state(self.state)
