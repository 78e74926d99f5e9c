"""The first phase of a distributed take: what each leaf of this rank's state is.

Every leaf is described as JSON for the planning all_gather: a DTensor shard (its box of the
global tensor), a replicated tensor (a DDP module's, or matching a ``replicated`` glob), a
per-rank tensor, or a plain value. After the gather, every rank checks the same structure and
settles which keys count as replicated (only those every rank marks so), identically.
"""

from __future__ import annotations

import base64
import fnmatch
import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..engine.take.packing import Chunk, TakeOptions
from ..errors import DistributedError, UnsupportedValueError
from ..format.boxes import is_dtensor, local_box
from ..format.dtypes import dtype_name
from ..format.grid import Box
from ..format.layout import Layout
from ..format.tensors import as_cpu_tensor, byte_view
from ..format.tree import flatten, is_array
from ..format.values import encode_value

DTENSOR, REPLICATED, LOCAL, VALUE = "dtensor", "replicated", "per_rank", "value"
log = logging.getLogger("ckstore")


@dataclass
class Leaf:
    kind: str
    desc: dict[str, Any]
    tensor: torch.Tensor | None = (
        None  # CPU data: the local shard of a DTensor, or the whole tensor
    )
    box: Box | None = None  # a DTensor shard's region
    replicas: list[int] = field(
        default_factory=list
    )  # a DTensor: ranks of the take holding the same box
    layout: Layout | None = None  # a DTensor: its mesh and placements, if they give its box


@dataclass
class Local:
    apps: dict[str, Any]
    leaves: dict[str, Leaf]
    chunks: list[tuple[str, Box, Chunk]] = field(default_factory=list)


def ddp_apps(app_state: Mapping[str, Any]) -> dict[str, frozenset[str]]:
    """The app_state entries that are DistributedDataParallel modules (their tensors are
    replicated), each with the manifest keys of its buffers: DDP gives every rank rank 0's
    buffers when a forward pass starts, and the pass then updates each rank's own (a batch
    norm's running statistics), so a buffer may differ between ranks when a take comes."""
    from torch.nn.parallel import DistributedDataParallel

    return {
        name: frozenset(f"{name}/{b}" for b, _ in obj.named_buffers())
        for name, obj in app_state.items()
        if isinstance(obj, DistributedDataParallel)
    }


def classify(
    states: Mapping[str, Any],
    ddp: Collection[str],
    globs: tuple[str, ...],
    opts: TakeOptions,
    members: list[int] | None = None,
) -> Local:
    """Flatten and describe every leaf of this rank's state.

    ``members``: the global ranks of the take, in its rank order (None: every rank); a
    DTensor's ``replicas`` are given as ranks within the take.
    """
    out = Local(apps={}, leaves={})
    layouts = Layouts(members)
    for app, sd in states.items():
        flat = flatten(app, sd)
        out.apps[app] = flat.tree
        for key, value in flat.leaves.items():
            if is_dtensor(value):
                try:
                    box = local_box(value)
                except ValueError as exc:
                    raise UnsupportedValueError(f"key {key!r}: {exc}") from exc
                t = as_cpu_tensor(value.to_local(), key)
                desc = {
                    "t": DTENSOR,
                    "dtype": dtype_name(t.dtype, key),
                    "shape": list(value.shape),
                    "box": [list(box[0]), list(box[1])],
                    "container": "torch",
                    "device": str(value.device),
                }
                out.leaves[key] = Leaf(
                    DTENSOR,
                    desc,
                    t,
                    box,
                    replica_ranks(value, key, members),
                    layouts.of(value, box),
                )
            elif is_array(value):
                container = "torch" if isinstance(value, torch.Tensor) else "numpy"
                device = str(value.device) if isinstance(value, torch.Tensor) else "cpu"
                t = as_cpu_tensor(value, key)
                kind = (
                    REPLICATED
                    if app in ddp or any(fnmatch.fnmatchcase(key, g) for g in globs)
                    else LOCAL
                )
                desc = {
                    "t": kind,
                    "dtype": dtype_name(t.dtype, key),
                    "shape": list(t.shape),
                    "container": container,
                    "device": device,
                }
                if t.numel() * t.element_size() <= opts.inline_bytes:
                    desc["data"] = base64.b64encode(bytes(byte_view(t))).decode()
                out.leaves[key] = Leaf(kind, desc, t)
            else:
                out.leaves[key] = Leaf(VALUE, {"t": VALUE, "value": encode_value(value, key)})
    return out


