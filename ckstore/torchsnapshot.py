"""TorchSnapshot's surface over ckstore: ``Snapshot(path)``, ``Snapshot.take``, ``async_take``.

A thin adapter: everything but three things is the plain :class:`~ckstore.snapshot.StoredSnapshot`.

* **Paths locate snapshots.** A path inside an existing local store (a parent directory
  holding ``ckstore.json``) names a snapshot of that store, so siblings dedup against each
  other; any other path becomes a store of its own. ``fs://`` paths (TorchSnapshot's
  file-system prefix) are local paths. ``Snapshot(path)`` is lazy, as in TorchSnapshot:
  nothing is opened until the snapshot is first used (then a missing one raises
  SnapshotNotFoundError), so a handle made before the take at ``path`` works once it is taken.
* **Logical paths are ``<rank>/<key>``** (``0/model/weight``) in :meth:`Snapshot.read_object`
  and :meth:`Snapshot.get_manifest` (see :mod:`ckstore.engine.restore.logical`).
* **``pg``** is the process group the handle restores with by default.

This module also gathers what TorchSnapshot users import, so ``from ckstore.torchsnapshot
import Snapshot, StateDict, RNGState`` replaces ``from torchsnapshot import ...``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Unpack

from . import _takes
from ._heal_verbs import healing
from ._locate import locate, locate_all_ranks, resolve
from .engine.repository import Repository
from .engine.restore.logical import ranked_manifest, split_rank
from .engine.stateful import RNGState, StateDict, Stateful, check_app_state
from .engine.take.spec import PathTakeOptions, TakeSpec
from .engine.view import SnapshotView
from .errors import AppNotFoundError, KeyNotFoundError
from .format.manifest import Entry, Manifest
from .index import SnapshotRecord
from .pending import PendingSnapshot
from .snapshot import StoredSnapshot

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["PendingSnapshot", "RNGState", "Snapshot", "StateDict", "Stateful"]


class Snapshot(StoredSnapshot):
    """A snapshot named by a path, TorchSnapshot style (see the module docstring).

    Args:
        path: where the snapshot is (a directory inside a store, a store, or a URL).
        pg: the process group :meth:`restore` uses (default: every rank).
        storage_options: fsspec options for a remote store.
        index: SQLAlchemy URL of the index (remote stores).
    """

    ranked_paths = True

    def __init__(
        self,
        path: str | os.PathLike[str],
        pg: ProcessGroup | None = None,
        storage_options: dict[str, Any] | None = None,
        *,
        index: str | None = None,
    ) -> None:
        self._bound_view = None  # resolved from the path on first use
        self._path = os.fspath(path)
        self.pg = pg
        self._where = (storage_options, index)

    @classmethod
    def of(cls, snap: StoredSnapshot | SnapshotView, pg: ProcessGroup | None = None) -> Snapshot:
        """The same snapshot with TorchSnapshot's ``<rank>/<key>`` paths (its path: the store's URL)."""
        view = snap if isinstance(snap, SnapshotView) else snap._view()
        return cls(view.repo.url, pg)._bind(view)

    def _bind(self, view: SnapshotView) -> Snapshot:
        """Resolve this handle to ``view`` (what a take at its path just committed)."""
        self._bound_view = view
        return self

    def _view(self) -> SnapshotView:
        if self._bound_view is None:
            storage_options, index = self._where
            repo, name = locate(self._path, storage_options, index, create=False)
            try:
                self._bound_view = SnapshotView(repo, resolve(repo, name))
            except BaseException:
                repo.close()
                raise
        return self._bound_view

    @property
    def path(self) -> str:
        """The path this handle was made with."""
        return self._path

    def with_ranked_paths(self, ranked: bool = True) -> StoredSnapshot:
        """This snapshot with ``<rank>/<key>`` paths (itself), or with plain keys."""
        return self if ranked else StoredSnapshot(self._view())

    # --- TorchSnapshot's constructors -----------------------------------------------------
    @classmethod
    @_takes.shows(PathTakeOptions)
    def take(
        cls,
        path: str | os.PathLike[str],
        app_state: Mapping[str, Any],
        pg: ProcessGroup | None = None,
        replicated: Any = None,
        storage_options: dict[str, Any] | None = None,
        *,
        index: str | None = None,
        **options: Unpack[PathTakeOptions],
    ) -> Snapshot:
        """Take a snapshot of ``app_state`` at ``path`` (see the module docstring).

        Distributed: call on every rank of ``pg`` (default: every rank); ranks outside it are
        free to do anything else meanwhile. ``replicated`` (key globs, e.g. ``["optim/**"]``)
        marks plain tensors that are the same on every rank: written once, the work spread
        over the ranks; DDP modules are replicated without it. ``metadata``,
        ``dist_timeout``, ``on_divergence``, ``on_nonfinite`` and ``on_stale`` as in
        :meth:`ckstore.Store.take`
        (a path's snapshot has no step, so staleness is never checked here).

        Raises:
            UnsupportedValueError: an app_state value has no ``state_dict()`` (a TypeError).
            NonFiniteError: ``on_nonfinite="raise"`` and a tensor holds NaN or Inf.
        """
        repo, spec = _prepare(path, app_state, pg, replicated, storage_options, index, options)
        record, manifest = _takes.take(repo, app_state, spec, pg)
        return cls(path, pg, storage_options, index=index)._bind(
            SnapshotView(repo, record, manifest)
        )

    @classmethod
    @_takes.shows(PathTakeOptions)
    def async_take(
        cls,
        path: str | os.PathLike[str],
        app_state: Mapping[str, Any],
        pg: ProcessGroup | None = None,
        replicated: Any = None,
        storage_options: dict[str, Any] | None = None,
        *,
        index: str | None = None,
        **options: Unpack[PathTakeOptions],
    ) -> PendingSnapshot:
        """Like :meth:`take` (same ``pg``, ``replicated`` and options), returning once the
        state is staged."""
        repo, spec = _prepare(path, app_state, pg, replicated, storage_options, index, options)
        job = _takes.take_async(repo, app_state, spec, pg)

        def handle(record: SnapshotRecord, manifest: Manifest | None) -> Snapshot:
            return cls(path, pg, storage_options, index=index)._bind(
                SnapshotView(repo, record, manifest)
            )

        return PendingSnapshot.of(
            job.future, handle, job.staged_bytes, job.sync_bytes, job.blocking
        )

    # --- TorchSnapshot's logical paths ----------------------------------------------------
    def read_object(
        self, path: str, obj_out: Any = None, memory_budget_bytes: int | None = None
    ) -> Any:
        """Read one entry (or a subtree such as ``"0/optim"``) without reading anything else.

        ``path`` is a logical path of :meth:`get_manifest`, ``"<rank>/<key>"``: rank ``r``'s
        value of a per-rank entry for ``"r/..."``; shared entries serve any rank. A tensor
        comes back as a new CPU tensor, or is copied into ``obj_out`` if given (and returned).
        A damaged chunk a remote holds is healed from it, as :meth:`restore` does.

        Raises:
            KeyNotFoundError: no such path (the message suggests near matches).
            CorruptionError: a chunk read is damaged and no remote holds a sound copy.
        """
        from .engine.restore.read import read_object
        from .engine.restore.reader import Reader

        rank, key = split_rank(path, f"snapshot {self.ref}")
        with healing(self._view()) as view:
            return read_object(Reader.of(view, rank=rank), key, obj_out)

    def get_state_dict_for_key(self, key: str, replicate_from_rank0: bool = False) -> Any:
        """The state dict stored for app_state name ``key`` (see
        :meth:`StoredSnapshot.get_state_dict_for_key`).

        Raises:
            AppNotFoundError: the snapshot has no app_state name ``key``; a KeyNotFoundError
                and, as TorchSnapshot raises, an AssertionError.
        """
        try:
            return super().get_state_dict_for_key(key, replicate_from_rank0)
        except KeyNotFoundError as exc:
            raise AppNotFoundError(str(exc)) from exc

    def get_manifest(self) -> dict[str, Entry]:
        """Every leaf's logical path ``<rank>/<key>`` -> its entry (``kind``, ``dtype``,
        ``shape``, ``nbytes``): shared entries under ``0/``, per-rank ones under each rank."""
        return ranked_manifest(self.manifest)

    def __repr__(self) -> str:
        if self._bound_view is None:
            return f"Snapshot(path={self._path!r}, not opened yet)"
        return super().__repr__()


def _prepare(
    path: str | os.PathLike[str],
    app_state: Mapping[str, Any],
    pg: ProcessGroup | None,
    replicated: Any,
    storage_options: dict[str, Any] | None,
    index: str | None,
    options: PathTakeOptions,
) -> tuple[Repository, TakeSpec]:
    """Check the app_state and the options, then find (or make) the store at ``path`` and
    describe the take."""
    check_app_state(app_state)
    spec = _takes.spec_of(None, PathTakeOptions, options, replicated=replicated)
    repo, name = locate_all_ranks(os.fspath(path), storage_options, index, pg, spec.dist_timeout)
    return repo, spec.evolve(name=name) if name else spec
