"""ckstore as a storage backend of PyTorch Distributed Checkpoint (DCP).

Usage, on every rank (or in a plain process)::

    import torch.distributed.checkpoint as dcp
    from ckstore.dist.dcp import StorageReader, StorageWriter

    dcp.save(state_dict, storage_writer=StorageWriter(store, run="train", step=100))
    dcp.load(state_dict, storage_reader=StorageReader(store, "train@100"))

DCP plans (which rank writes what, resharding on load); ckstore stores the bytes, deduplicated.

What is stored
--------------
* **Tensor data** is cut on ckstore's chunk grid of the tensor's GLOBAL shape (the same grid
  ``store.take`` uses), intersected with each write item's box. A DCP shard therefore yields
  the same chunk ids for every block wholly inside it, whatever the world size, and an
  unchanged tensor yields identical ids next time: a second ``dcp.save`` of unchanged state
  writes no chunk bytes. Chunks are hashed, looked up in the index (pinning what it has), and
  the missing ones encoded into packs exactly as a take does (``ckstore._take`` functions).
* **Non-tensor values** (DCP's ``BYTE_IO`` items: step counters, learning rates, ...) are NOT
  stored as DCP's ``torch.save`` bytes. The writer takes the object itself from the planner
  (``planner.lookup_object``, which ``DefaultSavePlanner`` and its subclasses have) and stores
  it as ckstore's lossless JSON value encoding; anything that encoding refuses is refused with
  an error naming the key. On load the value is decoded from JSON and handed to
  ``planner.load_bytes`` through an in-memory ``torch.save``: nothing read from the store is
  ever unpickled.
* **DCP's Metadata** (``state_dict_metadata``, ``storage_data``, ``planner_data``,
  ``storage_meta``, ``version``) is encoded as JSON by this module (format
  ``ckstore/dcp-metadata`` version 1, see :func:`metadata_to_json`), never pickled. A
  ``planner_data`` that is not JSON-able is refused with a clear error.
* **One ckstore snapshot per save**, committed by DCP's coordinator in ``finish`` in one index
  transaction. Its manifest is a regular, fully validated ckstore manifest: app ``"dcp"``
  holds one entry per DCP key (``dcp/<fqn>``); a tensor key is a tensor entry of its real
  dtype and global shape whose chunks are the pieces every rank wrote (they tile the tensor),
  a value key is a value entry. The DCP metadata JSON lives in the manifest's snapshot header
  under ``"dcp"``: the manifest is the content-named blob that holds it, so GC, ``check``,
  ``log``, ``diff`` and ``reindex`` treat the save like any other snapshot and the metadata
  lives exactly as long as the snapshot (a blob of another kind would be unknown to GC and
  reindex). ``StorageReader`` reads only that header and the chunks.

Leases and GC (why nothing a save relies on can be pruned)
----------------------------------------------------------
Every rank writes under its own write session (:class:`ckstore._lease.Lease`): the chunks it
reuses are pinned by ``lookup_chunks``, the chunks it writes by ``add_pack``. DCP calls
``finish`` on the coordinator only, so other ranks never learn when the snapshot is committed.
Ending their sessions right after writing would drop their pins before the coordinator
commits, and a concurrent GC with grace 0 could prune those chunk rows. Instead ``write_data``
ends with a hand-over over a dedicated gloo group (JSON collectives, bounded by
``CKSTORE_DIST_TIMEOUT``): every rank reports its status and chunk ids; the coordinator pins
every chunk of the save under ITS session (``lookup_chunks``; all must be found); only after
that do the other ranks end their sessions. The coordinator's session stays alive (heartbeat)
until ``finish`` commits under it, which drops its pins in the same transaction that makes
the snapshot reference every chunk. So at every moment each chunk the save uses is pinned by a
live lease or referenced by the committed snapshot; the save does not depend on GC's grace
period. If anything fails the sessions are aborted; if DCP never calls ``finish`` after a
successful ``write_data`` (a rank died in DCP's own gather), the coordinator's session is
aborted by the writer's next ``set_up_storage_writer``/``reset``, by :meth:`StorageWriter.close`,
or when the writer is garbage collected, else it expires with its process.

The same hand-over assigns each distinct chunk id one writer, so two ranks holding identical
bytes do not both write them.

Limits: only process groups spanning all ranks (``dcp.save``'s default group) and
``use_collectives=True`` are supported. A rank that fails before reaching ``write_data``
holds the others in the hand-over until the timeout.
"""

