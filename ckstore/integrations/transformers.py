"""Hugging Face ``transformers``: every Trainer checkpoint becomes a snapshot; resume from a ref.

::

    from ckstore.integrations.transformers import CkstoreCallback, checkout

    store = ckstore.open("./ckpts", create=True)
    trainer = Trainer(model, args, train_dataset=ds, callbacks=[CkstoreCallback(store, run="sft")])
    trainer.train()                                   # each save is a snapshot sft@<global_step>
    trainer.train(resume_from_checkpoint=checkout(store, "sft@500", "./resume"))

The Trainer keeps writing its checkpoint folder (``checkpoint-<step>``) in its own formats;
at each save :class:`CkstoreCallback` imports that folder as one snapshot of ``run`` at
``step = global_step`` (``store.import_checkpoint(folder, format="hf")``): the model weights
(app ``model``), ``optimizer.pt``, ``scheduler.pt``, ``rng_state.pth`` (and ``scaler.pt``)
as apps ``optimizer``, ``scheduler``, ``rng_state`` (loaded weights-only), and
``trainer_state.json``, ``config.json`` and the other files kept byte for byte;
``training_args.bin`` (a pickled TrainingArguments object, not state) is left out. Weights
dedup against every earlier checkpoint and every model imported before. The folder is then
deleted, unless ``keep_local`` (default: kept only when the Trainer will need it again,
i.e. ``load_best_model_at_end``). With ``interval=ckstore.TakeInterval(overhead=0.02)`` the
callback also asks the Trainer to save whenever the interval says a take is due, so saving
costs at most 2% of the wall clock however long steps and saves take.

:func:`checkout` writes a snapshot back as a checkpoint folder (``StoredSnapshot.export(dir,
"hf")``), which ``trainer.train(resume_from_checkpoint=...)`` resumes from exactly: weights,
optimizer, scheduler, RNG and trainer state.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

from transformers import TrainerCallback

from ..interval import TakeInterval
from ..snapshot import StoredSnapshot
from ..store import Store

PREFIX = "checkpoint"


class CkstoreCallback(TrainerCallback):
    """A ``TrainerCallback`` that imports each checkpoint folder the Trainer saves into ``store``.

    Args:
        store: the store (``ckstore.open(...)``).
        run: the run the snapshots go to (step = the Trainer's ``global_step``).
        keep_local: keep the Trainer's checkpoint folder after importing it. None (default):
            keep it only with ``load_best_model_at_end`` (the Trainer reloads from it).
        tags: tags to move to every new snapshot (e.g. ``["latest"]``).
        interval: a :class:`ckstore.TakeInterval`: the Trainer also saves whenever it says a
            take is due (its step and save costs measured as training runs), so saves cost
            at most its overhead of the wall clock. None (default): the Trainer's own
            ``save_steps`` alone decide.

    ``snapshots`` lists the snapshots taken, oldest first. Only the main process imports.
    """

    def __init__(
        self,
        store: Store,
        run: str = "hf",
        keep_local: bool | None = None,
        tags: tuple[str, ...] = (),
        interval: TakeInterval | None = None,
    ) -> None:
        self.store = store
        self.run = run
        self.keep_local = keep_local
        self.tags = tuple(tags)
        self.interval = interval
        self.snapshots: list[StoredSnapshot] = []

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """With an ``interval``: save at this step when it says a take is due (every process
        follows the main one's decision)."""
        if self.interval is not None and agreed(self.interval.due()):
            control.should_save = True

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        folder = os.path.join(args.output_dir, f"{PREFIX}-{state.global_step}")
        if not os.path.isdir(folder):
            return
        meta = {
            "hf": {
                "global_step": state.global_step,
                "epoch": state.epoch,
                "best_metric": state.best_metric,
            }
        }
        snap = self.store.import_checkpoint(
            folder,
            run=self.run,
            step=int(state.global_step),
            tags=self.tags,
            metadata=meta,
            format="hf",
            move_tags=True,
        )
        self.snapshots.append(snap)
        keep = (
            self.keep_local
            if self.keep_local is not None
            else bool(getattr(args, "load_best_model_at_end", False))
        )
        if not keep:
            shutil.rmtree(folder, ignore_errors=True)


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
