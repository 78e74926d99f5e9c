"""Reading one snapshot's tensors: a :class:`Reader` over its manifest, every chunk verified.

The restore's phases (``phases.py``), random access (``read.py``), exports and the DCP reader
all read through a Reader; its chunk passes are the :class:`~ckstore.engine.restore.fetch.Fetcher`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ... import objects
from ...errors import MismatchError
from ...format.dtypes import dtype_from_name
from ...format.manifest import Entry, Manifest, PerRankEntry, TensorEntry, ValueEntry
from ...format.tensors import from_bytes
from ..devices import host_empty
from ..progress import ProgressFn
from .fetch import Fetcher
from .jobs import Job, Region, direct_view, plan_jobs, slices
from .sources import Healer

if TYPE_CHECKING:
    from ..interfaces import LocationIndex
    from ..view import SnapshotView


@dataclass
class Reader:
    """Reads tensor entries of one manifest from the object store, verifying every chunk
    (against its check, or its id: see ``verify``).

    ``rank`` is the caller's rank in a distributed restore: it picks each per-rank entry's own
    value (a process that is not distributed counts as rank 0).
    """

    objs: objects.ObjectStore
    index: LocationIndex
    manifest: Manifest
    where: str
    threads: int = 2
    rank: int | None = None
    progress: ProgressFn | None = None
    """Told the bytes each pass over the chunks has done (``"verify"``, ``"restore"``, ``"read"``)."""
    verify: str = "fast"
    """``"fast"``: each chunk's decoded bytes are verified against its check from the manifest
    (its id where it has none); ``"full"``: against its id (BLAKE3), as at a trust boundary."""
    heal: Healer | None = None
    """Heals a chunk that failed its check or whose pack is gone (:data:`~.fetch.Healer`: the
    fetcher uses the verified bytes it hands back, or reads the chunk again at its new place);
    None: such a chunk raises at once."""

    @classmethod
    def of(cls, view: SnapshotView, **kw: Any) -> Reader:
        """A reader of ``view``'s chunks on its repository's threads, with its progress and
        healer (``kw``: other fields, e.g. ``rank``)."""
        repo = view.repo
        fields = {"threads": repo.threads, "progress": view.progress, "heal": view.heal, **kw}
        return cls(repo.objects, repo.reads, view.manifest, f"snapshot {view.ref}", **fields)

    def entry(self, key: str) -> Entry:
        """The entry of ``key`` for this reader's rank (per-rank entries resolved)."""
        entry = self.manifest.entries[key]
        if isinstance(entry, PerRankEntry):
            rank = self.rank or 0
            if rank >= entry.world_size:
                raise MismatchError(
                    f"{self.where}: key {key!r} was stored per rank by a take with "
                    f"{entry.world_size} rank(s) (its value differed between ranks); rank {rank} "
                    "has no value to restore. Restore with at most that many ranks, or pass "
                    "strict=False to leave such values as they are on the extra ranks"
                )
            return entry.entries[rank]
        return entry

    def is_tensor(self, key: str) -> bool:
        return isinstance(self.entry(key), TensorEntry)

    def has_value(self, key: str) -> bool:
        """False for a per-rank entry stored by fewer ranks than this reader's rank."""
        entry = self.manifest.entries[key]
        return not isinstance(entry, PerRankEntry) or (self.rank or 0) < entry.world_size

    def fetcher(self) -> Fetcher:
        return Fetcher(
            self.objs,
            self.index,
            self.where,
            self.threads,
            self.progress,
            self.verify,
            heal=self.heal,
        )

    def read_tensors(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """Return a new CPU tensor per key, each chunk checked (its fast check, or its id)."""
        return self.read_regions({k: None for k in keys})

    def read_regions(self, wanted: Mapping[str, Region | None]) -> dict[str, torch.Tensor]:
        """Return, per key, a new CPU tensor holding the region asked for (None: all of it).

        Only chunks overlapping a region are fetched. A chunk lying wholly inside its region
        and contiguous there is decoded straight into place; any other (a chunk cut by the
        region, or a shard piece that is not contiguous in C order) is decoded into a
        host buffer and its overlap copied in.
        """
        out: dict[str, torch.Tensor] = {}
        targets: dict[str, tuple[torch.Tensor, Region | None]] = {}
        for key, region in wanted.items():
            entry = self.entry(key)
            assert isinstance(entry, TensorEntry)
            sizes = region[1] if region is not None else entry.shape
            out[key] = host_empty(sizes, dtype_from_name(entry.dtype))
            targets[key] = (out[key], region)
        self.read_into(targets)
        return out

    def read_into(self, targets: Mapping[str, tuple[torch.Tensor, Region | None]]) -> None:
        """Decode each key's region (None: all of it) into the given tensor, verifying chunks.

        The tensor must have the region's shape and the entry's dtype; it may live on any
        device and have any strides (contiguous CPU tensors are decoded into directly).
        """
        self.copy_inline(targets)
        with self.fetcher() as fetcher:
            fetcher.load(self.jobs(targets))

    def jobs(self, targets: Mapping[str, tuple[torch.Tensor, Region | None]]) -> list[Job]:
        """The chunk jobs filling each target (inline entries need none: :meth:`copy_inline`)."""
        jobs: list[Job] = []
        for key, (t, region) in targets.items():
            entry = self.entry(key)
            assert isinstance(entry, TensorEntry)
            if t.numel() == 0 or entry.inline:
                continue
            offs, sizes = region if region is not None else ((0,) * len(entry.shape), entry.shape)
            jobs.extend(plan_jobs(key, entry, t, offs, sizes))
        return jobs

    def copy_inline(self, targets: Mapping[str, tuple[torch.Tensor, Region | None]]) -> None:
        """Copy the targets of inline entries (stored inside the manifest) into place."""
        for key, (t, region) in targets.items():
            entry = self.entry(key)
            assert isinstance(entry, TensorEntry)
            if t.numel() == 0 or not entry.inline:
                continue
            data = entry.data or b""
            if region is None and t.dtype == dtype_from_name(entry.dtype):
                view = direct_view(t)
                if view is not None and len(view) == len(data):
                    view[:] = data  # no tensor made for it (a few per layer: a resume's fixed cost)
                    continue
            offs, sizes = region if region is not None else ((0,) * len(entry.shape), entry.shape)
            with torch.no_grad():
                t.copy_(
                    from_bytes(data, entry.dtype, entry.shape)[
                        slices(offs, (0,) * len(offs), sizes)  # the whole tensor is inline
                    ]
                )

    def value_of(self, key: str, tensors: Mapping[str, torch.Tensor]) -> Any:
        entry = self.entry(key)
        if isinstance(entry, ValueEntry):
            return entry.value
        t = tensors[key]
        return t.numpy() if entry.container == "numpy" else t  # type: ignore[union-attr]


def check_destination(
    dest: torch.Tensor,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    key: str,
    where: str,
    *,
    cast_hint: bool = False,
) -> None:
    """Refuse a destination tensor of another dtype or shape than the stored ``key``;
    ``cast_hint``: say that ``restore(cast=True)`` converts floating-point dtypes."""
    if dest.dtype != dtype or tuple(dest.shape) != shape:
        cast = (
            "pass cast=True to convert it (a bfloat16 model from a float32 snapshot), "
            if cast_hint and tuple(dest.shape) == shape and dest.is_floating_point()
            and dtype.is_floating_point
            else ""
        )  # fmt: skip
        raise MismatchError(
            f"{where}: key {key!r} is {dtype} {list(shape)} in the snapshot but "
            f"{dest.dtype} {list(dest.shape)} in the destination; {cast}build the destination "
            "with the same shapes/dtypes, or read it with read_object() and convert"
        )
    refuse_overlapping(dest, key, where)


def refuse_overlapping(dest: torch.Tensor, key: str, where: str) -> None:
    """Refuse a destination whose elements share memory (an ``expand``-ed view, an
    ``as_strided`` one), which cannot hold distinct values: found before anything is written,
    not by ``copy_`` after other keys were (or never: ``copy_`` writes overlapping views with
    no error). A meta or empty destination is never written: let it be."""
    if dest.is_meta or dest.numel() <= 1 or not _overlaps(dest):
        return
    raise MismatchError(
        f"{where}: key {key!r}: the destination is a view whose elements share memory (shape "
        f"{list(dest.shape)}, strides {list(dest.stride())}, an expanded or as_strided one), "
        "so it cannot hold the stored values; give it a tensor of its own (e.g. .clone())"
    )


def _overlaps(t: torch.Tensor) -> bool:
    """Whether two elements of strided ``t`` share memory. Fast when, with the dimensions
    sorted by stride, each stride passes the span of the ones below it (every dense layout,
    transposed or sliced); else exact, by listing the elements' offsets."""
    dims = sorted((st, n) for st, n in zip(t.stride(), t.shape) if n > 1)
    span = 0
    for st, n in dims:
        if st <= span:
            break
        span += st * (n - 1)
    else:
        return False
    offsets = torch.zeros((), dtype=torch.int64)
    for st, n in zip(t.stride(), t.shape):
        offsets = offsets.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * st
    return int(offsets.unique().numel()) < t.numel()


def is_dtensor_dest(t: torch.Tensor) -> bool:
    """Whether a destination is a DTensor (or another tensor subclass with local shards)."""
    return type(t) not in (torch.Tensor, torch.nn.Parameter) and callable(
        getattr(t, "to_local", None)
    )