from __future__ import annotations

import io
import math
import re
import time
import uuid
import weakref
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint import StorageReader as _DcpStorageReader
from torch.distributed.checkpoint import StorageWriter as _DcpStorageWriter
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .._dtypes import DTYPES, GROUPED, dtype_name, itemsize
from .._grid import Box, make_grid
from .._lease import Lease
from .._restore import Reader
from .._packing import TakeOptions, _Chunk, write_missing
from .._take import entry_records, hash_chunks
from .._tensors import as_cpu_tensor, byte_view
from .._tree import join
from .._values import decode_value, encode_value
from ..errors import CkstoreError, CorruptionError, DistributedError, InvalidInputError, UnsupportedValueError
from ..index import SnapshotRecord
from ..manifest import ChunkRef, Entry, Manifest, TensorEntry, ValueEntry, canonical_json
from ._boxes import pieces
from ._comm import Comm, failure, raise_failed

__all__ = ["StorageReader", "StorageWriter", "metadata_from_json", "metadata_to_json"]

FORMAT = "ckstore/dcp-metadata"
VERSION = 1
APP = "dcp"
DCP_VERSION = "1.0.0"  # what torch's FileSystemWriter records for this layout of Metadata

_LAYOUTS: dict[str, torch.layout] = {
    n: getattr(torch, n)
    for n in ("strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc", "_mkldnn")
    if isinstance(getattr(torch, n, None), torch.layout)
}
_MEMORY_FORMATS: dict[str, torch.memory_format] = {
    "contiguous_format": torch.contiguous_format,
    "channels_last": torch.channels_last,
    "channels_last_3d": torch.channels_last_3d,
    "preserve_format": torch.preserve_format,
}
_RUN_STEP = re.compile(r"^(?P<run>.+)@(?P<step>\d+)$")


