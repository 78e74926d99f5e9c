"""Committed snapshots as objects: :class:`SnapshotFields` (read-only fields from an index
record) and :class:`SnapshotView` (a record bound to its repository and, read on first use,
its manifest). The public snapshot handles build on them."""

from __future__ import annotations

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


class SnapshotView(SnapshotFields):
    """One committed snapshot of a repository: its record, its manifest (read on first use)."""

    def __init__(
        self, repo: Repository, record: SnapshotRecord, manifest: Manifest | None = None
    ) -> None:
        self.repo = repo
        self._record = record
        self._manifest = manifest
        self._raw: bytes | None = None
        self._header: dict[str, Any] | None = None
        self.progress: ProgressFn | None = None
        """Given to every reader of it (``Reader.of``: an export's progress)."""

    @property
    def record(self) -> SnapshotRecord:
        return self._record

    @property
    def manifest(self) -> Manifest:
        """The whole manifest (one stored in parts is read whole), validated."""
        if self._manifest is None:
            self._manifest = manifests.load(
                self.repo.objects, self.repo.index, self.raw(), self.where
            )
        return self._manifest

    @property
    def header(self) -> dict[str, Any]:
        """The manifest's snapshot header; of a manifest stored in parts, only its root is read."""
        if self._manifest is not None:
            return self._manifest.snapshot or {}
        if self._header is None:
            doc = parse_any(self.raw(), self.where)
            if isinstance(doc, Manifest):
                self._manifest = doc
            self._header = doc.snapshot or {}
        return self._header

    @property
    def where(self) -> str:
        return f"manifest of {describe(self.record)}"

    def raw(self) -> bytes:
        """The manifest object's bytes (the root of one stored in parts), read once."""
        if self._raw is None:
            self._raw = self.repo.objects.get_blob("manifests", self.record.manifest_id)
        return self._raw
