"""Snapshot handles, including the TorchSnapshot-compatible ``Snapshot(path=...)`` surface.

Two flavours of the same handle, told apart by :attr:`Snapshot.ranked_paths`:

* **TorchSnapshot flavour** (``ranked_paths`` True): made by ``Snapshot(path=...)``,
  ``Snapshot.take(path=...)`` or ``Snapshot.async_take(path=...)``. ``read_object`` and
  ``get_manifest`` use TorchSnapshot's logical paths ``<rank>/<key>`` (``0/model/weight``;
  see :mod:`ckstore.engine.logical`).
* **ckstore flavour** (``ranked_paths`` False): made by ``store.take``, ``store.get`` and
  ``store.log``. ``read_object`` and ``get_manifest`` use plain keys (``model/weight``).

``snap.with_ranked_paths(flag)`` gives the same snapshot in the other flavour. Everything else
(restore, stats, refs) is the same in both.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from . import _takes
from ._locate import locate, locate_all_ranks, resolve
from .distributed import is_distributed
from .engine.logical import ranked_manifest, split_rank
from .engine.repository import Repository, SnapshotView
from .errors import InvalidInputError
from .format.limits import check_int, check_number
from .format.manifest import Entry, Manifest
from .index import SnapshotRecord

if TYPE_CHECKING:
    from .interop import ExportReport


class Snapshot(SnapshotView):
    """One committed snapshot: restore it, read single objects, inspect its manifest.

    Obtain one from ``store.take`` / ``store.get``, or TorchSnapshot-style with
    ``Snapshot(path=...)`` / ``Snapshot.take(path=..., app_state=...)``. A path inside an
    existing local store (a parent directory holding ``ckstore.json``) names a snapshot of that
    store, so siblings dedup against each other; any other path becomes a store of its own.
    ``fs://`` paths (TorchSnapshot's file-system prefix) are local paths.

    ``Snapshot(path)`` is lazy, as in TorchSnapshot: nothing is opened until the snapshot is
    first used (then a missing one raises SnapshotNotFoundError), so a handle made before the
    take at ``path`` works once it is taken. ``pg`` is the process group used by
    :meth:`restore` (default: every rank).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        pg: Any = None,
        storage_options: dict[str, Any] | None = None,
        *,
        index: str | None = None,
    ) -> None:
        self.path = os.fspath(path)
        self.pg = pg
        self.ranked_paths = True
        self._where: tuple[str, dict[str, Any] | None, str | None] | None = (self.path, storage_options, index)
        self._store: Repository | None = None
        self._record: SnapshotRecord | None = None
        self._manifest = None

    @classmethod
    def _bind(
        cls,
        store: Repository,
        record: SnapshotRecord,
        manifest: Manifest | None = None,
        *,
        path: str | None = None,
        pg: Any = None,
        ranked_paths: bool = False,
    ) -> Snapshot:
        """A handle on a committed record (what ``Store.take`` / ``Store.get`` return)."""
        snap = cls.__new__(cls)
        snap._where = None
        SnapshotView.__init__(snap, store, record, manifest)
        snap.path = path if path is not None else store.url
        snap.pg = pg
        snap.ranked_paths = ranked_paths
        return snap

    # --- lazy resolution ------------------------------------------------------------------
    @property
    def store(self) -> Repository:
        self._resolve()
        assert self._store is not None
        return self._store

    @store.setter
    def store(self, value: Repository) -> None:
        self._store = value

    @property
    def record(self) -> SnapshotRecord:
        self._resolve()
        assert self._record is not None
        return self._record

    @record.setter
    def record(self, value: SnapshotRecord) -> None:
        self._record = value

    def _resolve(self) -> None:
        if self._record is not None or self._where is None:
            return
        path, storage_options, index = self._where
        repo, name = locate(path, storage_options, index, create=False)
        try:
            self._record = resolve(repo, name)
        except BaseException:
            repo.close()
            raise
        self._store = repo

    def with_ranked_paths(self, ranked: bool = True) -> Snapshot:
        """This snapshot in the TorchSnapshot flavour (``<rank>/<key>``) or the plain one."""
        other = copy.copy(self)
        other.ranked_paths = ranked
        return other

    # --- TorchSnapshot-compatible constructors --------------------------------------------
    @classmethod
    def take(
        cls,
        path: str | os.PathLike[str],
        app_state: Mapping[str, Any],
        pg: Any = None,
        replicated: Any = None,
        storage_options: dict[str, Any] | None = None,
        *,
        index: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        dist_timeout: float | None = None,
    ) -> Snapshot:
        """Take a snapshot of ``app_state`` at ``path`` (see the class docstring).

        Distributed: call on every rank of ``pg`` (default: every rank); ranks outside it are
        free to do anything else meanwhile. ``replicated`` (key globs, e.g. ``["optim/**"]``)
        marks plain tensors that are the same on every rank: written once, the work spread
        over the ranks; DDP modules are replicated without it. ``dist_timeout`` as in
        :meth:`Store.take`.

        Raises:
            UnsupportedValueError: an app_state value has no ``state_dict()`` (a TypeError).
        """
        from .engine.stateful import check_app_state

        check_app_state(app_state)
        repo, name = locate_all_ranks(os.fspath(path), storage_options, index, pg, dist_timeout)
        args = _takes.TakeArgs.of("default", None, (), metadata, name, replicated or ())
        record, manifest = _takes.take(repo, app_state, args, pg, dist_timeout)
        return cls._bind(repo, record, manifest, path=os.fspath(path), pg=pg, ranked_paths=True)

    @classmethod
    def async_take(
        cls,
        path: str | os.PathLike[str],
        app_state: Mapping[str, Any],
        pg: Any = None,
        replicated: Any = None,
        storage_options: dict[str, Any] | None = None,
        *,
        index: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        dist_timeout: float | None = None,
    ) -> PendingSnapshot:
        """Like :meth:`take` (same ``pg`` and ``replicated``), returning once the state is staged."""
        from .engine.stateful import check_app_state

        check_app_state(app_state)
        repo, name = locate_all_ranks(os.fspath(path), storage_options, index, pg, dist_timeout)
        args = _takes.TakeArgs.of("default", None, (), metadata, name, replicated or ())
        job = _takes.async_take(repo, app_state, args, pg, dist_timeout, None)
        return PendingSnapshot.of(repo, job, path=os.fspath(path), pg=pg, ranked_paths=True)

    # --- reading ---------------------------------------------------------------------------
    def restore(
        self,
        app_state: Mapping[str, Any],
        strict: bool = True,
        *,
        memory_budget: int | None = None,
        pg: Any = None,
        dist_timeout: float | None = None,
        replicated_read: str | None = None,
        atomic: bool = True,
    ) -> None:
        """Load this snapshot into ``app_state`` in place.

        Validates keys, dtypes and shapes, then reads and verifies every chunk, and only then
        writes into the caller's tensors and calls ``load_state_dict``: on any error the
        app_state is left untouched. Verified chunks are staged up to ``memory_budget`` bytes
        (default: ``$CKSTORE_MEMORY_BUDGET``, else 3% of what is restored, at most 512 MiB)
        and copied into place; the others are read again, checked against a fingerprint of
        the payload verified in the first pass, and decoded straight into place, so memory
        above the live state stays near the budget. CUDA destinations are filled through
        pinned host buffers, counted in the budget.

        ``atomic=False`` gives up that guarantee for speed: every tensor is decoded straight
        into place in one pass (chunks are still re-hashed, and a damaged one still raises
        CorruptionError naming the key, but the destination is then partly loaded) and
        nothing is staged. Use it to load into a freshly built model at start-up, where a
        failed restore ends the process anyway.

        With ``torch.distributed`` initialised, call it on every rank: each rank reads only
        the part its destination needs (its DTensor shard, whatever the world size and
        placement at take time; whole plain tensors; its own rank's per-rank values), and
        either every rank loads or every rank raises DistributedError. ``pg`` (default: the
        ``pg`` this handle was opened with, else every rank) limits the restore to a group's
        members; ranks are then ranks within ``pg``.
        With ``strict=False``, a rank that has no stored value for a per-rank entry (the take
        had fewer ranks, e.g. 2 -> 3) keeps its destination as it is and logs the skipped keys
        (logger ``"ckstore"``); an app with nothing left to load (an :class:`RNGState` on such
        a rank) is not loaded at all. ``RNGState`` entries are loaded after every other one.
        A snapshot written by ``dcp.save`` is restored by mapping each app's state dict onto
        DCP's keys (see :mod:`ckstore.engine.dcp_keys`).
        ``replicated_read`` (default ``$CKSTORE_REPLICATED_READ`` or ``"each"``) picks how
        entries that every rank needs whole as plain tensors (DDP-style replicas) are read:
        ``"each"``, every rank reads them; ``"broadcast"``, rank 0 reads and verifies them and
        broadcasts them to the other ranks, which read none of their chunks (the broadcast
        tensors are staged, so they count against ``memory_budget``).

        Raises:
            UnsupportedValueError: an app_state value is not stateful (also a TypeError).
            MismatchError: keys, dtypes or shapes differ (named in the message).
            CorruptionError: stored bytes are damaged (the key is named).
            DistributedError: a rank failed (distributed restore; names ranks and causes);
                RankLostError when a rank never answered within ``dist_timeout``.
        """
        from .distributed._restore import replicated_mode
        from .engine.restore import check_app_state

        check_app_state(app_state, restoring=True)
        mode = replicated_mode(replicated_read)
        if memory_budget is not None:
            check_int("memory_budget", memory_budget)
        if dist_timeout is not None:
            check_number("dist_timeout", dist_timeout, lo_open=True)
        budget = self.store.memory_budget if memory_budget is None else memory_budget
        from .engine.dcp_keys import dcp_overlay, is_dcp_manifest
        from .engine.restore import restore

        reader = self.reader()
        if is_dcp_manifest(reader.manifest):
            reader = replace(reader, manifest=dcp_overlay(reader.manifest, app_state, strict))
        if is_distributed():
            from .distributed._restore import restore as dist_restore

            dist_restore(
                reader,
                app_state,
                strict=strict,
                pg=pg if pg is not None else self.pg,
                timeout=dist_timeout,
                budget=budget,
                replicated_read=mode,
                atomic=atomic,
            )
            return
        restore(reader, app_state, strict=strict, budget=budget, atomic=atomic)

    def read_object(
        self, path: str, obj_out: Any = None, memory_budget_bytes: int | None = None
    ) -> Any:
        """Read one entry (or a subtree such as ``"optim"``) without reading anything else.

        ``path`` is a logical path of :meth:`get_manifest`: ``"0/model/weight"`` in the
        TorchSnapshot flavour (rank ``r``'s value of a per-rank entry for ``"r/..."``), a
        plain key ``"model/weight"`` in the ckstore flavour (a per-rank entry comes back as a
        list with one value per rank). A tensor comes back as a new CPU tensor, or is copied
        into ``obj_out`` if given (and returned).

        Raises:
            KeyNotFoundError: no such path (the message suggests near matches).
        """
        from .engine.read import read_object

        reader = self.reader()
        if self.ranked_paths:
            rank, path = split_rank(path, f"snapshot {self.ref}")
            reader = replace(reader, rank=rank)
        return read_object(reader, path, obj_out)

    def export(
        self,
        path: str | os.PathLike[str],
        format: str = "safetensors",  # noqa: A002 - the option users type
        *,
        keys: Sequence[str] | str | None = None,
        force: bool = False,
        shard_bytes: int | None = None,
        memory_budget: int | None = None,
    ) -> ExportReport:
        """Write this snapshot to directory ``path`` in another checkpoint format.

        ``format``:

        - ``"safetensors"`` (or ``"hf"``): the Hugging Face layout: shards of at most
          ``shard_bytes`` (default 5 GB, as ``save_pretrained``) named ``model.safetensors``
          or ``model-00001-of-0000N.safetensors``, ``model.safetensors.index.json``, each
          shard's ``__metadata__`` naming the snapshot (``ckstore.snapshot``, ``ckstore.run``,
          ``ckstore.step``), and the files an import kept (``config.json``...) written back.
          Tensor names are the keys relative to their app when one app is exported
          (``model/encoder.weight`` -> ``encoder.weight``), else the whole key with '.' for
          '/'. Plain values are left out (listed in ``skipped_values``).
        - ``"torch"``: one ``torch.save`` file of ``{app: state_dict}`` (the flat dict itself
          for a snapshot imported from one), loadable with ``weights_only=True``.
        - ``"dcp"``: a ``torch.distributed.checkpoint`` directory written by DCP's own
          FileSystemWriter, which ``dcp.load`` reads at any world size; tensors imported from
          DCP keep their original shards.

        ``keys``: glob(s) of keys to export, e.g. ``"model/**"`` (a key also matches when a
        path above it does, so ``"model"`` works too). Every chunk is verified as it is read,
        tensors are read in pieces of about ``memory_budget`` bytes (default: the store's
        restore budget), and the directory appears only once complete. A non-empty ``path``
        is refused unless ``force=True`` (then it is replaced).

        Raises:
            DestinationExistsError: ``path`` is not empty and ``force`` is False.
            UnsupportedValueError: a key cannot go to the format (a dtype safetensors lacks,
                a per-rank value); the message says which and what to do.
            CorruptionError: stored bytes are damaged; nothing is published.
        """
        from .interop import DEFAULT_SHARD_BYTES, export_snapshot

        globs = [keys] if isinstance(keys, str) else keys
        return export_snapshot(
            self, path, format=format, keys=globs, force=force,
            shard_bytes=DEFAULT_SHARD_BYTES if shard_bytes is None else shard_bytes,
            memory_budget=memory_budget,
        )  # fmt: skip

    def get_manifest(self) -> dict[str, Entry]:
        """Every leaf's logical path -> its entry (``kind``, ``dtype``, ``shape``, ``nbytes``).

        TorchSnapshot flavour: ``<rank>/<key>`` paths (shared entries under ``0/``, per-rank
        ones under each rank); ckstore flavour: plain keys, a per-rank entry as one entry of
        kind ``"per_rank"``.
        """
        if self.ranked_paths:
            return ranked_manifest(self.manifest)
        return dict(self.manifest.entries)

    def get_state_dict_for_key(self, key: str, replicate_from_rank0: bool = False) -> Any:
        """The state dict stored for app_state name ``key``, without loading it anywhere.

        Under torch.distributed each rank gets its own per-rank values (rank within this
        handle's ``pg``); with ``replicate_from_rank0`` every rank gets rank 0's. A rank beyond
        the take's world size gets the shared values only (per-rank ones are left out). Reads
        only ``key``'s entries; no collective.

        Raises:
            KeyNotFoundError: the snapshot has no app_state name ``key``.
        """
        rank = 0
        if not replicate_from_rank0 and is_distributed():
            import torch.distributed as dist

            rank = dist.get_rank(self.pg) if self.pg is not None else dist.get_rank()
            if rank < 0:
                raise InvalidInputError("this rank is not a member of the snapshot handle's pg")
        from .engine.read import read_state

        return read_state(replace(self.reader(), rank=rank), key)

    def __repr__(self) -> str:
        if self._record is None and self._where is not None:
            return f"Snapshot(path={self.path!r}, not opened yet)"
        return f"Snapshot({self.ref}, store={self.store.url!r})"