# ---------------------------------------------------------------------------------- writer
class StorageWriter(_DcpStorageWriter):
    """Writes a ``dcp.save`` into ``store`` as one snapshot of ``run`` (at ``step``).

    Args:
        store: an open :class:`ckstore.Store` (each rank opens its own).
        run, step, tags, metadata: as for ``store.take``.
        name: optional unique snapshot name.
        timeout: seconds ranks wait for each other in the hand-over (default
            ``CKSTORE_DIST_TIMEOUT`` or 600).

    ``dcp.save(..., checkpoint_id="run" or "run@step")`` overrides run/step.
    After a save, :attr:`snapshot` (coordinator) is the committed :class:`ckstore.Snapshot`.
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
    ) -> None:
        super().__init__()
        from ..store import _check_take_args

        _check_take_args(run, step, metadata)
        self.store = store
        self.run = run
        self.step = step
        self.tags = tuple(tags)
        self.metadata = dict(metadata or {})
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
        from . import is_distributed

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
        if is_distributed():
            import torch.distributed as dist

            if dist.get_world_size() > 1:
                self._comm = Comm(None, self.timeout)  # collective: every rank is here
                self._world = self._comm.world

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        opts: TakeOptions = self.store._take_options()
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
            metadata.version = DCP_VERSION
            metadata.storage_data = {wr.index: wr.storage_data for rs in results for wr in rs}
            metadata.storage_meta = self.storage_meta()
            doc = metadata_to_json(metadata)
            entries = _manifest_entries(metadata, self.store.config.chunk_bytes)
            apps = {APP: {"$dict": [[encode_value(fqn, fqn), {"$ref": join(APP, fqn)}] for fqn in metadata.state_dict_metadata], "$cls": "dict"}}
            header = {
                "run": self.run, "step": self.step, "created_at": self._started, "metadata": dict(self.metadata),
                "name": self.name, "session": lease.id, "world_size": self._world, "dcp": doc,
            }
            manifest = Manifest(apps, entries, header)
            raw = manifest.to_json()
            Manifest.from_json(raw, "the DCP manifest being committed")  # every tensor's pieces must tile it
            manifest_id = self.store.objects.put_blob("manifests", raw)
            record = SnapshotRecord(
                id=manifest_id, run=self.run, step=self.step, parent_id=None, manifest_id=manifest_id,
                created_at=self._started, metadata=dict(self.metadata), logical_bytes=manifest.logical_bytes(),
                new_bytes=self._stats.get("new_bytes", 0), new_chunks=self._stats.get("new_chunks", 0),
                reused_chunks=self._stats.get("reused_chunks", 0), name=self.name, world_size=self._world,
            )
            committed = self.store.index.commit_snapshot(
                lease.id, record, entry_records(manifest), sorted(manifest.chunk_ids()), len(raw), self.tags
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


def _cut_items(items: list[WriteItem], planner: SavePlanner, opts: TakeOptions) -> tuple[list[WriteResult], list[_Chunk]]:
    """Per item: its pieces on the global grid (tensors) or its JSON value (everything else).

    Returns the WriteResults (piece ids filled in later by :func:`_fill_ids`) and the chunks.
    """
    results: list[WriteResult] = []
    chunks: list[_Chunk] = []
    for item in items:
        fqn = item.index.fqn
        if item.type == WriteItemType.BYTE_IO:
            lookup = getattr(planner, "lookup_object", None)
            if not callable(lookup):
                raise UnsupportedValueError(
                    f"key {fqn!r}: ckstore stores DCP's non-tensor values as JSON and needs a planner with "
                    "lookup_object() (DefaultSavePlanner or a subclass); it never stores pickled bytes"
                )
            encoded = encode_value(lookup(item.index), fqn)
            results.append(WriteResult(item.index, len(canonical_json(encoded)), {"value": encoded}))
            continue
        td = item.tensor_data
        if td is None:
            raise InvalidInputError(f"key {fqn!r}: DCP write item without tensor data")
        data = planner.resolve_data(item)
        t = as_cpu_tensor(data, fqn)
        name = dtype_name(t.dtype, fqn)
        if t.dtype != td.properties.dtype:
            raise InvalidInputError(f"key {fqn!r}: DCP planned {td.properties.dtype}, resolve_data gave {t.dtype}")
        box: Box = (tuple(int(o) for o in td.chunk.offsets), tuple(int(s) for s in td.chunk.sizes))
        if tuple(t.shape) != box[1]:
            raise InvalidInputError(f"key {fqn!r}: DCP planned a {list(box[1])} shard, resolve_data gave {list(t.shape)}")
        grid = make_grid(tuple(int(s) for s in td.size), t.element_size(), opts.chunk_bytes)
        mine: list[list[Any]] = []
        for po, ps in pieces(grid, box):
            sub = t[tuple(slice(o - b, o - b + s) for o, b, s in zip(po, box[0], ps))]
            chunks.append(_Chunk(fqn, byte_view(sub), t.element_size(), name in GROUPED))
            mine.append([list(po), list(ps), ""])
        results.append(WriteResult(item.index, math.prod(box[1]) * t.element_size(), {"dtype": name, "pieces": mine}))
    return results, chunks


def _fill_ids(results: list[WriteResult], chunks: list[_Chunk]) -> None:
    """Write each hashed chunk's id into its piece of the results, in the order they were cut."""
    it = iter(chunks)
    for r in results:
        for piece in r.storage_data.get("pieces", ()):
            piece[2] = next(it).id


def _id_sizes(chunks: list[_Chunk]) -> list[list[Any]]:
    return sorted({c.id: len(c.view) for c in chunks}.items())  # type: ignore[arg-type]


def _the_coordinator(gathered: list[dict[str, Any]]) -> int:
    ranks = [r for r, g in enumerate(gathered) if g.get("coordinator")]
    if len(ranks) != 1:
        raise DistributedError(
            f"dcp.save into ckstore: {len(ranks)} ranks call themselves DCP's coordinator (only process "
            "groups spanning every rank are supported)"
        )
    return ranks[0]


