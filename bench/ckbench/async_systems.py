"""One adapter per background checkpoint, for the training-loop scenario
(``scenarios/overhead.py``): ``begin(state, i)`` blocks for what the system needs before training
may go on (its staging copy) and returns a handle; ``end(handle)`` waits for the background work
(durable: files and directories fsynced) and whatever it set off (ckstore's compaction).

- ``plain``: no checkpoint (the baseline the others are held against)
- ``ckstore``: ``store.async_take`` into one store (its staging arena is reused take after take)
- ``ckstore-buffered``: the same, its background part writing through the page cache (knob
  ``direct_writes="never"``; the default writes around it)
- ``ckstore-process``: the same, finished in the store handle's helper process fed through
  shared memory (knob ``background_process``), the helper started before anything is timed
- ``dcp``: ``dcp.async_save``, thread-based, with ``FileSystemWriter(cache_staged_state_dict=True)``
  (its staging copy is cached and reused, as torchtitan runs it)
- ``dcp-process``: ``dcp.async_save`` with ``AsyncCheckpointerType.PROCESS`` (the save runs in a
  helper process) and ``DefaultStager`` staging into shared memory; needs a process group, so
  the scenario starts a one-rank gloo group when this system is selected
- ``torch.save``: the state copied into host buffers kept from the previous save (pinned for
  a GPU's tensors), then ``torch.save`` and an fsync in a thread

Every system keeps its last two checkpoints on disk, as a job with retention does (Lightning's
``save_top_k``, the Trainer's ``save_total_limit``): the scenario calls ``tidy`` once each
checkpoint is done, before the next begins, and keeps its time out of the run's wall clock
(reported on its own as retention per take).
"""

from __future__ import annotations

import shutil
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from .util import fsync_path

KEEP = 2


class AsyncSystem:
    name = ""

    def setup(self, root: Path) -> None:
        """Untimed, once: raise (anything) when the system cannot run here."""
        self.root = root
        self._done: list[int] = []  # the checkpoints done, oldest first (``tidy``)

    def begin(self, state: dict[str, Any], i: int) -> Any:
        """Start checkpoint ``i`` of ``state`` (live tensors); return once training may go on."""
        raise NotImplementedError

    def end(self, handle: Any) -> dict[str, Any]:
        """Wait until checkpoint ``handle`` is durable and its background work is done; what
        the system reports about it (may be empty)."""
        raise NotImplementedError

    def tidy(self, i: int) -> None:
        """Checkpoint ``i`` is done (durable, its background work ended): drop those older
        than the last ``KEEP`` done."""
        self._done.append(i)
        while len(self._done) > KEEP:
            old = self.root / f"ckpt{self._done.pop(0)}"
            shutil.rmtree(old, ignore_errors=True)
            old.with_suffix(".pt").unlink(missing_ok=True)

    def close(self) -> None:
        pass


class Plain(AsyncSystem):
    name = "plain"

    def begin(self, state: dict[str, Any], i: int) -> Any:
        return None

    def end(self, handle: Any) -> dict[str, Any]:
        return {}

    def tidy(self, i: int) -> None:
        pass


class CkstoreAsync(AsyncSystem):
    name = "ckstore"
    no_dist = False  # set by the scenario when it started a process group for dcp-process

    def setup(self, root: Path) -> None:
        super().setup(root)
        import ckstore

        self.ck = ckstore
        self.store = ckstore.open(root / "store", create=True)
        # the take's modules imported now: the first checkpoint's blocking is its new memory
        self.store.take({"w": ckstore.StateDict(x=torch.zeros(4))}, run="warm", no_dist=True)

    def app(self, state: dict[str, Any]) -> dict[str, Any]:
        return {k: self.ck.StateDict(v) for k, v in state.items()}

    def begin(self, state: dict[str, Any], i: int) -> Any:
        kw = {"no_dist": True} if self.no_dist else {}
        return self.store.async_take(self.app(state), run="bench", step=i, on_stale="ignore", **kw)

    def end(self, handle: Any) -> dict[str, Any]:
        handle.wait()
        self.store.wait_compacted()
        report = getattr(handle, "blocking", None)  # what the call blocked for, and why
        return dict(report.to_dict()) if report is not None else {}

    def tidy(self, i: int) -> None:
        self.store.wait_compacted()
        self.store.gc(keep_last=KEEP, keep_healthy=False, grace_seconds=0)

    def close(self) -> None:
        self.store.close()


