"""PyTorch Lightning: checkpoints go into a ckstore store; the paths keep pointer files.

::

    from ckstore.integrations.lightning import CkstoreCheckpointIO

    io = CkstoreCheckpointIO(ckstore.open("./ckpts", create=True), run="lit")
    trainer = Trainer(plugins=[io], callbacks=[ModelCheckpoint(save_top_k=2, monitor="val_loss")])
    trainer.fit(model)                                   # every checkpoint is a snapshot
    trainer.fit(model, ckpt_path="last")                 # or a path, or any ref ("lit@200")
    Model.load_from_checkpoint(trainer.checkpoint_callback.best_model_path)

Each ``save_checkpoint(checkpoint, path)`` takes Lightning's checkpoint dict as one snapshot of
``run`` at ``step = global_step``: every top-level key (``state_dict``, ``optimizer_states``,
``loops``, ``callbacks``, ``epoch``...) is an app, so the weights and optimizer state dedup
against every earlier checkpoint. At ``path`` it writes a pointer file of a few hundred bytes
(:mod:`ckstore.integrations.pointer`): whatever Lightning and its users do with files (the
version counter's ``exists``, ``ckpt_path="last"``, SLURM's ``hpc_ckpt_N``,
``save_last="link"``, ``torch.load(path)``, ``load_from_checkpoint(path)``) finds the
checkpoint there, read from the store; the checkpoint's bytes are on disk once, in the store.

A checkpoint's identity is its full, normalised path: ``exp_a/last.ckpt`` and
``exp_b/last.ckpt`` are two checkpoints. Each live one is tagged
``<run>/<folder digest>/<file name>`` (so retention such as ``gc(keep_last=...)`` keeps it).
Saving to a path again replaces its checkpoint, as overwriting the file would: the snapshot the
path's pointer named is deleted, if this plugin wrote it there into this store.
``remove_checkpoint(path)`` (what ``ModelCheckpoint`` calls to drop a checkpoint that left the
top k) removes the file and deletes the snapshot it points to on the same condition, unless a
tag of yours still points at it; a symlink, a copied pointer or a file it did not write is only
removed. ``gc`` reclaims the bytes (at once for what this handle deleted when nothing else
writes the store: see ``Store.gc``). Each ``ModelCheckpoint`` with a ``monitor`` has its best
checkpoint tagged ``<run>/best`` (``<run>/best-<monitor>`` when there are several).

``load_checkpoint(path)`` reads a pointer file from its store, loads any other ``.ckpt`` file
as Lightning does (checkpoints written before the switch resume unchanged), accepts any ref of
the store (``run@step``, a tag, an id prefix) and raises ``CheckpointNotFoundError``, a
``FileNotFoundError``, when there is neither. Hyper-parameters that are not plain data
(OmegaConf containers, paths, namespaces, enum members) are stored as marked plain data and
come back as what they were (:mod:`ckstore.integrations._values`).

Lightning calls ``save_checkpoint`` and ``remove_checkpoint`` on global rank 0 only; the plugin
takes in that process alone (no collectives). ``load_checkpoint`` runs on every rank and only
reads. The plugin pickles and deep-copies (``strategy="ddp_spawn"``, ``deepcopy(trainer...)``):
it carries the store's URL and reopens it where it is used. ``teardown`` (the end of each
``fit``/``validate``/``test``) ends the store's background compaction thread and closes a store
the plugin opened itself. It is a ``TorchCheckpointIO`` of the unified ``lightning`` package
and of ``pytorch_lightning``'s ``lightning_fabric`` alike, whichever are installed.
:class:`CkstoreInterval` (a callback) saves whenever a :class:`ckstore.TakeInterval` says a take is
due, so checkpoints cost at most its overhead of the wall clock.
"""

from __future__ import annotations

import os
import re
from typing import Any

from ..errors import (
    CheckpointNotFoundError,
    CkstoreError,
    ConflictError,
    CorruptionError,
    NotFoundError,
    SnapshotNotFoundError,
)
from ..interop import SOURCE_APP, app_state_of
from ..interval import TakeInterval
from ..store import Store
from ..store_ref import StoreRef
from ._lightning_base import Callback, TorchCheckpointIO, register_everywhere
from ._paths import identity, is_url, path_tag
from ._retention import reclaim
from ._values import from_plain, to_plain
from .pointer import Pointer, read_file, resolve, saveable

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


