"""Committed snapshots as objects: :class:`SnapshotFields` (read-only fields from an index
record) and :class:`SnapshotView` (a record bound to its repository and, read on first use,
its manifest). The public snapshot handles build on them."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..format.manifest import Manifest
from ..format.parts import parse_any
from ..index import SnapshotRecord
from . import manifests
from .repository import describe

if TYPE_CHECKING:
    from .progress import ProgressFn
    from .repository import Repository


class SnapshotFields:
    """Read-only fields of a committed snapshot, from its index record (``self.record``)."""

    @property
    def record(self) -> SnapshotRecord:
        raise NotImplementedError

    @property
    def id(self) -> str:
        return self.record.id

    @property
    def run(self) -> str:
        return self.record.run

    @property
    def step(self) -> int | None:
        return self.record.step

    @property
    def parent_id(self) -> str | None:
        return self.record.parent_id

    @property
    def created_at(self) -> float:
        return self.record.created_at

    @property
    def metadata(self) -> dict[str, Any]:
        return dict(self.record.metadata)

    @property
    def name(self) -> str | None:
        return self.record.name

    @property
    def ref(self) -> str:
        """A human ref: ``run@step`` (or the name) plus a short id."""
        return describe(self.record)

    @property
    def healthy(self) -> bool | None:
        """True if its take found no NaN or Inf, no stale tensor and no replicas that disagree
        (what ``run@healthy`` rolls back to), False if it found any of them, None if it
        recorded no NaN/Inf counts (taken before ckstore did, or with ``health=False``) and
        nothing else against it."""
        return self.record.healthy

    @property
    def stats(self) -> dict[str, int]:
        """Logical bytes, new bytes and chunks stored, chunks reused."""
        r = self.record
        return {
            "logical_bytes": r.logical_bytes,
            "new_bytes": r.new_bytes,
            "new_chunks": r.new_chunks,
            "reused_chunks": r.reused_chunks,
        }


@dataclass
class _Read:
    """What a view read of its manifest, shared by the view and its copies (:meth:`SnapshotView.healing_with`)."""

    manifest: Manifest | None = None
    raw: bytes | None = None
    header: dict[str, Any] | None = None


class SnapshotView(SnapshotFields):
    """One committed snapshot of a repository: its record, its manifest (read on first use)."""

    def __init__(
        self, repo: Repository, record: SnapshotRecord, manifest: Manifest | None = None
    ) -> None:
        self.repo = repo
        self._record = record
        self._read = _Read(manifest)
        self.progress: ProgressFn | None = None
        """Given to every reader of it (``Reader.of``: an export's progress)."""
        self.heal: Callable[[str], bool | memoryview] | None = None
        """Given to every reader of it (``Reader.of``): heals a chunk a read finds damaged or
        missing (``engine.restore.fetch.Healer``); None: such a chunk raises. The facade sets
        it on a copy of the view for one call (``_heal_verbs.healing``)."""

    @property
    def record(self) -> SnapshotRecord:
        return self._record

    @property
    def manifest(self) -> Manifest:
        """The whole manifest (one stored in parts is read whole), validated."""
        if self._read.manifest is None:
            self._read.manifest = self.repo.manifest_of(
                self.record.manifest_id,
                lambda: manifests.load(self.repo.objects, self.repo.reads, self.raw(), self.where),
            )
        return self._read.manifest

    @property
    def header(self) -> dict[str, Any]:
        """The manifest's snapshot header; of a manifest stored in parts, only its root is read."""
        if self._read.manifest is None:
            self._read.manifest = self.repo.kept_manifest(self.record.manifest_id)
        if self._read.manifest is not None:
            return self._read.manifest.snapshot or {}
        if self._read.header is None:
            doc = parse_any(self.raw(), self.where)
            if isinstance(doc, Manifest):
                self._read.manifest = doc
            self._read.header = doc.snapshot or {}
        return self._read.header

    @property
    def where(self) -> str:
        return f"manifest of {describe(self.record)}"

    def raw(self) -> bytes:
        """The manifest object's bytes (the root of one stored in parts), read once."""
        if self._read.raw is None:
            self._read.raw = self.repo.objects.get_blob("manifests", self.record.manifest_id)
        return self._read.raw

    def healing_with(self, heal: Callable[[str], bool | memoryview]) -> SnapshotView:
        """This snapshot for one call whose readers heal through ``heal`` (:attr:`heal`); what
        either view reads of the manifest is read once for both."""
        mine = copy.copy(self)
        mine.heal = heal
        return mine
