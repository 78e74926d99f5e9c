"""PyTorch Lightning: checkpoints go into a ckstore store instead of ``.ckpt`` files.

::

    from ckstore.integrations.lightning import CkstoreCheckpointIO

    io = CkstoreCheckpointIO(ckstore.open("./ckpts", create=True), run="lit")
    trainer = Trainer(plugins=[io], callbacks=[ModelCheckpoint(save_top_k=2, monitor="val_loss")])
    trainer.fit(model)                                   # every checkpoint is a snapshot
    trainer.fit(model, ckpt_path=io.ref(path) or "lit@200")  # resume from a path or any ref

Each ``save_checkpoint(checkpoint, path)`` takes Lightning's checkpoint dict as one snapshot of
``run`` at ``step = global_step``: every top-level key (``state_dict``, ``optimizer_states``,
``loops``, ``callbacks``, ``epoch``...) is an app, so the weights and optimizer state dedup
against every earlier checkpoint. The path is recorded as a tag (``<run>/<file name>``, see
:meth:`CkstoreCheckpointIO.tag_of`); saving to the same path again moves the tag and deletes the
snapshot it left, as overwriting the file would. ``remove_checkpoint(path)`` (what
``ModelCheckpoint`` calls to drop a checkpoint that left the top k) removes the path's tag and
deletes the snapshot, unless a tag of yours still points at it (tags mark what to keep), and
``gc`` reclaims its bytes. ``load_checkpoint(path)`` accepts a path saved through the plugin or
any ref (``run@step``, a tag, an id prefix).

Lightning calls ``save_checkpoint`` and ``remove_checkpoint`` on global rank 0 only; the plugin
takes in that process alone (no collectives). ``load_checkpoint`` runs on every rank and only
reads. :class:`CkstoreInterval` (a callback) saves whenever a :class:`ckstore.TakeInterval` says a
take is due, so checkpoints cost at most its overhead of the wall clock. The plugin derives from ``lightning_fabric``'s ``CheckpointIO`` (what
``pytorch_lightning`` uses), or from ``lightning.fabric``'s when only the unified ``lightning``
package is installed.
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import Any

from ..errors import ConflictError, NotFoundError, SnapshotNotFoundError
from ..interop import SOURCE_APP, app_state_of
from ..interval import TakeInterval
from ..store import Store

try:
    from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO
except ImportError:  # pragma: no cover - the unified `lightning` package only
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO  # type: ignore[no-redef]
try:
    from pytorch_lightning import Callback
except ImportError:  # pragma: no cover - the unified `lightning` package only
    from lightning.pytorch import Callback  # type: ignore[no-redef]

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_MAX_TAG = 128


class CkstoreCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` that saves to, loads from and deletes in a ckstore store.

    Args:
        store: the store (``ckstore.open(...)``).
        run: the run every checkpoint is taken into.
        metadata: extra snapshot metadata for every save (JSON-able).
    """

    def __init__(
        self, store: Store, run: str = "lightning", metadata: dict[str, Any] | None = None
    ) -> None:
        super().__init__()
        self.store = store
        self.run = run
        self.metadata = dict(metadata or {})

    def tag_of(self, path: Any) -> str:
        """The tag a checkpoint path is recorded as: ``<run>/<file name>`` in tag-safe characters."""
        base = _UNSAFE.sub("_", os.path.basename(os.fspath(path))).strip("._-") or "checkpoint"
        tag = f"{self.run}/{base}"
        if len(tag) > _MAX_TAG:
            digest = hashlib.sha256(os.fspath(path).encode()).hexdigest()[:12]
            tag = f"{tag[: _MAX_TAG - 13]}-{digest}"
        return tag

    def ref(self, path: Any) -> str:
        """The ref of the snapshot saved at ``path`` (its tag)."""
        return self.tag_of(path)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Take ``checkpoint`` as one snapshot tagged with ``path``'s tag (moving it if it exists)."""
        tag = self.tag_of(path)
        previous = self.store.tags().get(tag)
        step = checkpoint.get("global_step")
        meta = {
            **self.metadata,
            "lightning": {"path": os.fspath(path), "epoch": checkpoint.get("epoch")},
        }
        apps = app_state_of(checkpoint, f"Lightning checkpoint {os.fspath(path)!r}")
        self.store.take(
            apps,
            run=self.run,
            step=step if isinstance(step, int) else None,
            tags=(tag,),
            metadata=meta,
            no_dist=True,
            move_tags=True,
        )
        if previous is not None and previous not in self.store.tags().values():
            self._delete(previous)

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The checkpoint dict saved at ``path`` (or of any ref), read and verified from the store."""
        snap = self._resolve(path)
        apps = [a for a in snap.manifest.apps if a != SOURCE_APP]
        return {app: snap.read_object(app) for app in apps}

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the snapshot saved at ``path``; ``store.gc()`` reclaims what only it used.

        The path's tag goes first; a snapshot that another tag still points at (one you set,
        e.g. ``best``) is kept.
        """
        tag = self.tag_of(path)
        sid = self.store.tags().get(tag)
        if sid is None:
            return
        try:
            self.store.untag(tag)
        except NotFoundError:
            pass  # removed meanwhile
        try:
            self._delete(sid)
        except ConflictError:
            pass  # another tag keeps it

    def _resolve(self, path: Any) -> Any:
        tag = self.tag_of(path)
        if tag in self.store.tags():
            return self.store.get(tag)
        try:
            return self.store.get(os.fspath(path))
        except (SnapshotNotFoundError, NotFoundError):
            raise SnapshotNotFoundError(
                f"no checkpoint {os.fspath(path)!r} in store {self.store.url}: neither a path saved "
                f"through this plugin (tag {tag!r}) nor a ref; see `ckstore log --run {self.run}`"
            ) from None

    def _delete(self, sid: str) -> None:
        try:
            self.store.delete(sid)
        except SnapshotNotFoundError:
            pass  # deleted meanwhile

    def teardown(self) -> None:
        """Nothing to release: the store stays open (close it yourself)."""


class CkstoreInterval(Callback):
    """A Lightning callback that saves a checkpoint whenever a :class:`ckstore.TakeInterval`
    says a take is due, so checkpointing costs at most its overhead of the wall clock.

    ::

        io = CkstoreCheckpointIO(store, run="lit")
        every = CkstoreInterval(ckstore.TakeInterval(overhead=0.02), dirpath="ckpts")
        trainer = Trainer(plugins=[io], callbacks=[every])

    After each training batch every process asks; the global rank 0's answer is broadcast, so
    all save together (``trainer.save_checkpoint`` is collective). The path is ``dirpath`` /
    ``filename`` formatted with ``step`` (the global step): with
    :class:`CkstoreCheckpointIO` each save is a snapshot tagged with it.

    Args:
        interval: decides when (its step and save costs measured as training runs).
        dirpath: the folder the checkpoint paths are in.
        filename: the file name, ``{step}`` replaced by the global step.
    """

    def __init__(
        self, interval: TakeInterval, dirpath: Any = ".", filename: str = "interval-{step}.ckpt"
    ) -> None:
        super().__init__()
        self.interval = interval
        self.dirpath = os.fspath(dirpath)
        self.filename = filename

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Save now when the interval (rank 0's) says a take is due."""
        due = self.interval.due()
        if trainer.world_size > 1:
            due = bool(trainer.strategy.broadcast(due, src=0))
        if due:
            name = self.filename.format(step=trainer.global_step)
            trainer.save_checkpoint(os.path.join(self.dirpath, name))