class CkstoreCheckpointIO(TorchCheckpointIO):
    """Lightning ``CheckpointIO`` that saves to, loads from and deletes in a ckstore store.

    Args:
        store: the store (``ckstore.open(...)``), or its URL (opened on first use; not created).
        run: the run every checkpoint is taken into.
        metadata: extra snapshot metadata for every save (JSON-able).
        index, storage_options: for a store given by URL.
    """

    def __init__(
        self,
        store: Store | str | os.PathLike[str],
        run: str = "lightning",
        metadata: dict[str, Any] | None = None,
        *,
        index: str | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self._ref = StoreRef(store, index, storage_options)
        self.run = run
        self.metadata = dict(metadata or {})
        self._deleted = False  # snapshots deleted since the last gc
        self._resumed: str | None = None  # the snapshot loaded by a ref (Lightning keeps it)

    @property
    def store(self) -> Store:
        """The open store (reopened on first use after the plugin was pickled)."""
        return self._ref.get()

    def tag_of(self, path: Any) -> str:
        """The tag of the checkpoint saved at ``path``: ``<run>/<folder digest>/<file name>``."""
        return path_tag(self.run, identity(path))

    def ref(self, path: Any) -> str:
        """A ref of the snapshot saved at ``path`` (its tag), for ``ckpt_path=`` or the CLI."""
        return self.tag_of(path)

    # --- CheckpointIO --------------------------------------------------------------------------
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Take ``checkpoint`` as one snapshot and write its pointer file at ``path``.

        The snapshot the file at ``path`` pointed to before (if this plugin wrote it there) is
        deleted once the new pointer is in place. ``storage_options`` go to Lightning's file
        writer, which refuses them, as ``TorchCheckpointIO`` does.
        """
        self._reclaim(wait=False)  # what the last removals freed, if compaction is idle
        ident = identity(path)
        store = self.store
        previous = self._written_here(path, ident)
        tag = path_tag(self.run, ident)
        step = checkpoint.get("global_step")
        meta = {
            **self.metadata,
            "lightning": {
                "path": ident,
                "epoch": checkpoint.get("epoch"),
                "best_tags": sorted(name for name, _ in self._best(checkpoint)),
            },
        }
        apps = app_state_of(to_plain(checkpoint), f"Lightning checkpoint {ident!r}")
        snap = store.take(
            apps,
            run=self.run,
            step=step if isinstance(step, int) else None,
            tags=(tag,),
            metadata=meta,
            no_dist=True,
            move_tags=True,
        )
        pointer = Pointer.to(store, snap.id, ident, values="lightning")
        try:
            super().save_checkpoint(saveable(pointer), path, storage_options=storage_options)
        except BaseException:
            self._undo(snap.id, tag, previous)
            raise
        if previous is not None and previous != snap.id:
            self._forget(previous, ident)
        self._tag_best(checkpoint, ident, snap.id)

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The checkpoint at ``path``: a pointer's snapshot, a plain ``.ckpt`` file loaded as
        Lightning loads it, or the snapshot of a ref.

        Raises:
            CheckpointNotFoundError: no file at ``path`` and no snapshot by that ref.
        """
        text = os.fspath(path)
        pointer = read_file(text)
        if pointer is not None:
            store = self.store
            return dict(resolve(pointer, store if pointer.store == store.url else None))
        if _exists(text):
            kw: dict[str, Any] = {} if map_location is None else {"map_location": map_location}
            return dict(super().load_checkpoint(path, weights_only=weights_only, **kw))
        try:
            snap = self.store.get(text)
        except CorruptionError:
            raise
        except CkstoreError:
            raise CheckpointNotFoundError(
                f"Checkpoint file not found: {text} (no file there, and no snapshot of store "
                f"{self.store.url} by that ref; see `ckstore log --run {self.run}`)"
            ) from None
        # Lightning never removes the checkpoint a fit resumed from; given a ref, it cannot tell
        # which file that is, so remove_checkpoint keeps any file that points at it
        self._resumed = snap.id
        apps = [a for a in snap.manifest.apps if a != SOURCE_APP]
        return {app: from_plain(snap.read_object(app)) for app in apps}

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the file at ``path``; delete its snapshot if this plugin wrote it there.

        A snapshot another tag still points at (one you set) is kept; so is every snapshot a
        link, a copied pointer or another store's pointer names. The checkpoint the fit resumed
        from by a ref (``ckpt_path="lit@2000"``) is kept, file and snapshot, as Lightning keeps
        the file it resumed from by its path.
        """
        ident = identity(path)
        sid = self._written_here(path, ident)
        if sid is not None and sid == self._resumed:
            return  # the checkpoint this fit resumed from, by a ref: kept, file and snapshot
        super().remove_checkpoint(path)
        if sid is not None:
            self._forget(sid, ident)

    def teardown(self) -> None:
        """End the store's background compaction thread, reclaim what the removed checkpoints
        used, and close the store if the plugin opened it (a store handed in open stays open)."""
        if self._ref.is_open:
            self.store.quiesce()
            self._reclaim(wait=True)
        self._ref.close()

    # --- helpers -------------------------------------------------------------------------------
    def _written_here(self, path: Any, ident: str) -> str | None:
        """The snapshot the file at ``path`` points to, if this plugin wrote it there into this
        store (a pointer naming this store and this very identity), else None."""
        pointer = read_file(os.fspath(path))
        if pointer is None or pointer.path != ident or pointer.store != self.store.url:
            return None
        return pointer.snapshot

    def _forget(self, sid: str, ident: str) -> None:
        """Delete snapshot ``sid`` written at ``ident``: the plugin's own tags of it go first,
        a tag of anyone else's keeps it."""
        store = self.store
        mine = {path_tag(self.run, ident), *self._best_tags(sid)}
        for name, target in store.tags().items():
            if target == sid and name in mine:
                try:
                    store.untag(name)
                except NotFoundError:
                    pass  # removed meanwhile
        try:
            store.delete(sid)
            self._deleted = True
        except (SnapshotNotFoundError, ConflictError):
            pass  # deleted meanwhile, or another tag keeps it

    def _reclaim(self, wait: bool) -> None:
        """What deleted snapshots used, given back (``_retention.reclaim``)."""
        if self._deleted and reclaim(self.store, wait):
            self._deleted = False

    def _undo(self, sid: str, tag: str, previous: str | None) -> None:
        """A pointer could not be written: the path's tag goes back, the new snapshot goes."""
        store = self.store
        try:
            if previous is not None:
                store.tag(previous, tag, force=True)
            else:
                store.untag(tag)
            store.delete(sid)
        except (NotFoundError, ConflictError):
            pass

    def _best_tags(self, sid: str) -> set[str]:
        """The plugin's own best tags that may name ``sid``: those its save recorded
        (``best_tags``; ``<run>/best`` for a snapshot saved before they were); a tag of yours,
        whatever its name, is not one of them."""
        try:
            recorded = self.store.get(sid).metadata.get("lightning", {}).get("best_tags")
        except CkstoreError:
            recorded = None
        if not isinstance(recorded, list):  # saved before the names were recorded
            return {f"{self.run}/best"}
        return {n for n in recorded if isinstance(n, str)}

    def _best(self, checkpoint: dict[str, Any]) -> list[tuple[str, str]]:
        """(tag name, best model path) of each monitored ModelCheckpoint in ``checkpoint``:
        ``<run>/best``, or ``<run>/best-<monitor>`` with several."""
        states = checkpoint.get("callbacks")
        if not isinstance(states, dict):
            return []
        monitored = [
            s
            for s in states.values()
            if isinstance(s, dict)
            and "best_k_models" in s
            and s.get("monitor")
            and s.get("best_model_path")
        ]
        found = []
        for state in monitored:
            name = f"{self.run}/best"
            if len(monitored) > 1:
                name += "-" + (_UNSAFE.sub("_", str(state["monitor"])).strip("._-") or "monitor")
            found.append((name, str(state["best_model_path"])))
        return found

    def _tag_best(self, checkpoint: dict[str, Any], ident: str, sid: str) -> None:
        """Tag each monitored ModelCheckpoint's best checkpoint (:meth:`_best`)."""
        best = self._best(checkpoint)
        if not best:
            return
        store = self.store
        tags = store.tags()
        for name, path in best:
            at = identity(path)
            target = sid if at == ident else self._written_here(path, at)
            if target is not None and tags.get(name) != target:
                store.tag(target, name, force=True)


def _exists(path: str) -> bool:
    if not is_url(path):
        return os.path.exists(path)
    import fsspec

    fs, inner = fsspec.core.url_to_fs(path)
    return bool(fs.exists(inner))


register_everywhere(CkstoreCheckpointIO)


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
    :class:`CkstoreCheckpointIO` each save is a snapshot, its pointer file at that path.

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
