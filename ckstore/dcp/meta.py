"""DCP's Metadata as JSON and back (format ``ckstore/dcp-metadata``): never pickled."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ..errors import CorruptionError, UnsupportedValueError
from ..format.dtypes import DTYPES, dtype_name
from ..format.manifest import canonical_json
from ..format.values import decode_value, encode_value

FORMAT = "ckstore/dcp-metadata"
VERSION = 1

_LAYOUTS: dict[str, torch.layout] = {
    n: getattr(torch, n)
    for n in (
        "strided",
        "sparse_coo",
        "sparse_csr",
        "sparse_csc",
        "sparse_bsr",
        "sparse_bsc",
        "_mkldnn",
    )
    if isinstance(getattr(torch, n, None), torch.layout)
}
_MEMORY_FORMATS: dict[str, torch.memory_format] = {
    "contiguous_format": torch.contiguous_format,
    "channels_last": torch.channels_last,
    "channels_last_3d": torch.channels_last_3d,
    "preserve_format": torch.preserve_format,
}


def metadata_to_json(metadata: Metadata) -> dict[str, Any]:
    """DCP's Metadata as JSON-able data (no pickle).

    ``{"format": "ckstore/dcp-metadata", "version": 1, "dcp_version": ..., "state_dict_metadata":
    {fqn: {"type": "tensor", "dtype", "layout", "requires_grad", "memory_format", "pin_memory",
    "size", "chunks": [[offsets, sizes], ...]} | {"type": "bytes"}}, "storage_data": [[{"fqn",
    "offset", "index"}, data], ...], "planner_data": <ckstore value encoding>, "storage_meta":
    {...} | null}``. A tensor item's ``data`` is ``{"dtype", "pieces": [[offsets, sizes,
    chunk id, check], ...]}`` (global coordinates; the check, ``objects.raw_check``, since
    manifest version 2); a value item's is ``{"value": <encoding>}``.
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
                "chunks": [
                    [[int(o) for o in c.offsets], [int(s) for s in c.sizes]] for c in md.chunks
                ],
            }
        else:
            raise UnsupportedValueError(
                f"key {fqn!r}: unknown DCP storage metadata {type(md).__name__}"
            )
    storage = [
        [
            {
                "fqn": i.fqn,
                "offset": None if i.offset is None else [int(o) for o in i.offset],
                "index": i.index,
            },
            d,
        ]
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
    meta = (
        None
        if sm is None
        else {
            "checkpoint_id": None if sm.checkpoint_id is None else str(sm.checkpoint_id),
            "save_id": sm.save_id,
            "load_id": sm.load_id,
            "modules": list(sm.modules),
        }
    )
    return {
        "format": FORMAT,
        "version": VERSION,
        "dcp_version": metadata.version,
        "state_dict_metadata": sdm,
        "storage_data": storage,
        "planner_data": planner,
        "storage_meta": meta,
    }


def metadata_from_json(doc: Any, where: str = "DCP metadata") -> Metadata:
    """Inverse of :func:`metadata_to_json`; anything malformed raises CorruptionError."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CorruptionError(
            f"{where} is not ckstore DCP metadata (was the snapshot written by dcp.save?)"
        )
    if doc.get("version") != VERSION:
        raise CorruptionError(
            f"{where} has version {doc.get('version')!r}; this ckstore reads {VERSION}"
        )
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
            chunks = [
                ChunkStorageMetadata(torch.Size(ints(o)), torch.Size(ints(s)))
                for o, s in d["chunks"]
            ]
            sdm[fqn] = TensorStorageMetadata(props, torch.Size(ints(d["size"])), chunks)
        storage = {}
        for idx, data in doc["storage_data"]:
            offset = None if idx["offset"] is None else ints(idx["offset"])
            storage[MetadataIndex(str(idx["fqn"]), offset, idx.get("index"))] = data
        sm = doc.get("storage_meta")
        meta = (
            None
            if sm is None
            else StorageMeta(
                checkpoint_id=sm.get("checkpoint_id"),
                save_id=sm.get("save_id"),
                load_id=sm.get("load_id"),
                modules=[str(m) for m in sm.get("modules") or []],
            )
        )
        return Metadata(
            state_dict_metadata=sdm,
            planner_data=decode_value(doc.get("planner_data")),
            storage_data=storage,
            storage_meta=meta,
            version=doc.get("dcp_version"),
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


def ints(v: Any) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(type(x) is int for x in v):
        raise ValueError(f"expected a list of ints, got {str(v)[:60]}")
    return tuple(v)
