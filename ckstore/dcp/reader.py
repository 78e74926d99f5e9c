"""``StorageReader``: ``dcp.load`` from a snapshot written by ``StorageWriter`` (any world size)."""

from __future__ import annotations

import io
import math
import os
import uuid
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint import StorageReader as _DcpStorageReader
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from ..distributed import is_distributed
from ..distributed.comm import Comm, phase
from ..errors import CorruptionError
from ..format.dtypes import dtype_name, itemsize
from ..format.manifest import TensorEntry
from ..format.values import decode_value
from ..store_ref import StoreRef
from .meta import metadata_from_json
from .plan import piece_ref
from .url import is_ckstore_id, parse

if TYPE_CHECKING:
    from ..store import Store


class StorageReader(_DcpStorageReader):
    """Reads a snapshot written by :class:`StorageWriter` for ``dcp.load`` (any world size).

    ``ref`` is anything ``store.get`` resolves ("run", "run@step", a tag, an id prefix). In a
    distributed load every rank uses the snapshot rank 0 resolved, so a save committing
    meanwhile cannot split the ranks. ``dcp.load(..., checkpoint_id=ref)`` overrides ``ref``.
    ``store`` may be an open store or a URL (with ``index`` and ``storage_options``); the
    reader pickles like :class:`StorageWriter` and reopens the store on first use.
    """

    def __init__(
        self,
        store: Store | str | os.PathLike[str],
        ref: str,
        *,
        timeout: float | None = None,
        index: str | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self._ref = StoreRef(store, index, storage_options)
        self.ref = ref
        self.timeout = timeout
        self.snapshot: Any = None
        self.load_id = uuid.uuid4().hex
        self._metadata: Metadata | None = None
        self._storage: dict[MetadataIndex, Any] = {}

    @property
    def store(self) -> Store:
        """The open store (reopened on first use after the reader was pickled)."""
        return self._ref.get()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["snapshot"] = None  # bound to this process's open store
        return state

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id and is_ckstore_id(checkpoint_id):
            found = parse(checkpoint_id)
            if found.store != self._ref.url:
                self._ref = StoreRef(found.store)
            self.ref = found.ref
        elif checkpoint_id:
            self.ref = str(checkpoint_id)
        self.snapshot = None
        self._metadata = None
        self._storage = {}
        self.load_id = uuid.uuid4().hex

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return is_ckstore_id(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CorruptionError(
                "ckstore keeps one global DCP metadata per snapshot, no rank-local metadata"
            )
        comm = None
        if is_distributed():
            import torch.distributed as dist

            if dist.get_world_size() > 1:
                comm = Comm(None, self.timeout, purpose="dcp")
        with phase(
            comm, "dcp.load (resolving the snapshot)", f"dcp.load of {self.ref!r} from ckstore"
        ) as ph:
            snap = self.store.get(self.ref)
            ph.send(snap.id)
        if ph.received[0] != snap.id:  # every rank loads the snapshot rank 0 resolved
            snap = self.store.get(ph.received[0])
        self.snapshot = snap
        where = f"snapshot {snap.run}@{snap.step} ({snap.id[:12]})"
        manifest = snap.manifest
        doc = (manifest.snapshot or {}).get("dcp")
        md = metadata_from_json(doc, f"{where}: DCP metadata")
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        self._metadata = md
        return md

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self._metadata = metadata
        self._storage = dict(metadata.storage_data or {})

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        assert self._metadata is not None, "read_metadata/set_up_storage_reader first"
        where = (
            f"DCP snapshot {self.snapshot.id[:12]}" if self.snapshot is not None else "DCP snapshot"
        )
        entries: dict[str, TensorEntry] = {}
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
            refs = tuple(piece_ref(p) for p in data["pieces"])
            entries[key] = TensorEntry(dtype_name(md.properties.dtype), shape, refs, shape)
            base = req.storage_index.offset or torch.Size([0] * len(shape))
            offs = tuple(int(b) + int(o) for b, o in zip(base, req.storage_offsets))
            wanted[key] = (offs, tuple(int(n) for n in req.lengths))
            tensor_reqs.append((key, req))
        snap = self.snapshot if self.snapshot is not None else self.store.get(self.ref)
        for batch in _batches(tensor_reqs, wanted, entries):
            tensors = snap.read_regions(
                {k: entries[k] for k, _ in batch}, {k: wanted[k] for k, _ in batch}, where=where
            )
            for key, req in batch:
                src = tensors.pop(key)
                target = planner.resolve_tensor(req).detach()
                if target.size() != src.size():
                    raise CorruptionError(
                        f"{where}: {req.storage_index} is {list(src.size())}, DCP wants {list(target.size())}"
                    )
                target.copy_(src)
                planner.commit_tensor(req, target)
        for req, encoded in values:
            buf = io.BytesIO()
            torch.save(
                decode_value(encoded), buf
            )  # made here from JSON: nothing stored is unpickled
            buf.seek(0)
            planner.load_bytes(req, buf)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut


_BATCH_BYTES = 256 << 20


def _batches(
    reqs: list[tuple[str, Any]], wanted: dict[str, Any], entries: dict[str, TensorEntry]
) -> list[list[tuple[str, Any]]]:
    """Group read items so one batch holds about ``_BATCH_BYTES`` of tensors at a time."""
    out: list[list[tuple[str, Any]]] = [[]]
    size = 0
    for key, req in reqs:
        n = math.prod(wanted[key][1]) * itemsize(entries[key].dtype)
        if out[-1] and size + n > _BATCH_BYTES:
            out.append([])
            size = 0
        out[-1].append((key, req))
        size += n
    return out if out[0] else []