def _owners(per_rank: list[dict[str, int]]) -> dict[str, int]:
    """One writer per distinct chunk id: its only holder, else the least-loaded holder."""
    holders: dict[str, list[int]] = defaultdict(list)
    size: dict[str, int] = {}
    for r, ids in enumerate(per_rank):
        for cid, n in ids.items():
            holders[cid].append(r)
            size[cid] = n
    load = [0] * len(per_rank)
    owners: dict[str, int] = {}
    for cid, hs in holders.items():
        if len(hs) == 1:
            owners[cid] = hs[0]
            load[hs[0]] += size[cid]
    for cid in sorted(c for c, hs in holders.items() if len(hs) > 1):
        r = min(holders[cid], key=lambda q: (load[q], q))
        owners[cid] = r
        load[r] += size[cid]
    return owners


def _manifest_entries(metadata: Metadata, chunk_bytes: int) -> dict[str, Entry]:
    """One manifest entry per DCP key: tensors with the pieces of every rank, values inline."""
    by_fqn: dict[str, list[Any]] = defaultdict(list)
    for index, data in (metadata.storage_data or {}).items():
        by_fqn[index.fqn].append(data)
    entries: dict[str, Entry] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        key = join(APP, fqn)
        datas = by_fqn.get(fqn, [])
        if isinstance(md, BytesStorageMetadata):
            if len(datas) != 1 or "value" not in datas[0]:
                raise InvalidInputError(f"dcp.save into ckstore: value key {fqn!r} was written {len(datas)} times")
            entries[key] = ValueEntry(datas[0]["value"])
            continue
        name = dtype_name(md.properties.dtype, fqn)
        shape = tuple(int(s) for s in md.size)
        refs = sorted(
            (ChunkRef(tuple(o), tuple(s), cid) for d in datas for o, s, cid in d["pieces"]),
            key=lambda c: c.offsets,
        )
        entries[key] = TensorEntry(name, shape, tuple(refs), make_grid(shape, itemsize(name), chunk_bytes).block)
    return entries


# ---------------------------------------------------------------------------- metadata JSON
def metadata_to_json(metadata: Metadata) -> dict[str, Any]:
    """DCP's Metadata as JSON-able data (no pickle).

    ``{"format": "ckstore/dcp-metadata", "version": 1, "dcp_version": ..., "state_dict_metadata":
    {fqn: {"type": "tensor", "dtype", "layout", "requires_grad", "memory_format", "pin_memory",
    "size", "chunks": [[offsets, sizes], ...]} | {"type": "bytes"}}, "storage_data": [[{"fqn",
    "offset", "index"}, data], ...], "planner_data": <ckstore value encoding>, "storage_meta":
    {...} | null}``. A tensor item's ``data`` is ``{"dtype", "pieces": [[offsets, sizes,
    chunk id], ...]}`` (global coordinates); a value item's is ``{"value": <encoding>}``.
    """
    sdm: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            sdm[fqn] = {"type": "bytes"}
        elif isinstance(md, TensorStorageMetadata):
            p = md.properties
            sdm[fqn] = {
                "type": "tensor",
                "dtype": dtype_name(p.dtype, fqn),
                "layout": _name_of(_LAYOUTS, p.layout, "layout", fqn),
                "requires_grad": bool(p.requires_grad),
                "memory_format": _name_of(_MEMORY_FORMATS, p.memory_format, "memory_format", fqn),
                "pin_memory": bool(p.pin_memory),
                "size": [int(s) for s in md.size],
                "chunks": [[[int(o) for o in c.offsets], [int(s) for s in c.sizes]] for c in md.chunks],
            }
        else:
            raise UnsupportedValueError(f"key {fqn!r}: unknown DCP storage metadata {type(md).__name__}")
    storage = [
        [{"fqn": i.fqn, "offset": None if i.offset is None else [int(o) for o in i.offset], "index": i.index}, d]
        for i, d in (metadata.storage_data or {}).items()
    ]
    try:
        planner = encode_value(metadata.planner_data, "planner_data")
        canonical_json(planner)
    except (UnsupportedValueError, TypeError, ValueError) as exc:
        raise UnsupportedValueError(
            f"dcp.save into ckstore: the planner's planner_data is not JSON-able ({exc}); ckstore never "
            "pickles metadata. Use DefaultSavePlanner or a planner whose planner_data is plain data"
        ) from exc
    sm = metadata.storage_meta
    meta = None if sm is None else {
        "checkpoint_id": None if sm.checkpoint_id is None else str(sm.checkpoint_id),
        "save_id": sm.save_id, "load_id": sm.load_id, "modules": list(sm.modules),
    }
    return {
        "format": FORMAT, "version": VERSION, "dcp_version": metadata.version,
        "state_dict_metadata": sdm, "storage_data": storage, "planner_data": planner, "storage_meta": meta,
    }


