"""``StorageWriter``: a ``dcp.save`` as one ckstore snapshot, with the lease hand-over between ranks."""

from __future__ import annotations

import os
import re
import uuid
import weakref
from typing import TYPE_CHECKING, Any

from torch.distributed.checkpoint import StorageWriter as _DcpStorageWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ..distributed import is_distributed
from ..distributed.comm import Comm, phase
from ..engine.take.local import LocalTake
from ..engine.take.spec import TakeSpec
from ..errors import ConflictError, CorruptionError, DistributedError, InvalidInputError
from ..format.tree import join
from ..format.values import encode_value
from ..store_ref import StoreRef
from .meta import metadata_to_json
from .plan import APP, cut_items, fill_ids, id_sizes, manifest_entries, owners, the_coordinator
from .url import is_ckstore_id, parse

if TYPE_CHECKING:
    from ..store import Store

DCP_VERSION = "1.0.0"  # what torch's FileSystemWriter records for this layout of Metadata
_RUN_STEP = re.compile(r"^(?P<run>.+)@(?P<step>\d+)$")


class StorageWriter(_DcpStorageWriter):
    """Writes a ``dcp.save`` into ``store`` as one snapshot of ``run`` (at ``step``).

    Args:
        store: an open :class:`ckstore.Store` (each rank opens its own), or a store URL
            (opened on first use; create a new store once beforehand, not from every rank).
        run, step, tags, metadata, move_tags: as for ``store.take``.
        name: optional unique snapshot name.
        timeout: seconds ranks wait for each other in the hand-over (default
            ``CKSTORE_DIST_TIMEOUT`` or 600).
        overwrite: as in DCP's ``FileSystemWriter``. True (default): a save whose target
            exists adds a newer snapshot (``store.get("run@step")`` then finds the newest).
            False: refuse a save whose target exists: the snapshot called ``name`` if given,
            else ``run@step``, else (no step) any snapshot of ``run``. Checked when the save
            starts and again just before it commits. The writer raises ``ConflictError``;
            ``dcp.save`` wraps it, as every storage error, in DCP's ``CheckpointException``
            (a ``BaseException``), whose ``failures[rank][0]`` is the ``ConflictError``;
            nothing is committed.
        index, storage_options: for a store given by URL (an open store's are reused).
        on_nonfinite, on_stale, health, trainable: the take's guard, as for ``store.take``.
            A DCP save has no live modules: optimizer moments are recognised by their keys,
            parameters only by ``trainable`` globs (``"dcp/model.*"``).

    ``dcp.save(..., checkpoint_id="run" or "run@step")`` overrides run/step. With
    ``dcp.save(..., process_group=pg)`` only ``pg``'s ranks take part (the snapshot's ranks are
    theirs; other ranks may do anything meanwhile): DCP hands the storage layer only a rank
    within ``pg``, so each rank tags its local plan with its global rank and the coordinator
    sends every rank the list (``prepare_local_plan`` / ``prepare_global_plan``).
    After a save, :attr:`snapshot` (coordinator) is the committed :class:`ckstore.Snapshot`.
    The writer pickles (for ``dcp.async_save`` with the process executor): it carries the
    store URL, index URL and options and reopens the store in the other process; there
    :attr:`snapshot` is set, not in the process that called ``async_save``.
    """

    def __init__(
        self,
        store: Store | str | os.PathLike[str],
        run: str,
        step: int | None = None,
        tags: Any = (),
        metadata: dict[str, Any] | None = None,
        *,
        name: str | None = None,
        timeout: float | None = None,
        overwrite: bool = True,
        index: str | None = None,
        storage_options: dict[str, Any] | None = None,
        move_tags: bool = False,
        on_nonfinite: str = "warn",
        on_stale: str = "warn",
        health: bool = True,
        trainable: Any = (),
    ) -> None:
        super().__init__()
        self.spec = TakeSpec.of(
            run=run,
            step=step,
            tags=tags,
            metadata=metadata,
            name=name,
            dist_timeout=timeout,
            move_tags=move_tags,
            on_nonfinite=on_nonfinite,
            on_stale=on_stale,
            health=health,
            trainable=trainable,
        )
        self._ref = StoreRef(store, index, storage_options, create=True)
        self.overwrite = bool(overwrite)
        self.is_coordinator = True
        self.rank = 0
        self.snapshot: Any = None
        self.save_id = uuid.uuid4().hex
        self._comm: Comm | None = None
        self._figures: dict[str, int] = {}
        self._world = 1
        self._held: list[
            LocalTake
        ] = []  # the coordinator's session, kept from write_data to finish
        self._finalizer = weakref.finalize(self, _abort_all, self._held)

    @property
    def store(self) -> Store:
        """The open store (reopened on first use after the writer was pickled)."""
        return self._ref.get()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for transient in ("_comm", "_held", "_finalizer", "snapshot"):
            state.pop(transient, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._comm = None
        self.snapshot = None
        self._held = []
        self._finalizer = weakref.finalize(self, _abort_all, self._held)

    def _refuse_existing(self) -> None:
        """With ``overwrite=False``: ConflictError if the save's target snapshot exists."""
        if self.overwrite:
            return
        spec = self.spec
        found = [
            s
            for s in self.store.log(run=None if spec.name else spec.run)
            if (s.name == spec.name if spec.name else spec.step is None or s.step == spec.step)
        ]
        if found:
            target = spec.name or _checkpoint_id(spec.run, spec.step)
            raise ConflictError(
                f"Checkpoint already exists and overwrite=False (as DCP's FileSystemWriter "
                f"says): dcp.save into ckstore: {target!r} already exists in {self.store.url} "
                f"(snapshot {found[0].id[:12]}); pick another step or name, or pass "
                "overwrite=True to add a newer snapshot"
            )

    # DCP API ------------------------------------------------------------------------------
    def reset(self, checkpoint_id: Any = None) -> None:
        _abort_all(self._held)
        if checkpoint_id and is_ckstore_id(checkpoint_id):
            found = parse(checkpoint_id)
            if found.store != self._ref.url:
                self._ref = StoreRef(found.store, create=True)
            run, step = found.run_step
            self.spec = self.spec.evolve(run=run, step=step)
        elif checkpoint_id:
            run, step = _parse_checkpoint_id(checkpoint_id)
            self.spec = self.spec.evolve(run=run, step=step)
        self.save_id = uuid.uuid4().hex
        self.snapshot = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return is_ckstore_id(checkpoint_id)  # a bare run or ref needs a store: never picked

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(
            checkpoint_id=_checkpoint_id(self.spec.run, self.spec.step), save_id=self.save_id
        )

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        _abort_all(self._held)  # a previous save that never reached finish
        if not kwargs.get("use_collectives", True):
            raise InvalidInputError(
                "ckstore's DCP StorageWriter needs dcp.save(use_collectives=True)"
            )
        self.is_coordinator = bool(is_coordinator)
        self.rank = int(kwargs.get("rank") or 0)  # within dcp.save's process_group
        self._figures = {}
        self.snapshot = None
        self._comm = None
        self._world = 1
        self._refuse_existing()  # every rank sees the same index: all refuse, before any collective

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Tag the plan with this process's global rank: DCP hands the storage layer its rank
        within ``dcp.save``'s process group, never the group itself."""
        import dataclasses

        rank = _global_rank()
        return dataclasses.replace(plan, storage_data={_RANK: rank}) if rank is not None else plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """The coordinator learns the save's ranks from the plans and tells every rank."""
        import dataclasses

        ranks = [
            p.storage_data.get(_RANK) if isinstance(p.storage_data, dict) else None for p in plans
        ]
        if any(r is None for r in ranks):
            return plans  # not distributed (or plans cached by the planner: their tags stay)
        return [
            dataclasses.replace(p, storage_data={_MEMBERS: ranks}) if p.usable else p for p in plans
        ]

    def _open_comm(self, plan: SavePlan) -> Comm | None:
        """The save's ranks (from the plan) as a group of their own; None for one process."""
        members = plan.storage_data.get(_MEMBERS) if isinstance(plan.storage_data, dict) else None
        if not is_distributed() or members is None or len(members) <= 1:
            return None
        comm = Comm(
            None, self.spec.dist_timeout, purpose="dcp", members=members
        )  # a group of its own (async_save runs in a thread)
        if comm.rank != self.rank:
            raise InvalidInputError(
                f"dcp.save gave this rank the group rank {self.rank}, its plan says {comm.rank}"
            )
        return comm

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        comm = self._comm = self._open_comm(plan)
        self._world = comm.world if comm is not None else 1
        t = self.store.local_take(self.spec)
        keep = False
        try:
            # 1. cut on the global grid and hash (local); one writer per distinct chunk id
            with phase(comm, "hash", "dcp.save into ckstore (hash)") as ph:
                results, chunks = cut_items(plan.items, planner, t.opts)
                t.guard.watch(
                    {
                        r.index.fqn: r.storage_data["dtype"]
                        for r in results
                        if "dtype" in r.storage_data
                    },
                    lambda fqn: join(APP, fqn),
                )
                t.hash(chunks)
                fill_ids(results, chunks)
                ph.send(
                    {
                        "coordinator": self.is_coordinator,
                        "ids": id_sizes(chunks),
                        "health": t.guard.partials(),
                    }
                )
            coordinator = the_coordinator(ph.received) if comm is not None else 0
            for (
                sent
            ) in ph.received:  # every rank's figures: the coordinator's manifest records them
                t.guard.merge(sent["health"])
            who = owners([dict(g["ids"]) for g in ph.received])
            # 2. write what the store lacks, in this rank's session; 3. hand the pins over
            with phase(comm, "write", "dcp.save into ckstore (write)") as ph:
                t.store(
                    [c for c in chunks if who[c.id] == (comm.rank if comm is not None else 0)],
                    hashed=True,
                )
                ph.send(t.stats.figures())
            self._figures = {
                k: sum(f[k] for f in ph.received)
                for k in ("new_bytes", "new_chunks", "reused_chunks")
            }
            keep = comm is None or self._hand_over(comm, t, coordinator, sorted(who))
        finally:
            if keep:
                self._held.append(t)  # until finish commits in its session
            else:
                t.close()
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _hand_over(self, comm: Comm, t: LocalTake, coordinator: int, every: list[str]) -> bool:
        """All ranks wrote: the coordinator pins every chunk of the save, then the others end
        their sessions. Returns True on the coordinator (it keeps its session for ``finish``)."""
        with phase(
            comm, "commit", "dcp.save into ckstore (hand-over to the coordinator)", root=coordinator
        ):
            if comm.rank == coordinator:
                lost = set(every) - t.pin(every)
                if lost:
                    raise CorruptionError(
                        f"{len(lost)} chunk(s) of this save are not in the index, e.g. {min(lost)}"
                    )
        if comm.rank == coordinator:
            return True
        t.hand_over()  # the coordinator holds the pins now
        return False

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        if not self._held:
            raise DistributedError(
                "dcp.save into ckstore: finish() without a successful write_data() on this rank"
            )
        t = self._held[0]
        try:
            self._refuse_existing()  # again: another save may have committed meanwhile
            metadata.version = DCP_VERSION
            metadata.storage_data = {wr.index: wr.storage_data for rs in results for wr in rs}
            metadata.storage_meta = self.storage_meta()
            doc = metadata_to_json(metadata)
            entries = manifest_entries(metadata, self.store.config.chunk_bytes)
            apps = {
                APP: {
                    "$dict": [
                        [encode_value(fqn, fqn), {"$ref": join(APP, fqn)}]
                        for fqn in metadata.state_dict_metadata
                    ],
                    "$cls": "dict",
                }
            }
            manifest = t.manifest(apps, entries, world_size=self._world, dcp=doc)
            committed = t.commit(
                manifest, validate=True, figures=self._figures
            )  # every tensor's pieces must tile it
            self.snapshot = self.store.get(committed.id)
        finally:
            _abort_all(self._held)

    def close(self) -> None:
        """Abort a save that wrote but was never finished (idempotent)."""
        _abort_all(self._held)


_RANK, _MEMBERS = "ckstore_rank", "ckstore_members"


def _global_rank() -> int | None:
    if not is_distributed():
        return None
    import torch.distributed as dist

    return int(dist.get_rank())


def _abort_all(held: list[LocalTake]) -> None:
    """End (and, unless committed, abort) every held session."""
    while held:
        held.pop().close()


def _parse_checkpoint_id(checkpoint_id: Any) -> tuple[str, int | None]:
    text = str(checkpoint_id)
    m = _RUN_STEP.match(text)
    return (m["run"], int(m["step"])) if m else (text, None)


def _checkpoint_id(run: str, step: int | None) -> str:
    return run if step is None else f"{run}@{step}"