class PendingSnapshot:
    """A take running in the background (TorchSnapshot's ``PendingSnapshot``).

    ``staged_bytes``: tensor bytes copied to finish in the background; ``sync_bytes``: bytes
    past the staging budget, stored before ``async_take`` returned.
    """

    def __init__(
        self, future: Future[Snapshot], staged_bytes: int = 0, sync_bytes: int = 0
    ) -> None:
        self._future = future
        self.staged_bytes = staged_bytes
        self.sync_bytes = sync_bytes

    @classmethod
    def of(
        cls, repo: Repository, job: _takes.Background, *, path: str | None = None, pg: Any = None, ranked_paths: bool = False
    ) -> PendingSnapshot:
        """Wrap a background take: its result becomes a Snapshot of ``repo``."""
        future: Future[Snapshot] = Future()

        def bind(done: Future[_takes.Committed]) -> None:
            exc = done.exception()
            if exc is not None:
                future.set_exception(exc)
            else:
                record, manifest = done.result()
                future.set_result(Snapshot._bind(repo, record, manifest, path=path, pg=pg, ranked_paths=ranked_paths))

        job.future.add_done_callback(bind)
        return cls(future, staged_bytes=job.staged_bytes, sync_bytes=job.sync_bytes)

    def done(self) -> bool:
        """True once the snapshot committed or failed."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> Snapshot:
        """Block until committed; return the Snapshot or raise the take's error."""
        return self._future.result(timeout)