def metadata_from_json(doc: Any, where: str = "DCP metadata") -> Metadata:
    """Inverse of :func:`metadata_to_json`; anything malformed raises CorruptionError."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CorruptionError(f"{where} is not ckstore DCP metadata (was the snapshot written by dcp.save?)")
    if doc.get("version") != VERSION:
        raise CorruptionError(f"{where} has version {doc.get('version')!r}; this ckstore reads {VERSION}")
    try:
        sdm: dict[str, Any] = {}
        for fqn, d in doc["state_dict_metadata"].items():
            if d["type"] == "bytes":
                sdm[fqn] = BytesStorageMetadata()
                continue
            if d["type"] != "tensor" or d["dtype"] not in DTYPES:
                raise ValueError(f"key {fqn!r}: type {d['type']!r} / dtype {d.get('dtype')!r}")
            props = TensorProperties(
                dtype=DTYPES[d["dtype"]],
                layout=_LAYOUTS[d["layout"]],
                requires_grad=bool(d["requires_grad"]),
                memory_format=_MEMORY_FORMATS[d["memory_format"]],
                pin_memory=bool(d["pin_memory"]),
            )
            chunks = [ChunkStorageMetadata(torch.Size(_ints(o)), torch.Size(_ints(s))) for o, s in d["chunks"]]
            sdm[fqn] = TensorStorageMetadata(props, torch.Size(_ints(d["size"])), chunks)
        storage = {}
        for idx, data in doc["storage_data"]:
            offset = None if idx["offset"] is None else _ints(idx["offset"])
            storage[MetadataIndex(str(idx["fqn"]), offset, idx.get("index"))] = data
        sm = doc.get("storage_meta")
        meta = None if sm is None else StorageMeta(
            checkpoint_id=sm.get("checkpoint_id"), save_id=sm.get("save_id"), load_id=sm.get("load_id"),
            modules=[str(m) for m in sm.get("modules") or []],
        )
        return Metadata(
            state_dict_metadata=sdm, planner_data=decode_value(doc.get("planner_data")),
            storage_data=storage, storage_meta=meta, version=doc.get("dcp_version"),
        )
    except CorruptionError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CorruptionError(f"{where} is malformed: {type(exc).__name__}: {exc}") from exc


def _name_of(table: dict[str, Any], value: Any, what: str, fqn: str) -> str:
    for name, v in table.items():
        if v == value:
            return name
    raise UnsupportedValueError(f"key {fqn!r}: {what} {value} cannot be recorded")


def _ints(v: Any) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(type(x) is int for x in v):
        raise ValueError(f"expected a list of ints, got {str(v)[:60]}")
    return tuple(v)


# ---------------------------------------------------------------------------------- reader
class StorageReader(_DcpStorageReader):
    """Reads a snapshot written by :class:`StorageWriter` for ``dcp.load`` (any world size).

    ``ref`` is anything ``store.get`` resolves ("run", "run@step", a tag, an id prefix). In a
    distributed load every rank uses the snapshot rank 0 resolved, so a save committing
    meanwhile cannot split the ranks. ``dcp.load(..., checkpoint_id=ref)`` overrides ``ref``.
    """

    def __init__(self, store: Any, ref: str, *, timeout: float | None = None) -> None:
        super().__init__()
        self.store = store
        self.ref = ref
        self.timeout = timeout
        self.snapshot: Any = None
        self.load_id = uuid.uuid4().hex
        self._metadata: Metadata | None = None
        self._storage: dict[MetadataIndex, Any] = {}

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id:
            self.ref = str(checkpoint_id)
        self.snapshot = None
        self._metadata = None
        self._storage = {}
        self.load_id = uuid.uuid4().hex

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CorruptionError("ckstore keeps one global DCP metadata per snapshot, no rank-local metadata")
        from . import is_distributed

        mine: dict[str, Any]
        snap = None
        try:
            snap = self.store.get(self.ref)
            mine = {"ok": True, "id": snap.id}
        except Exception as exc:
            if not is_distributed():
                raise
            mine = failure(exc)
        if is_distributed():
            import torch.distributed as dist

            if dist.get_world_size() > 1:
                got = Comm(None, self.timeout).all_gather_json(mine, "dcp.load (resolving the snapshot)")
                raise_failed(got, f"dcp.load of {self.ref!r} from ckstore")
                if got[0]["id"] != mine["id"]:
                    snap = self.store.get(got[0]["id"])
        assert snap is not None
        self.snapshot = snap
        where = f"snapshot {snap.run}@{snap.step} ({snap.id[:12]})"
        manifest = Manifest.from_json(self.store.objects.get_blob("manifests", snap.record.manifest_id), where)
        doc = (manifest.snapshot or {}).get("dcp")
        md = metadata_from_json(doc, f"{where}: DCP metadata")
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        self._metadata = md
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._metadata = metadata
        self._storage = dict(metadata.storage_data or {})

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        assert self._metadata is not None, "read_metadata/set_up_storage_reader first"
        where = f"DCP snapshot {self.snapshot.id[:12]}" if self.snapshot is not None else "DCP snapshot"
        entries: dict[str, Entry] = {}
        wanted: dict[str, Any] = {}
        values: list[tuple[Any, Any]] = []
        tensor_reqs: list[tuple[str, Any]] = []
        for i, req in enumerate(plan.items):
            data = self._storage.get(req.storage_index)
            if data is None:
                raise CorruptionError(f"{where}: no stored data for {req.storage_index}")
            if req.type == LoadItemType.BYTE_IO:
                if not isinstance(data, dict) or "value" not in data:
                    raise CorruptionError(f"{where}: key {req.storage_index.fqn!r} holds no value")
                values.append((req, data["value"]))
                continue
            md = self._metadata.state_dict_metadata.get(req.storage_index.fqn)
            if not isinstance(md, TensorStorageMetadata):
                raise CorruptionError(f"{where}: key {req.storage_index.fqn!r} is not a tensor")
            key = f"{i}"
            shape = tuple(int(s) for s in md.size)
            refs = tuple(ChunkRef(_ints(o), _ints(s), str(c)) for o, s, c in data["pieces"])
            entries[key] = TensorEntry(dtype_name(md.properties.dtype), shape, refs, shape)
            base = req.storage_index.offset or torch.Size([0] * len(shape))
            offs = tuple(int(b) + int(o) for b, o in zip(base, req.storage_offsets))
            wanted[key] = (offs, tuple(int(n) for n in req.lengths))
            tensor_reqs.append((key, req))
        reader = Reader(self.store.objects, self.store.index, Manifest({}, entries), where, threads=self.store.threads)
        for batch in _batches(tensor_reqs, wanted, entries):
            tensors = reader.read_regions({k: wanted[k] for k, _ in batch})
            for key, req in batch:
                src = tensors.pop(key)
                target = planner.resolve_tensor(req).detach()
                if target.size() != src.size():
                    raise CorruptionError(f"{where}: {req.storage_index} is {list(src.size())}, DCP wants {list(target.size())}")
                target.copy_(src)
                planner.commit_tensor(req, target)
        for req, encoded in values:
            buf = io.BytesIO()
            torch.save(decode_value(encoded), buf)  # made here from JSON: nothing stored is unpickled
            buf.seek(0)
            planner.load_bytes(req, buf)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut


_BATCH_BYTES = 256 << 20


def _batches(reqs: list[tuple[str, Any]], wanted: dict[str, Any], entries: dict[str, Entry]) -> list[list[tuple[str, Any]]]:
    """Group read items so one batch holds about ``_BATCH_BYTES`` of tensors at a time."""
    out: list[list[tuple[str, Any]]] = [[]]
    size = 0
    for key, req in reqs:
        e = entries[key]
        assert isinstance(e, TensorEntry)
        n = math.prod(wanted[key][1]) * itemsize(e.dtype)
        if out[-1] and size + n > _BATCH_BYTES:
            out.append([])
            size = 0
        out[-1].append((key, req))
        size += n
    return out if out[0] else []