def replica_ranks(value: Any, key: str, members: list[int] | None) -> list[int]:
    """The ranks of the take holding the same box of DTensor ``value`` as this one: those
    whose mesh coordinates differ only along dimensions it is replicated over.

    Raises:
        UnsupportedValueError: the DTensor's mesh is not exactly the take's ranks.
    """
    mesh = value.device_mesh
    ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
    if members is not None and sorted(ranks) != sorted(members):
        raise UnsupportedValueError(
            f"key {key!r}: a DTensor on a device mesh of ranks {sorted(ranks)[:8]} cannot be taken by "
            f"ranks {sorted(members)[:8]} (the mesh must span exactly the ranks taking part)"
        )
    coord = mesh.get_coordinate()
    index = tuple(
        slice(None) if type(p).__name__ == "Replicate" else c
        for p, c in zip(value.placements, coord)
    )
    same = [int(r) for r in mesh.mesh[index].flatten().tolist()]
    where = members if members is not None else list(range(max(ranks) + 1))
    return sorted(where.index(r) for r in same)


class Layouts:
    """DTensors' layouts (``format/layout.py``) with the take's ranks, one rank table per device
    mesh: the table has a rank per mesh coordinate, so it is built once per take, not per key."""

    def __init__(self, members: list[int] | None) -> None:
        self.members = members
        self._meshes: dict[int, tuple[Any, tuple[int, ...], tuple[int, ...] | None, Any]] = {}

    def of(self, value: Any, box: Box) -> Layout | None:
        """``value``'s layout, if it gives this rank's shard ``box`` (None otherwise: readers
        then look for its pieces in every part)."""
        mesh = value.device_mesh
        known = self._meshes.get(id(mesh))
        if known is None or known[0] is not mesh:
            flat = [int(r) for r in mesh.mesh.flatten().tolist()]
            where = self.members if self.members is not None else range(max(flat) + 1)
            position = {r: i for i, r in enumerate(where)}
            table = tuple(position[r] for r in flat)
            identity = table == tuple(range(len(table)))
            dims = tuple(int(n) for n in mesh.mesh.shape)
            known = (mesh, dims, None if identity else table, mesh.get_coordinate())
            self._meshes[id(mesh)] = known
        _, shape, ranks, coord = known
        placements = tuple(
            int(p.dim) if type(p).__name__ == "Shard" else None for p in value.placements
        )
        layout = Layout(shape, placements, ranks)
        if coord is None or layout.box(tuple(value.shape), coord) != box:
            return None
        return layout


def demote_mixed(descs: list[dict[str, Any]]) -> list[str]:
    """Keys some ranks mark replicated and others not, now marked per rank in ``descs``.

    A tensor counts as replicated only if every rank says so (its globs or DDP), as in
    TorchSnapshot. Deterministic: every rank decides the same from the same descriptions.
    """
    if any(not d.get("leaves") for d in descs):
        return []
    demoted = []
    for key in descs[0]["leaves"]:
        ds = [d["leaves"].get(key) for d in descs]
        kinds = {x["t"] for x in ds if x is not None}
        if kinds == {REPLICATED, LOCAL}:
            demoted.append(key)
            for x in ds:
                if x is not None:
                    x["t"] = LOCAL
    return demoted


def coalesce_replicated(demoted: tuple[str, ...] | list[str], local: Local, rank: int) -> None:
    """Apply the demoted keys (see :func:`demote_mixed`) to this rank's leaves: they are kept
    per rank (stored once if equal everywhere), and logged once, by rank 0."""
    for key in demoted:
        if key in local.leaves:
            local.leaves[key].kind = LOCAL
            local.leaves[key].desc["t"] = LOCAL
    if demoted and rank == 0:
        log.warning(
            "distributed take: %d key(s) are marked replicated on some ranks only (different "
            "replicated= globs); stored per rank instead: %s",
            len(demoted),
            list(demoted)[:10],
        )


def check_same_structure(descs: list[dict[str, Any]]) -> list[str]:
    """Every rank must hold the same keys in the same containers; returns rank 0's key order."""
    keys = list(descs[0]["leaves"])
    bad = [r for r, d in enumerate(descs) if d["tree"] != descs[0]["tree"]]
    if bad:
        ref = set(keys)
        detail = []
        for r in bad:
            theirs = set(descs[r]["leaves"])
            extra, lacking = sorted(theirs - ref)[:3], sorted(ref - theirs)[:3]
            detail.append(
                f"rank {r}: extra keys {extra}, lacking {lacking}"
                if extra or lacking
                else f"rank {r}: containers differ"
            )
        raise DistributedError(
            f"distributed take: rank(s) {bad} hold a differently shaped state than rank 0 ({'; '.join(detail)}); "
            "every rank must pass app_state with the same keys",
            ranks=bad,
            causes=dict(zip(bad, detail)),
        )
    for key in keys:
        ds = [d["leaves"][key] for d in descs]
        kinds = {x["t"] for x in ds}
        if (DTENSOR in kinds or REPLICATED in kinds) and len(kinds) > 1:
            raise DistributedError(
                f"distributed take: key {key!r} is {sorted(kinds)} on different ranks"
            )
        if kinds & {DTENSOR, REPLICATED}:
            metas = {(x["dtype"], tuple(x["shape"])) for x in ds}
            if len(metas) > 1:
                raise DistributedError(
                    f"distributed take: key {key!r} has different dtype/shape on different ranks: {sorted(metas)}"
                )
    return keys
