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
checkpoints; resume with :func:`checkout`). ``keep_local=False`` with
``load_best_model_at_end=True`` is refused at ``on_train_begin`` (``InvalidInputError``): the
Trainer would find no best folder to load at the end, warn, and keep the last weights.

``keep_local="pointers"``: the checkpoint's bytes are on disk once, in the store. The weights
become a pointer too: ``model.safetensors`` (or ``model.safetensors.index.json`` and its
shards) gives way to one ``pytorch_model.bin``, a pointer to the snapshot's app ``model``
(:mod:`ckstore.integrations._hf_pointers`; written atomically, only after the import
committed, and before the real files are deleted, so a crash leaves weights that load). That
is the file the Trainer's ``_load_from_checkpoint`` and ``_load_best_model`` fall back to, with
``torch.load(weights_only=True)``, and ``from_pretrained(folder)`` loads it when there is no
safetensors file: in a process that imported ckstore (which allowlists the pointer's one
function), resume, ``get_last_checkpoint``, ``load_best_model_at_end``, ``save_total_limit``
and ``from_pretrained`` work as by default. What does not: anything that opens
``model.safetensors`` by name (``safetensors.safe_open``, the upstream Trainer tests' check that
every checkpoint folder holds it), and a process that never imported ckstore (a serving engine
such as vLLM), where ``torch.load`` refuses the file with ``Unsupported global: GLOBAL
ckstore.integrations.pointer.load_pointer`` (``import ckstore.integrations.pointer`` first, or
``checkout`` the snapshot as a real folder). The whole state dict is read at once (no shard by
shard loading). Hence not the default.

The Trainer's retention is the store's: a folder the Trainer deletes (``save_total_limit``,
``save_strategy="best"``) whose snapshot the callback imported from that very path (saved
during this training, or present when it began) is deleted from the store, and its bytes are
given back behind the save (``Store.reclaim_behind``: a gc on the store's background thread, at
once when nothing else writes to the store) and before ``train`` returns; the best checkpoint
(``state.best_model_checkpoint``) is tagged ``<run>/best``. Each imported folder is tagged
``<run>/<folder digest>/checkpoint-<step>`` while it lives. With ``keep_local=False`` the
Trainer never sees a folder to rotate, so the callback applies the Trainer's rule itself to
the snapshots it imported from this ``output_dir`` with ``keep_local=False``, found in the
store by those tags and their ``hf`` metadata (so a relaunch continues the rotation): the
oldest go first until ``save_total_limit`` remain, the newest and the best always among them
(so the best and the newest with ``save_total_limit=1``, and the best alone at the end of
training). Another run's, another ``output_dir``'s and another mode's snapshots are never
counted; a tag of anyone else's keeps its snapshot.

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
from typing import Any, Literal

from transformers import TrainerCallback

from ..errors import ConflictError, InvalidInputError, NotFoundError, SnapshotNotFoundError
from ..interval import TakeInterval
from ..snapshot import StoredSnapshot
from ..store import Store
from ..store_ref import StoreRef
from ._hf_pointers import point_torch_files, point_weights
from ._hf_rotation import DELETED_FOLDERS, imported_from, rotated_out
from ._paths import identity, path_tag
from ._retention import reclaim

PREFIX = "checkpoint"
POINTERS = "pointers"
"""``keep_local=POINTERS``: the folder keeps pointers for every checkpoint file, weights
included, and its small files."""
KeepLocal = bool | Literal["pointers"] | None
_RECORDED = {None: "pointers", True: "full", False: DELETED_FOLDERS, POINTERS: "all-pointers"}
"""``keep_local`` -> the mode recorded in the snapshot's ``hf.local`` metadata (the default's
"pointers" predates the ``POINTERS`` mode)."""


