"""Hugging Face ``transformers``: every Trainer checkpoint becomes a snapshot; the folders stay.

::

    from ckstore.integrations.transformers import CkstoreCallback, checkout

    store = ckstore.open("./ckpts", create=True)
    trainer = Trainer(model, args, train_dataset=ds, callbacks=[CkstoreCallback(store, run="sft")])
    trainer.train()                                   # each save is a snapshot sft@<global_step>
    trainer.train(resume_from_checkpoint=True)        # the Trainer's own resume works as before
    trainer.train(resume_from_checkpoint=checkout(store, "sft@500", "./resume"))  # any ref

The Trainer keeps writing its checkpoint folder (``checkpoint-<step>``) in its own formats; at
each save :class:`CkstoreCallback` imports that folder as one snapshot of ``run`` at
``step = global_step`` (``store.import_checkpoint(folder, format="hf")``): the model weights
(app ``model``), ``optimizer.pt``, ``scheduler.pt``, ``rng_state.pth`` (and ``scaler.pt``) as
apps ``optimizer``, ``scheduler``, ``rng_state`` (loaded weights-only), and
``trainer_state.json``, ``config.json`` and the other files kept byte for byte;
``training_args.bin`` (a pickled TrainingArguments object, not state) is left out. Weights
dedup against every earlier checkpoint and every model imported before.

Then, by default, each of the folder's ``.pt``/``.pth`` files is replaced by a pointer file
(:mod:`ckstore.integrations.pointer`) that ``torch.load`` (the Trainer's resume) reads from the
store: optimizer, scheduler and RNG states are on disk once, in the store. The weights
(``model.safetensors``) and the small files stay as the Trainer wrote them, because
safetensors' own reader and every Hugging Face tool open them by name. So
``resume_from_checkpoint=True``, ``get_last_checkpoint``, ``load_best_model_at_end`` and
``from_pretrained(folder)`` work unchanged. ``keep_local=True`` leaves the folders whole;
``keep_local=False`` deletes each folder after importing it (only the store holds the
checkpoints; resume with :func:`checkout`).

The Trainer's retention is the store's: a folder the Trainer deletes (``save_total_limit``,
``save_strategy="best"``) whose snapshot the callback imported from that very path (saved
during this training, or present when it began) is deleted from the store, and its bytes are
reclaimed as soon as nothing else writes to the store; the best checkpoint
(``state.best_model_checkpoint``) is tagged ``<run>/best``. Each imported folder is tagged
``<run>/<folder digest>/checkpoint-<step>`` while it lives.

With ``interval=ckstore.TakeInterval(overhead=0.02)`` the callback also asks the Trainer to save
whenever the interval says a take is due, so saving costs at most 2% of the wall clock however
long steps and saves take.

:func:`checkout` writes a snapshot back as a checkpoint folder (``StoredSnapshot.export(dir,
"hf")``), which ``trainer.train(resume_from_checkpoint=...)`` resumes from exactly: weights,
optimizer, scheduler, RNG and trainer state.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

from transformers import TrainerCallback

from ..errors import ConflictError, NotFoundError, SnapshotNotFoundError
from ..interval import TakeInterval
from ..snapshot import StoredSnapshot
from ..store import Store
from ..store_ref import StoreRef
from ._paths import identity, path_tag
from ._retention import reclaim
from .pointer import Pointer, to_bytes

PREFIX = "checkpoint"
TORCH_FILES = (".pt", ".pth")


class CkstoreCallback(TrainerCallback):
    """A ``TrainerCallback`` that imports each checkpoint folder the Trainer saves into ``store``.

    Args:
        store: the store (``ckstore.open(...)``), or its URL.
        run: the run the snapshots go to (step = the Trainer's ``global_step``).
        keep_local: what stays in the Trainer's checkpoint folder. None (default): the
            folder, with its torch files as pointers into the store; True: the folder as the
            Trainer wrote it; False: nothing (the folder is deleted after the import).
        tags: tags to move to every new snapshot (e.g. ``["latest"]``).
        interval: a :class:`ckstore.TakeInterval`: the Trainer also saves whenever it says a
            take is due (its step and save costs measured as training runs), so saves cost
            at most its overhead of the wall clock. None (default): the Trainer's own
            ``save_steps`` alone decide.
        index, storage_options: for a store given by URL.

    ``snapshots`` lists the snapshots taken, oldest first. Only the main process imports.
    """

    def __init__(
        self,
        store: Store | str | os.PathLike[str],
        run: str = "hf",
        keep_local: bool | None = None,
        tags: tuple[str, ...] = (),
        interval: TakeInterval | None = None,
        *,
        index: str | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        self._ref = StoreRef(store, index, storage_options)
        self.run = run
        self.keep_local = keep_local
        self.tags = tuple(tags)
        self.interval = interval
        self.snapshots: list[StoredSnapshot] = []
        self._watched: dict[str, str] = {}  # folder identity -> snapshot id it was imported as
        self._deleted = False

    @property
    def store(self) -> Store:
        """The open store (reopened on first use after the callback was pickled)."""
        return self._ref.get()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Watch the checkpoint folders already in ``output_dir`` that this store imported."""
        if not state.is_world_process_zero or not os.path.isdir(args.output_dir):
            return
        for name in sorted(os.listdir(args.output_dir)):
            folder = os.path.join(args.output_dir, name)
            if name.startswith(f"{PREFIX}-") and os.path.isdir(folder):
                ident = identity(folder)
                sid = self._imported_at(ident)
                if sid is not None:
                    self._watched[ident] = sid

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """With an ``interval``: save at this step when it says a take is due (every process
        follows the main one's decision)."""
        if self.interval is not None and agreed(self.interval.due()):
            control.should_save = True

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Import the folder just saved; follow the Trainer's rotation and its best checkpoint."""
        if not state.is_world_process_zero:
            return
        self._follow_rotation()  # the Trainer rotates before it calls on_save
        self._reclaim(wait=False)  # the compaction after the last import had a save interval
        folder = os.path.join(args.output_dir, f"{PREFIX}-{state.global_step}")
        if os.path.isdir(folder):
            self._import(folder, state)
        self._tag_best(state)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Follow the last rotation and reclaim what the deleted snapshots used."""
        if not state.is_world_process_zero:
            return
        self._follow_rotation()
        self._tag_best(state)
        self._reclaim(wait=True)

    # --- helpers -------------------------------------------------------------------------------
    def _import(self, folder: str, state: Any) -> None:
        store = self.store
        ident = identity(folder)
        previous = self._imported_at(ident)
        local = {None: "pointers", True: "full", False: "none"}[self.keep_local]
        meta = {
            "hf": {
                "global_step": state.global_step,
                "epoch": state.epoch,
                "best_metric": state.best_metric,
                "folder": ident,
                "local": local,
            }
        }
        snap = store.import_checkpoint(
            folder,
            run=self.run,
            step=int(state.global_step),
            tags=(*self.tags, path_tag(self.run, ident)),
            metadata=meta,
            format="hf",
            move_tags=True,
        )
        self.snapshots.append(snap)
        if previous is not None and previous != snap.id:
            self._forget(previous, ident)  # the Trainer saved into the same folder again
        if self.keep_local is False:
            shutil.rmtree(folder, ignore_errors=True)
            return
        self._watched[ident] = snap.id
        if self.keep_local is None:
            _point(store, snap, folder, ident)

    def _imported_at(self, ident: str) -> str | None:
        """The snapshot this store imported from folder ``ident`` (its path tag, checked against
        the folder recorded in its metadata), or None."""
        sid = self.store.tags().get(path_tag(self.run, ident))
        if sid is None:
            return None
        try:
            meta = self.store.get(sid).metadata.get("hf")
        except SnapshotNotFoundError:
            return None
        return sid if isinstance(meta, dict) and meta.get("folder") == ident else None

    def _follow_rotation(self) -> None:
        """Delete the snapshots of watched folders the Trainer removed."""
        for ident, sid in list(self._watched.items()):
            if not os.path.isdir(ident):
                del self._watched[ident]
                self._forget(sid, ident)

    def _forget(self, sid: str, ident: str) -> None:
        """Delete snapshot ``sid`` imported from ``ident``: the callback's tags of it go first; a
        tag of anyone else's keeps it."""
        store = self.store
        mine = {path_tag(self.run, ident), f"{self.run}/best"}
        for name, target in store.tags().items():
            if target == sid and name in mine:
                try:
                    store.untag(name)
                except NotFoundError:
                    pass
        try:
            store.delete(sid)
            self._deleted = True
        except (SnapshotNotFoundError, ConflictError):
            pass  # deleted meanwhile, or another tag keeps it

    def _tag_best(self, state: Any) -> None:
        best = getattr(state, "best_model_checkpoint", None)
        if not best:
            return
        sid = self._watched.get(identity(best)) or self._imported_at(identity(best))
        name = f"{self.run}/best"
        if sid is not None and self.store.tags().get(name) != sid:
            self.store.tag(sid, name, force=True)

    def _reclaim(self, wait: bool) -> None:
        """What deleted snapshots used, given back (``_retention.reclaim``)."""
        if self._deleted and reclaim(self.store, wait):
            self._deleted = False


def _point(store: Store, snap: StoredSnapshot, folder: str, ident: str) -> None:
    """Replace each top-level torch file of ``folder`` imported as an app by a pointer to it."""
    apps = set(snap.manifest.apps)
    for name in sorted(os.listdir(folder)):
        app, dot, suffix = name.rpartition(".")
        path = os.path.join(folder, name)
        if not dot or f".{suffix}" not in TORCH_FILES or app not in apps:
            continue
        if not os.path.isfile(path) or os.path.islink(path):
            continue
        pointer = Pointer.to(store, snap.id, os.path.join(ident, name), app=app)
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=folder)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(to_bytes(pointer))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise


def agreed(decision: bool) -> bool:
    """The main process's ``decision`` on every process of a distributed job (each measures
    its own steps, and a save must happen on all of them or none); ``decision`` itself
    otherwise."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return decision
    box = [decision]
    dist.broadcast_object_list(box, src=0)
    return bool(box[0])


def checkout(store: Store, ref: str, path: str | os.PathLike[str], *, force: bool = False) -> str:
    """Write snapshot ``ref`` as a Trainer checkpoint folder at ``path`` and return the path.

    Pass the result to ``trainer.train(resume_from_checkpoint=...)``. ``path`` must be missing
    or empty unless ``force``.
    """
    store.get(ref).export(path, "hf", force=force)
    return os.fspath(path)
