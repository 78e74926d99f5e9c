"""One adapter per checkpointing system: save(state, root, i) -> handle; restore(handle, dest);
read(handle) -> tensor. Every save is durable (files and their directories fsynced)."""

from __future__ import annotations

import inspect
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from .states import READ_KEY, copy_into, flat_tensors, iter_tensors
from .util import fsync_path, fsync_tree

ALL_SYSTEMS = ("ckstore", "safetensors", "torch.save", "dcp", "dcp+zstd", "torchsnapshot")
# Also accepted by --systems; the training phase adds it next to ckstore by itself.
EXTRA_SYSTEMS = ("ckstore+delta",)


class Unavailable(Exception):
    pass


class System:
    name = ""

    def setup(self) -> None:
        """Raise Unavailable (or anything) when the system cannot run here."""

    def prepare(self, root: Path) -> None:
        """Untimed setup before the first save into ``root`` (ckstore opens its store)."""

    def save(self, state: dict[str, Any], root: Path, i: int) -> Any:
        raise NotImplementedError

    def settle(self, root: Path) -> None:
        """Untimed, after each timed save: let work the save left in the background finish,
        so it runs in nobody's timing (ckstore's compaction)."""

    def handle(self, root: Path, i: int) -> Any:
        raise NotImplementedError

    def restore(self, h: Any, dest: dict[str, Any]) -> None:
        raise NotImplementedError

    def read(self, h: Any, shape: tuple[int, ...]) -> torch.Tensor:
        raise NotImplementedError

    def close(self, root: Path) -> None:
        pass


class Ckstore(System):
    name = "ckstore"
    open_seconds: float  # how long prepare() took to open (create) the store

    def setup(self) -> None:
        import ckstore

        self.ck = ckstore
        self.stores: dict[Path, Any] = {}
        self.last_stats: dict[str, int] = {}
        self.last_compaction: Any = None
        self.compactions: list[dict[str, float]] = []

    open_options: dict[str, Any] = {}  # noqa: RUF012 - read only

    def store(self, root: Path) -> Any:
        if root not in self.stores:
            self.stores[root] = self.ck.open(root / "store", create=True, **self.open_options)
        return self.stores[root]

    def compact_all(self, root: Path) -> bool:
        """Untimed: compact every snapshot, the newest too (``keep_loose=0``); False where this
        store does not compact."""
        store = self.stores.get(root)
        if store is None or not store.auto_compact:
            return False
        store.wait_compacted()
        store.compact(keep_loose=0)
        return True

    def compacted_added(self, root: Path) -> list[int] | None:
        """Untimed: compact every snapshot (``keep_loose=0``), then the stored bytes of the
        chunks each snapshot of the run added (held by no earlier one), in step order; None
        where this store does not compact."""
        if not self.compact_all(root):
            return None
        store = self.stores[root]
        index = store.repository.index
        seen: set[str] = set()
        out = []
        for snap in sorted(store.log(run="bench"), key=lambda s: s.step):
            ids = index.snapshot_chunk_ids(snap.id) - seen
            rows = index.chunk_locations(
                ids
            )  # with the bases of its deltas: counted once, where added
            out.append(sum(rows[c].length for c in ids if c in rows))
            seen |= ids
        return out

    def app(self, state: dict[str, Any]) -> dict[str, Any]:
        return {k: self.ck.StateDict(v) for k, v in state.items()}

    def prepare(self, root: Path) -> None:
        t0 = time.perf_counter()
        self.store(root)
        self.open_seconds = time.perf_counter() - t0

    def handle(self, root: Path, i: int) -> Any:
        return (root, f"bench@{i}")

    def save(self, state: dict[str, Any], root: Path, i: int) -> Any:
        snap = self.store(root).take(self.app(state), run="bench", step=i)
        self.last_stats = dict(snap.stats)
        return self.handle(root, i)

    def settle(self, root: Path) -> None:
        """Wait for the background compaction the take started; record how long the wait was
        and what the compaction did (``compactions``: seconds, raw bytes, threads)."""
        store = self.stores.get(root)
        if store is None:
            return
        t0 = time.perf_counter()
        store.wait_compacted()
        waited = time.perf_counter() - t0
        report = store.last_compaction
        if report is not None and report is not self.last_compaction:
            self.last_compaction = report
            self.compactions.append(
                {
                    "seconds": report.seconds,
                    "cpu_seconds": getattr(report, "cpu_seconds", None),
                    "raw_bytes": report.raw_bytes,
                    "loose_bytes": report.loose_bytes,
                    "dense_bytes": report.dense_bytes,
                    "chunks": report.chunks,
                    "threads": store.threads,
                    "waited": waited,
                }
            )

    def restore(self, h: Any, dest: dict[str, Any], atomic: bool = True) -> None:
        root, ref = h
        self.store(root).get(ref).restore(self.app(dest), atomic=atomic)

    def read(self, h: Any, shape: tuple[int, ...]) -> torch.Tensor:
        root, ref = h
        return self.store(root).get(ref).read_object(f"model/{READ_KEY}")

    def close(self, root: Path) -> None:
        s = self.stores.pop(root, None)
        if s is not None:
            s.close()


