"""Snapshot handles, including the TorchSnapshot-compatible ``Snapshot(path=...)`` surface."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from . import _takes
from .dist import is_distributed
from .engine.config import CONFIG_NAME
from .engine.repository import Repository, SnapshotView, is_local, local_path, open_repository
from .errors import DistributedError, SnapshotNotFoundError
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
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        pg: Any = None,
        storage_options: dict[str, Any] | None = None,
        *,
        index: str | None = None,
    ) -> None:
        repo, name = _locate(os.fspath(path), storage_options, index, create=False)
        record = repo.index.resolve(name) if name else _latest(repo)
        super().__init__(repo, record)
        self.path = os.fspath(path)

    @classmethod
    def _bind(
        cls, store: Repository, record: SnapshotRecord, manifest: Manifest | None = None
    ) -> Snapshot:
        """A handle on a committed record (what ``Store.take`` / ``Store.get`` return)."""
        snap = cls.__new__(cls)
        SnapshotView.__init__(snap, store, record, manifest)
        snap.path = store.url
        return snap

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
    ) -> Snapshot:
        """Take a snapshot of ``app_state`` at ``path`` (see the class docstring).

        Distributed: call on every rank; ``pg`` and ``replicated`` (key globs) as in
        :meth:`Store.take`.
        """
        repo, name = _locate_all_ranks(os.fspath(path), storage_options, index)
        args = _takes.TakeArgs.of("default", None, (), metadata, name, replicated or ())
        record, manifest = _takes.take(repo, app_state, args, pg, None)
        snap = cls._bind(repo, record, manifest)
        snap.path = os.fspath(path)
        return snap

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
    ) -> PendingSnapshot:
        """Like :meth:`take`, returning once the state is staged."""
        repo, name = _locate(os.fspath(path), storage_options, index, create=True)
        args = _takes.TakeArgs.of("default", None, (), metadata, name, ())
        return PendingSnapshot.of(repo, _takes.async_take(repo, app_state, args, None, None, None))

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
        app_state is left untouched. Destinations up to ``memory_budget`` bytes in total
        (default: ``$CKSTORE_MEMORY_BUDGET`` or the store's default) are staged and read once;
        larger ones are verified in a first pass and decoded straight into place in a second,
        so memory above the live state stays near the budget.

        ``atomic=False`` gives up that guarantee for speed: every tensor is decoded straight
        into place in one pass (chunks are still re-hashed, and a damaged one still raises
        CorruptionError naming the key, but the destination is then partly loaded) and
        nothing is staged. Use it to load into a freshly built model at start-up, where a
        failed restore ends the process anyway.

        With ``torch.distributed`` initialised, call it on every rank: each rank reads only
        the part its destination needs (its DTensor shard, whatever the world size and
        placement at take time; whole plain tensors; its own rank's per-rank values), and
        either every rank loads or every rank raises DistributedError.
        ``replicated_read`` (default ``$CKSTORE_REPLICATED_READ`` or ``"each"``) picks how
        entries that every rank needs whole as plain tensors (DDP-style replicas) are read:
        ``"each"``, every rank reads them; ``"broadcast"``, rank 0 reads and verifies them and
        broadcasts them to the other ranks, which read none of their chunks (the broadcast
        tensors are staged, so they count against ``memory_budget``).

        Raises:
            MismatchError: keys, dtypes or shapes differ (named in the message).
            CorruptionError: stored bytes are damaged (the key is named).
            DistributedError: a rank failed (distributed restore; names ranks and causes).
        """
        from .dist._restore import replicated_mode
        from .engine.restore import check_app_state

        check_app_state(app_state)
        mode = replicated_mode(replicated_read)
        if memory_budget is not None:
            check_int("memory_budget", memory_budget)
        if dist_timeout is not None:
            check_number("dist_timeout", dist_timeout, lo_open=True)
        budget = self.store.memory_budget if memory_budget is None else memory_budget
        if is_distributed():
            from .dist._restore import restore as dist_restore

            dist_restore(
                self.reader(),
                app_state,
                strict=strict,
                pg=pg,
                timeout=dist_timeout,
                budget=budget,
                replicated_read=mode,
                atomic=atomic,
            )
            return
        from .engine.restore import restore

        restore(self.reader(), app_state, strict=strict, budget=budget, atomic=atomic)

    def read_object(
        self, path: str, obj_out: Any = None, memory_budget_bytes: int | None = None
    ) -> Any:
        """Read one entry (or a subtree such as ``"optim"``) without reading anything else.

        A tensor comes back as a new CPU tensor, or is copied into ``obj_out`` if given.
        """
        from .engine.restore import read_object

        return read_object(self.reader(), path, obj_out)

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
        """Every leaf key -> its entry (``kind``, ``dtype``, ``shape``, ``nbytes``)."""
        return dict(self.manifest.entries)

    def __repr__(self) -> str:
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
    def of(cls, repo: Repository, job: _takes.Background) -> PendingSnapshot:
        """Wrap a background take: its result becomes a Snapshot of ``repo``."""
        future: Future[Snapshot] = Future()

        def bind(done: Future[_takes.Committed]) -> None:
            exc = done.exception()
            if exc is not None:
                future.set_exception(exc)
            else:
                record, manifest = done.result()
                future.set_result(Snapshot._bind(repo, record, manifest))

        job.future.add_done_callback(bind)
        return cls(future, staged_bytes=job.staged_bytes, sync_bytes=job.sync_bytes)

    def done(self) -> bool:
        """True once the snapshot committed or failed."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> Snapshot:
        """Block until committed; return the Snapshot or raise the take's error."""
        return self._future.result(timeout)


def _locate(
    path: str, storage_options: dict[str, Any] | None, index: str | None, create: bool
) -> tuple[Repository, str | None]:
    """Find the store holding ``path`` and the snapshot name inside it (None: the store root)."""
    open_store = open_repository
    if not is_local(path):
        return open_store(path, index=index, storage_options=storage_options, create=create), None
    path = local_path(path)
    d = path
    while True:
        if os.path.isfile(os.path.join(d, CONFIG_NAME)):
            name = os.path.relpath(path, d).replace(os.sep, "/")
            return open_store(d, index=index, create=False), None if name == "." else name
        parent = os.path.dirname(d)
        if parent == d:
            break
        d = parent
    if not create:
        raise SnapshotNotFoundError(
            f"no ckstore snapshot at {path!r} (no store in it or its parents)"
        )
    return open_store(path, index=index, storage_options=storage_options, create=True), None


def _locate_all_ranks(
    path: str, storage_options: dict[str, Any] | None, index: str | None
) -> tuple[Repository, str | None]:
    """Like ``_locate(create=True)``; distributed, rank 0 creates the store before the others open it."""
    if not is_distributed():
        return _locate(path, storage_options, index, create=True)
    from .dist._comm import Comm

    comm = Comm()
    found: Any = None
    error = None
    if comm.rank == 0:
        try:
            found = _locate(path, storage_options, index, create=True)
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            error = f"{type(exc).__name__}: {exc}"
    reply = comm.broadcast_json({"error": error}, "opening the store")
    if reply["error"]:
        raise DistributedError(f"rank 0 could not open {path!r}: {reply['error']}")
    return found if comm.rank == 0 else _locate(path, storage_options, index, create=False)


def _latest(store: Repository) -> SnapshotRecord:
    records = store.index.list_snapshots(limit=1)
    if not records:
        raise SnapshotNotFoundError(f"store {store.url} holds no snapshot yet")
    return records[0]