class CkstoreCallback(TrainerCallback):
    """A ``TrainerCallback`` that imports each checkpoint folder the Trainer saves into ``store``.

    Args:
        store: the store (``ckstore.open(...)``), or its URL.
        run: the run the snapshots go to (step = the Trainer's ``global_step``).
        keep_local: what stays in the Trainer's checkpoint folder. None (default): the
            folder, with its torch files as pointers into the store; ``"pointers"``: the
            folder, with its torch files and its weights (one ``pytorch_model.bin``) as
            pointers; True: the folder as the Trainer wrote it; False: nothing (the folder is
            deleted after the import).
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
        keep_local: KeepLocal = None,
        tags: tuple[str, ...] = (),
        interval: TakeInterval | None = None,
        *,
        index: str | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        self._ref = StoreRef(store, index, storage_options)
        self.run = run
        if not (keep_local is None or isinstance(keep_local, bool) or keep_local == POINTERS):
            raise InvalidInputError(
                f"CkstoreCallback(keep_local={keep_local!r}): use None (the default), True, "
                f"False or {POINTERS!r}"
            )
        self.keep_local = keep_local
        self.tags = tuple(tags)
        self.interval = interval
        self.snapshots: list[StoredSnapshot] = []
        self._watched: dict[str, str] = {}  # folder identity -> snapshot id it was imported as
        self._deleted = False  # a snapshot deleted since the last gc asked for
        self._deleted_in_training = False

    @property
    def store(self) -> Store:
        """The open store (reopened on first use after the callback was pickled)."""
        return self._ref.get()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Watch the checkpoint folders already in ``output_dir`` that this store imported.

        Raises:
            InvalidInputError: ``keep_local=False`` with ``load_best_model_at_end=True`` (the
                best checkpoint's folder is gone when the Trainer loads it), on every process.
        """
        if self.keep_local is False and getattr(args, "load_best_model_at_end", False):
            raise InvalidInputError(
                f"CkstoreCallback(run={self.run!r}, keep_local=False) deletes each checkpoint "
                "folder once imported, so load_best_model_at_end=True would find no best model "
                "to load at the end of training (the Trainer only warns and keeps the last "
                f"weights): use keep_local={POINTERS!r} (the checkpoint's bytes on disk once, "
                "the best model loaded from the store) or the default, or load_best_model_at_end"
                f"=False and checkout(store, '{self.run}/best', folder) after training"
            )
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
        """Import the folder just saved; follow the Trainer's rotation and its best checkpoint;
        give back behind the save what the deleted snapshots used."""
        if not state.is_world_process_zero:
            return
        folder = os.path.join(args.output_dir, f"{PREFIX}-{state.global_step}")
        if os.path.isdir(folder):
            self._import(folder, state)
        self._follow_rotation()  # the Trainer rotated its folders before it called on_save
        self._rotate_store(args, state, at_end=False)
        self._tag_best(state)
        self._reclaim(wait=False)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Follow the last rotation and reclaim what the deleted snapshots used."""
        if not state.is_world_process_zero:
            return
        self._follow_rotation()
        self._rotate_store(args, state, at_end=True)
        self._tag_best(state)
        self._reclaim(wait=True)

    # --- helpers -------------------------------------------------------------------------------
    def _import(self, folder: str, state: Any) -> None:
        store = self.store
        ident = identity(folder)
        previous = self._imported_at(ident)
        local = _RECORDED[self.keep_local]
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
        if self.keep_local is None or self.keep_local == POINTERS:
            point_torch_files(store, snap, folder, ident)
        if self.keep_local == POINTERS:
            point_weights(store, snap, folder, ident)

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

    def _rotate_store(self, args: Any, state: Any, at_end: bool) -> None:
        """``keep_local=False``: the Trainer's rotation, which never sees the deleted folders,
        applied to the snapshots imported from them (:mod:`._hf_rotation`)."""
        if self.keep_local is not False:
            return
        here = imported_from(self.store, self.run, args.output_dir)
        best = _best_folder(args, state)
        for gone in rotated_out(here, args.save_total_limit, best, at_end):
            self._forget(gone.id, gone.folder)

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
            self._deleted = self._deleted_in_training = True
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
        """What deleted snapshots used, given back: behind the save, on the store's background
        thread after the compaction due (``Store.reclaim_behind``), so a save never waits for
        the gc; with ``wait`` (the end of training), at once and before returning, if anything
        was deleted during the training (``_retention.reclaim``)."""
        if wait and self._deleted_in_training:
            reclaim(self.store, wait=True)
            self._deleted = self._deleted_in_training = False
        elif self._deleted and not wait:
            self.store.reclaim_behind()
            self._deleted = False


def _best_folder(args: Any, state: Any) -> str | None:
    """The folder identity of the Trainer's best checkpoint: ``state.best_model_checkpoint``,
    else (a relaunch, where the Trainer forgets a best folder that is gone) the folder of
    ``state.best_global_step`` in ``output_dir``; None when there is no best."""
    best = getattr(state, "best_model_checkpoint", None)
    if best:
        return identity(best)
    step = getattr(state, "best_global_step", None)
    return identity(os.path.join(args.output_dir, f"{PREFIX}-{step}")) if step else None


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