class CkstoreProcess(CkstoreAsync):
    """ckstore's ``async_take`` finished in its helper process (knob ``background_process``)."""

    name = "ckstore-process"

    def setup(self, root: Path) -> None:
        super().setup(root)
        self.store.background_process = True
        # the helper process started (and its imports done) before anything is timed
        tiny = {"w": self.ck.StateDict(x=torch.zeros(4))}
        self.store.async_take(tiny, run="warm", no_dist=True).wait()


class CkstoreBuffered(CkstoreAsync):
    """ckstore's ``async_take`` with its background part writing through the page cache
    (knob ``direct_writes="never"``), beside the default's direct writes."""

    name = "ckstore-buffered"

    def setup(self, root: Path) -> None:
        super().setup(root)
        self.store.direct_writes = "never"


class DcpAsync(AsyncSystem):
    name = "dcp"
    process = False

    def setup(self, root: Path) -> None:
        super().setup(root)
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        self.dcp = dcp
        self.kind = AsyncCheckpointerType.PROCESS if self.process else AsyncCheckpointerType.THREAD
        self.stager: Any = None
        if self.process:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            self.stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=torch.cuda.is_available(),
                    use_shared_memory=True,
                    use_async_staging=False,
                    use_non_blocking_copy=torch.cuda.is_available(),
                )
            )

    def begin(self, state: dict[str, Any], i: int) -> Any:
        path = self.root / f"ckpt{i}"
        writer = self.dcp.FileSystemWriter(
            str(path),
            sync_files=True,
            cache_staged_state_dict=torch.cuda.is_available() and not self.process,
        )
        r = self.dcp.async_save(
            state,
            storage_writer=writer,
            async_checkpointer_type=self.kind,
            async_stager=self.stager,
        )
        return path, getattr(r, "upload_completion", r)

    def end(self, handle: Any) -> dict[str, Any]:
        path, fut = handle
        fut.result()
        fsync_path(path)  # DCP fsyncs its files, not their directory
        fsync_path(self.root)
        return {}


class DcpProcess(DcpAsync):
    name = "dcp-process"
    process = True


class TorchSaveThread(AsyncSystem):
    name = "torch.save"

    def setup(self, root: Path) -> None:
        super().setup(root)
        self.copy: Any = None

    def begin(self, state: dict[str, Any], i: int) -> Any:
        self.copy = _copy_into(state, self.copy)
        path = self.root / f"ckpt{i}.pt"
        fut: Future[None] = Future()

        def save(staged: Any = self.copy) -> None:
            try:
                with open(path, "wb") as f:
                    torch.save(staged, f)
                    f.flush()
                    fsync_path(path)
                fsync_path(self.root)
                fut.set_result(None)
            except BaseException as exc:  # noqa: BLE001 - surfaced by end()
                fut.set_exception(exc)

        threading.Thread(target=save, name="torch-save").start()
        return fut

    def end(self, handle: Any) -> dict[str, Any]:
        handle.result()
        return {}


def _copy_into(src: Any, dst: Any) -> Any:
    """``src`` copied into ``dst`` (same structure, from an earlier call), or into new memory."""
    if isinstance(src, torch.Tensor):
        if isinstance(dst, torch.Tensor) and dst.shape == src.shape and dst.dtype == src.dtype:
            return dst.copy_(src)
        pin = src.is_cuda  # a GPU's tensors are staged into pinned host memory
        return torch.empty(src.shape, dtype=src.dtype, pin_memory=pin).copy_(src)
    if isinstance(src, dict):
        old = dst if isinstance(dst, dict) else {}
        return {k: _copy_into(v, old.get(k)) for k, v in src.items()}
    if isinstance(src, (list, tuple)):
        old = dst if isinstance(dst, (list, tuple)) and len(dst) == len(src) else [None] * len(src)
        return type(src)(_copy_into(v, o) for v, o in zip(src, old))
    return src


ASYNC_SYSTEMS: dict[str, type[AsyncSystem]] = {
    c.name: c
    for c in (
        Plain,
        CkstoreAsync,
        CkstoreBuffered,
        CkstoreProcess,
        DcpAsync,
        DcpProcess,
        TorchSaveThread,
    )
}
