"""``FolderWriter``: a ``dcp.save`` into a marked folder, as a snapshot plus a step pointer.

The save itself is :class:`~ckstore.dcp.StorageWriter`'s (one snapshot, every rank's lease
handed over to the coordinator). After the snapshot commits, the coordinator writes the step
folder's ``.metadata`` pointer (:mod:`ckstore.dcp.folder`), then learns which step folders the
trainer removed since and deletes their snapshots (:mod:`ckstore.dcp.forget`).

Order, and what a crash at each point leaves:

1. the snapshot commits (docs/RELIABILITY.md I1): before, nothing is visible anywhere;
2. ``step-N/.metadata`` is written atomically: before this, the store holds a snapshot the
   trainer does not list (its folder holds no pointer, so a resume takes the step before).
   From before the commit until then, ``step-N/.ckstore-saving.json`` names a write session
   held for it: a save beside this one (another thread, an async save, another job) that
   deletes removed steps leaves the step alone while that session lives. After a crash the
   session runs out and the next save into the folder deletes the snapshot, as a removed
   step;
3. removed steps are deleted: a crash leaves them for the next save (or ``ckstore
   sync-folder``);
4. their space is given back behind the save (``Store.reclaim_behind``: a gc on the store's
   background thread, after the compaction due, at the lowest CPU priority), so a synchronous
   ``dcp.save`` does not wait for it (a gc waits for the compaction, then may rewrite sparse
   packs: 0.3-1.6 s per purge at 64 MiB here); a crash leaves it to the next gc.

A failure in step 3 or 4 does not fail the save (it committed and is listed): it is reported as
a warning that says how to finish it.
"""

from __future__ import annotations

import os
import time
import warnings
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.storage import WriteResult

from ..errors import CkstoreError, InvalidInputError
from .folder import (
    METADATA_KEY,
    POINTER_NAME,
    MarkedStep,
    StepPointer,
    clear_saving,
    locate,
    read_pointer,
    write_pointer,
    write_saving,
)
from .forget import ForgetReport, forget_removed
from .writer import StorageWriter


class FolderWriter(StorageWriter):
    """Writes a ``dcp.save`` of ``<marked folder>/<name>`` (see :mod:`ckstore.dcp.folder`).

    Args:
        at: the marked step (:func:`ckstore.dcp.folder.locate` of the checkpoint id).
        forget: after the pointer is written, delete the snapshots of step folders the trainer
            removed, and give their space back behind the save (default True).
        **options: as for :class:`~ckstore.dcp.StorageWriter` (``run``, ``step``, ``metadata``
            and ``index`` come from the marker and the step folder).

    After a save, :attr:`forgotten` (coordinator) reports what step 3 deleted.
    """

    def __init__(self, at: MarkedStep, *, forget: bool = True, **options: Any) -> None:
        super().__init__(
            at.marker.store,
            run=at.marker.run,
            step=at.step,
            metadata=_metadata(at),
            index=at.marker.index,
            **options,
        )
        self.at = at
        self.forget = forget
        self.forgotten: ForgetReport | None = None
        self.started = time.time()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return locate(checkpoint_id) is not None

    def reset(self, checkpoint_id: Any = None) -> None:
        at = locate(checkpoint_id) if checkpoint_id else None
        if at is None:
            super().reset(checkpoint_id)
            return
        if at.marker.store != self.at.marker.store or at.marker.index != self.at.marker.index:
            raise _refuse_other_store(at, self.at)
        super().reset(None)
        self.at = at
        self.spec = self.spec.evolve(run=at.marker.run, step=at.step, metadata=_metadata(at))

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.started = time.time()
        self.forgotten = None
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        store = self.store
        index = self.at.marker.index
        # the step's place held from before the commit until the pointer names it (1-2 below)
        with store.holding() as session:
            write_saving(self.at, session)
            try:
                super().finish(metadata, results)
                write_pointer(
                    self.at,
                    StepPointer(
                        store.url, self.snapshot.id, self.at.marker.id, self.at.name, index
                    ),
                )
                self._still_held(session)
            finally:
                clear_saving(self.at)
        if self.forget:
            try:
                self.forgotten = forget_removed(
                    self.at.folder, store, before=self.started, reclaim=False
                )
                if self.forgotten.deleted:
                    store.reclaim_behind()
            except (CkstoreError, OSError) as exc:
                warnings.warn(
                    f"dcp.save into {self.at.path} committed, but deleting the snapshots of "
                    f"removed step folders failed ({type(exc).__name__}: {exc}); the next save "
                    f"tries again, or run `ckstore sync-folder {self.at.folder}`",
                    RuntimeWarning,
                    stacklevel=2,
                )

    def _still_held(self, session: str) -> None:
        """After the pointer is written: the save's session must still be active. A save
        beside this one expires a session whose lease ran out before it judges the step (this
        process stopped past its lease between its commit and its pointer): then the step may
        have been taken for a removed one and its snapshot deleted, so the pointer goes again
        and the save fails, instead of listing a step that does not load."""
        try:
            self.store.renew_session(session)
        except CkstoreError:  # expired, or the index out of reach for the lease's length
            self._unpoint()
            raise

    def _unpoint(self) -> None:
        pointer = read_pointer(self.at.path)
        if pointer is not None and pointer.snapshot == self.snapshot.id:
            os.unlink(os.path.join(self.at.path, POINTER_NAME))


def _metadata(at: MarkedStep) -> dict[str, Any]:
    return {METADATA_KEY: {"marker": at.marker.id, "name": at.name, "path": at.path}}


def _refuse_other_store(at: MarkedStep, was: MarkedStep) -> InvalidInputError:
    return InvalidInputError(
        f"dcp.save: {at.path} is in a folder marked for store {at.marker.store}, but the writer "
        f"was made for {was.marker.store}; pass no storage_writer and let the id choose"
    )