class CkstoreDelta(Ckstore):
    """ckstore taking every snapshot as a delta against the run's latest one at the take
    (``take(..., delta_base="parent")``) with dense takes and no compaction, as ckstore stored
    before loose takes (with compaction on, compaction makes the same deltas later and the take
    defers to it); the reference for what compaction must match. Unavailable where ``Store.take`` has no
    ``delta_base``."""

    name = "ckstore+delta"
    open_options = {"auto_compact": False, "take_codec": "dense"}  # noqa: RUF012 - as before loose takes

    def setup(self) -> None:
        super().setup()
        if not supports_delta(self.ck):
            raise Unavailable("this ckstore's Store.take has no delta_base keyword")

    def save(self, state: dict[str, Any], root: Path, i: int) -> Any:
        store = self.store(root)
        snap = store.take(self.app(state), run="bench", step=i, delta_base="parent")
        self.last_stats = dict(snap.stats)
        # the chain depth this snapshot reads through (index only, untimed work after the take)
        rows = store.repository.index.chunk_locations(snap.manifest.chunk_ids())
        self.last_stats["max_depth"] = max((r.depth for r in rows.values()), default=0)
        self.last_stats["depth_limit"] = store.delta_depth
        return self.handle(root, i)


def supports_delta(ck: Any) -> bool:
    """Whether ``ck.Store.take`` accepts ``delta_base`` (the incremental-checkpoint feature)."""
    return "delta_base" in inspect.signature(ck.Store.take).parameters


