"""``StorageWriter``: a ``dcp.save`` as one ckstore snapshot, with the lease hand-over between ranks."""

from __future__ import annotations

import re
import time
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from torch.distributed.checkpoint import StorageWriter as _DcpStorageWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ..dist._comm import Comm, failure, raise_failed
from ..engine.lease import Lease
from ..engine.packing import TakeOptions, _Chunk, write_missing
from ..engine.take import commit_manifest, hash_chunks
from ..errors import (
    CkstoreError,
    ConflictError,
    CorruptionError,
    DistributedError,
    InvalidInputError,
)
from ..format.manifest import Manifest, snapshot_header
from ..format.tree import join
from ..format.values import encode_value
from ..index import tag_specs
from ._store import StoreRef
from .meta import metadata_to_json
from .plan import (
    APP,
    _cut_items,
    _fill_ids,
    _id_sizes,
    _manifest_entries,
    _owners,
    _the_coordinator,
)

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
            False: refuse, with ``ConflictError``, a save whose target exists: the snapshot
            called ``name`` if given, else ``run@step``, else (no step) any snapshot of
            ``run``. Checked when the save starts and again just before it commits.
        index, storage_options: for a store given by URL (an open store's are reused).

    ``dcp.save(..., checkpoint_id="run" or "run@step")`` overrides run/step.
    After a save, :attr:`snapshot` (coordinator) is the committed :class:`ckstore.Snapshot`.
    The writer pickles (for ``dcp.async_save`` with the process executor): it carries the
    store URL, index URL and options and reopens the store in the other process; there
    :attr:`snapshot` is set, not in the process that called ``async_save``.
    """

    def __init__(
        self,
        store: Any,
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
    ) -> None:
        super().__init__()
        from .._takes import check_take_args

        self.metadata = check_take_args(run, step, metadata, name, tuple(tags))
        self.tags = tag_specs(tuple(tags), move_tags)
        self._ref = StoreRef(store, index, storage_options, create=True)
        self.overwrite = bool(overwrite)
        self.run = run
        self.step = step
        self.name = name
        self.timeout = timeout
        self.is_coordinator = True
        self.rank = 0
        self.snapshot: Any = None
        self.save_id = uuid.uuid4().hex
        self._comm: Comm | None = None
        self._started = 0.0
        self._stats: dict[str, int] = {}
        self._world = 1
        self._held: list[Lease] = []  # the coordinator's lease, kept from write_data to finish
        self._finalizer = weakref.finalize(self, _abort_all, self._held)

    @property
    def store(self) -> Any:
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
        found = [
            s for s in self.store.index.list_snapshots(run=None if self.name else self.run)
            if (s.name == self.name if self.name else self.step is None or s.step == self.step)
        ]
        if found:
            target = self.name or _checkpoint_id(self.run, self.step)
            raise ConflictError(
                f"dcp.save into ckstore: {target!r} already exists in {self.store.url} "
                f"(snapshot {found[0].id[:12]}) and overwrite=False; pick another step or name, "
                "or pass overwrite=True to add a newer snapshot"
            )

    # DCP API ------------------------------------------------------------------------------
    def reset(self, checkpoint_id: Any = None) -> None:
        _abort_all(self._held)
        if checkpoint_id:
            self.run, self.step = _parse_checkpoint_id(checkpoint_id)
        self.save_id = uuid.uuid4().hex
        self.snapshot = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False  # needs a store: never picked automatically from a bare checkpoint_id

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=_checkpoint_id(self.run, self.step), save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        from ..dist import is_distributed

        _abort_all(self._held)  # a previous save that never reached finish
        if not kwargs.get("use_collectives", True):
            raise InvalidInputError("ckstore's DCP StorageWriter needs dcp.save(use_collectives=True)")
        self.is_coordinator = bool(is_coordinator)
        self.rank = int(kwargs.get("rank") or 0)
        self._started = time.time()
        self._stats = {}
        self.snapshot = None
        self._comm = None
        self._world = 1
        self._refuse_existing()  # every rank sees the same index: all refuse, before any collective
        if is_distributed():
            import torch.distributed as dist

            if kwargs.get("rank") is not None and int(kwargs["rank"]) != dist.get_rank():
                raise InvalidInputError(
                    "ckstore's DCP StorageWriter needs dcp.save over every rank (no process_group "
                    "sub-group); to checkpoint a sub-group use Snapshot.take(pg=...) or store.take(pg=...)"
                )
            if dist.get_world_size() > 1:
                self._comm = Comm(None, self.timeout, purpose="dcp")  # every rank is here; a group of its own (async_save runs in a thread)
                self._world = self._comm.world

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        opts: TakeOptions = self.store.take_options()
        comm = self._comm
        with ThreadPoolExecutor(max_workers=opts.threads, thread_name_prefix="ckstore") as pool:
            # 1. cut on the global grid and hash (local); one writer per distinct chunk id
            chunks: list[_Chunk] = []
            results: list[WriteResult] = []
            try:
                results, chunks = _cut_items(plan.items, planner, opts)
                hash_chunks(chunks, pool)
                _fill_ids(results, chunks)
                msg: dict[str, Any] = {"ok": True, "coordinator": self.is_coordinator, "ids": _id_sizes(chunks)}
            except Exception as exc:
                if comm is None:
                    raise
                msg = failure(exc)
            coordinator, every = 0, []
            mine = {c.id: c for c in chunks}
            if comm is not None:
                gathered = comm.all_gather_json(msg, "dcp.save (hashing)")
                raise_failed(gathered, "dcp.save into ckstore (hashing)")
                coordinator = _the_coordinator(gathered)
                owners = _owners([dict(g["ids"]) for g in gathered])
                mine = {cid: c for cid, c in mine.items() if owners[cid] == comm.rank}
                every = sorted(owners)

            # 2. write what the store lacks, under this rank's lease; 3. hand the pins over
            lease = Lease(self.store.index, opts.lease_seconds)
            entered = keep = False
            try:
                try:
                    lease.__enter__()
                    entered = True
                    msg = {"ok": True, "stats": self._write(lease, mine, opts, pool)}
                except Exception as exc:
                    if comm is None:
                        raise
                    msg = failure(exc)
                if comm is None:
                    self._stats = msg["stats"]
                    keep = True
                else:
                    keep = self._hand_over(comm, lease, msg, coordinator, every)
            finally:
                if entered:
                    if keep:
                        self._held.append(lease)  # until finish commits under it
                    else:
                        lease.__exit__(None, None, None)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write(self, lease: Lease, mine: dict[str, _Chunk], opts: TakeOptions, pool: ThreadPoolExecutor) -> dict[str, int]:
        found = self.store.index.lookup_chunks(lease.id, list(mine))
        missing = [c for cid, c in mine.items() if cid not in found]
        stats = write_missing(self.store.objects, self.store.index, lease.id, missing, opts, pool)
        if lease.error is not None:
            raise lease.error
        return {"new_bytes": stats.new_bytes, "new_chunks": stats.new_chunks, "reused_chunks": len(found)}

    def _hand_over(self, comm: Comm, lease: Lease, msg: dict[str, Any], coordinator: int, every: list[str]) -> bool:
        """All ranks wrote: the coordinator pins every chunk of the save, then the others end
        their sessions. Returns True on the coordinator (it keeps its lease for ``finish``)."""
        statuses = comm.all_gather_json(msg, "dcp.save (writing chunks)")
        raise_failed(statuses, "dcp.save into ckstore (writing)")
        reply: dict[str, Any] | None = None
        if comm.rank == coordinator:
            try:
                have = self.store.index.lookup_chunks(lease.id, every)
                lost = [cid for cid in every if cid not in have]
                if lost:
                    raise CorruptionError(f"{len(lost)} chunk(s) of this save are not in the index, e.g. {lost[0]}")
                self._stats = {k: sum(s["stats"][k] for s in statuses) for k in statuses[0]["stats"]}
                reply = {"ok": True}
            except Exception as exc:
                reply = failure(exc)
        reply = comm.broadcast_json(reply, "dcp.save (hand-over)", src=coordinator)
        if not reply.get("ok"):
            raise DistributedError(f"dcp.save into ckstore: hand-over failed on rank {coordinator}: {reply.get('error')}")
        if comm.rank == coordinator:
            return True
        try:
            self.store.index.end_session(lease.id, "committed")  # the coordinator holds the pins now
            lease.committed = True
        except CkstoreError:
            pass  # the session expires by itself; the coordinator's pins cover this rank's chunks
        return False

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        if not self._held:
            raise DistributedError("dcp.save into ckstore: finish() without a successful write_data() on this rank")
        lease = self._held[0]
        try:
            if lease.error is not None:
                raise lease.error
            self._refuse_existing()  # again: another save may have committed meanwhile
            metadata.version = DCP_VERSION
            metadata.storage_data = {wr.index: wr.storage_data for rs in results for wr in rs}
            metadata.storage_meta = self.storage_meta()
            doc = metadata_to_json(metadata)
            entries = _manifest_entries(metadata, self.store.config.chunk_bytes)
            apps = {APP: {"$dict": [[encode_value(fqn, fqn), {"$ref": join(APP, fqn)}] for fqn in metadata.state_dict_metadata], "$cls": "dict"}}
            header = snapshot_header(
                run=self.run, step=self.step, created_at=self._started, metadata=self.metadata, name=self.name,
                session=lease.id, world_size=self._world, dcp=doc,
            )
            manifest = Manifest(apps, entries, header)
            committed = commit_manifest(
                self.store.objects, self.store.index, lease.id, manifest, self.tags,
                new_bytes=self._stats.get("new_bytes", 0), new_chunks=self._stats.get("new_chunks", 0),
                reused_chunks=self._stats.get("reused_chunks", 0),
                validate=True,  # every tensor's pieces must tile it
            )
            lease.committed = True
            from ..snapshot import Snapshot

            self.snapshot = Snapshot._bind(self.store, committed, manifest)
        finally:
            _abort_all(self._held)

    def close(self) -> None:
        """Abort a save that wrote but was never finished (idempotent)."""
        _abort_all(self._held)


def _abort_all(held: list[Lease]) -> None:
    """Stop (and, unless committed, abort) every held lease."""
    while held:
        held.pop().__exit__(None, None, None)


def _parse_checkpoint_id(checkpoint_id: Any) -> tuple[str, int | None]:
    text = str(checkpoint_id)
    m = _RUN_STEP.match(text)
    return (m["run"], int(m["step"])) if m else (text, None)


def _checkpoint_id(run: str, step: int | None) -> str:
    return run if step is None else f"{run}@{step}"