class TorchSave(System):
    name = "torch.save"

    def handle(self, root: Path, i: int) -> Any:
        return root / f"ckpt{i}.pt"

    def save(self, state: dict[str, Any], root: Path, i: int) -> Any:
        path = self.handle(root, i)
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_path(root)
        return path

    def restore(self, h: Any, dest: dict[str, Any]) -> None:
        loaded = torch.load(h, mmap=True, weights_only=True)
        copy_into(loaded, dest)

    def read(self, h: Any, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.load(h, mmap=True, weights_only=True)["model"][READ_KEY].clone()


class Safetensors(System):
    name = "safetensors"

    def setup(self) -> None:
        import safetensors.torch

        self.st = safetensors.torch
        from safetensors import safe_open

        self.safe_open = safe_open

    def handle(self, root: Path, i: int) -> Any:
        return root / f"ckpt{i}.safetensors"

    def save(self, state: dict[str, Any], root: Path, i: int) -> Any:
        path = self.handle(root, i)
        meta = (
            {"param_groups": json.dumps(state["optim"]["param_groups"])}
            if "optim" in state
            else None
        )
        self.st.save_file(flat_tensors(state), str(path), metadata=meta)
        fsync_path(path)
        fsync_path(root)
        return path

    def restore(self, h: Any, dest: dict[str, Any]) -> None:
        loaded = self.st.load_file(str(h))
        for k, t in iter_tensors(dest):
            t.copy_(loaded[k])

    def read(self, h: Any, shape: tuple[int, ...]) -> torch.Tensor:
        with self.safe_open(str(h), framework="pt") as f:
            return f.get_tensor(f"model/{READ_KEY}").clone()  # get_tensor is a lazy mmap view


class Dcp(System):
    name = "dcp"
    zstd = False

    def setup(self) -> None:
        import torch.distributed.checkpoint as dcp

        self.dcp = dcp
        self.extensions: list[Any] = []
        if self.zstd:
            try:
                from torch.distributed.checkpoint._extension import ZStandard
            except ImportError as exc:
                raise Unavailable(
                    f"torch {torch.__version__} has no DCP ZStandard extension ({exc})"
                ) from exc
            if not ZStandard.is_available():
                raise Unavailable("DCP ZStandard extension present but zstandard/pyzstd missing")
            self.extensions = [ZStandard()]

    def handle(self, root: Path, i: int) -> Any:
        return root / f"ckpt{i}"

    def save(self, state: dict[str, Any], root: Path, i: int) -> Any:
        path = self.handle(root, i)
        kw: dict[str, Any] = {"sync_files": True}
        if self.extensions:
            kw["_extensions"] = self.extensions
        self.dcp.save(state, storage_writer=self.dcp.FileSystemWriter(str(path), **kw))
        fsync_path(path)  # DCP fsyncs its files, not their directory
        fsync_path(root)
        return path

    def restore(self, h: Any, dest: dict[str, Any]) -> None:
        self.dcp.load(dest, storage_reader=self.dcp.FileSystemReader(str(h)))

    def read(self, h: Any, shape: tuple[int, ...]) -> torch.Tensor:
        out = {"model": {READ_KEY: torch.empty(shape)}}
        self.dcp.load(out, storage_reader=self.dcp.FileSystemReader(str(h)))
        return out["model"][READ_KEY]


class DcpZstd(Dcp):
    name = "dcp+zstd"
    zstd = True


class TorchSnapshotApp:
    """What every TorchSnapshot system shares: the import (unavailable when it fails) and its
    app_state of ``StateDict``s."""

    ts: Any

    def setup(self) -> None:
        try:
            import torchsnapshot
        except Exception as exc:  # noqa: BLE001 - any import failure makes it unavailable
            raise Unavailable(f"import torchsnapshot failed: {type(exc).__name__}: {exc}") from exc
        self.ts = torchsnapshot

    def app(self, state: dict[str, Any]) -> dict[str, Any]:
        return {k: self.ts.StateDict(**v) for k, v in state.items()}


class TorchSnapshot(TorchSnapshotApp, System):
    name = "torchsnapshot"

    def handle(self, root: Path, i: int) -> Any:
        return root / f"snap{i}"

    def save(self, state: dict[str, Any], root: Path, i: int) -> Any:
        path = self.handle(root, i)
        self.ts.Snapshot.take(path=str(path), app_state=self.app(state))
        fsync_tree(path)  # TorchSnapshot does not fsync
        fsync_path(root)
        return path

    def restore(self, h: Any, dest: dict[str, Any]) -> None:
        app = self.app(dest)
        self.ts.Snapshot(str(h)).restore(app)
        for k in dest:  # StateDict(**v) is a copy of the top level: hand back non-tensor values
            for kk, v in app[k].items():
                if not isinstance(dest[k].get(kk), torch.Tensor):
                    dest[k][kk] = v

    def read(self, h: Any, shape: tuple[int, ...]) -> torch.Tensor:
        return self.ts.Snapshot(str(h)).read_object(f"0/model/{READ_KEY}")


SYSTEM_CLASSES: dict[str, type[System]] = {
    c.name: c for c in (Ckstore, CkstoreDelta, Safetensors, TorchSave, Dcp, DcpZstd, TorchSnapshot)
}
