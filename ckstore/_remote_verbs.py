"""The store's remote verbs (git's): remotes, push, pull, the two-tier store's waits, and clone.

:class:`RemoteVerbs` is mixed into :class:`ckstore.Store`; :func:`clone` is ``ckstore.clone``.
The work is in :mod:`ckstore.remote`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

from .engine.progress import ProgressFn
from .errors import InvalidInputError, NotFoundError, ReadOnlyStoreError
from .index import RemoteRecord

if TYPE_CHECKING:
    from . import remote
    from .engine.repository import Repository
    from .remote.evict import EvictReport
    from .remote.hydrate import HydrateReport
    from .remote.status import PushStatus
    from .remote.uploader import Uploader


def _remote() -> ModuleType:
    """:mod:`ckstore.remote`, imported on first use: opening a store without remotes (a
    resume) loads none of it."""
    from . import remote

    return remote


Progress = ProgressFn
"""``fn(what, done, total)``: ``what`` is ``"push"`` or ``"pull"``, ``done`` and ``total`` the
stored bytes of the chunks sent or found at the other side (:mod:`ckstore.engine.progress`)."""


class RemoteVerbs:
    """push, pull and the remotes of a store (docs/USAGE.md, "Remotes")."""

    _repo: Repository
    _uploader: Uploader | None = None

    # --- remotes ----------------------------------------------------------------------------
    def add_remote(
        self,
        name: str,
        url: str | os.PathLike[str],
        *,
        index: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> RemoteRecord:
        """Add remote ``name``: the store at ``url`` (any URL :func:`ckstore.open` takes), with its
        ``index`` URL (None: its default) and ``storage_options``, kept in this store's index,
        with the id of the store found at ``url`` (none there yet: the first push creates it
        and records its id). Every later open of the remote checks that id: a missing remote
        is never created anew, another store there is refused (docs/RELIABILITY.md, I7).

        Raises:
            InvalidInputError: a bad name (the rules of run names) or URL (a local path below a
                file), or credentials among ``storage_options`` (they would be kept in plain
                text: pass them through the environment, e.g. ``AWS_ACCESS_KEY_ID`` and
                ``AWS_SECRET_ACCESS_KEY``, or ``~/.aws``).
            ConflictError: a remote of that name exists.
        """
        return _remote().config.add(
            self._repo.index, name, url, remote_index=index, options=storage_options
        )

    def remotes(self) -> list[RemoteRecord]:
        """This store's remotes, by name."""
        return self._repo.index.list_remotes()

    def remove_remote(self, name: str) -> None:
        """Forget remote ``name`` (the remote store is untouched).

        Raises:
            NotFoundError: no such remote.
            ConflictError: chunks of this store live only there (evicted under a local budget).
        """
        self._repo.index.remove_remote(name)

    # --- push and pull ----------------------------------------------------------------------
    def push(
        self,
        remote_name: str,
        refs: Sequence[str] = (),
        *,
        force: bool = False,
        progress: Progress | None = None,
    ) -> remote.TransferReport:
        """Send snapshots to remote ``remote_name``: those ``refs`` name (a tag: its snapshot and
        the tag; a run: all of it; ``run@step``, a name or an id: that snapshot), or every run
        and tag. Only chunks the remote lacks are sent (its index is asked in batches); each
        snapshot becomes visible there in one commit once all its chunks are there, run by run
        in commit order. A push interrupted anywhere leaves nothing half-visible there, and the
        next one does not send again what arrived. The remote store is created if there is none.

        ``force`` moves tags the remote holds at another snapshot (else the push raises
        ConflictError naming them, once everything else is sent). The report counts snapshots,
        chunks and bytes sent and skipped. A read-only store (published checkpoints on
        read-only media) pushes too: everything is sent, and nothing is recorded here, so
        :meth:`push_status` does not change.

        Raises:
            NotFoundError: no remote of that name; SnapshotNotFoundError: a ref names nothing.
            CorruptionError: a chunk read here is damaged (named): the snapshots that need it
                are not sent, the others are.
            ConflictError: a tag is held at another snapshot there (without ``force``), or a
                snapshot's name or run clashes with something there.
        """
        report = _remote().push(self._repo, remote_name, refs, force=force, progress=progress)
        _refuse_tags(report, remote_name)
        return report

    def pull(
        self,
        remote_name: str,
        refs: Sequence[str] = (),
        *,
        force: bool = False,
        progress: Progress | None = None,
    ) -> remote.TransferReport:
        """Bring snapshots of remote ``remote_name`` here: those ``refs`` name there, or every run
        and tag (as :meth:`push`, the other way). Every payload read from the remote is decoded
        and hashed against its chunk id (a delta onto this store's copy of its base) before it
        is stored: a digest the remote supplies proves nothing. A snapshot ``refs`` names that
        is here already has its local chunks read, and those found damaged are fetched again
        from the remote and healed (``chunks_healed``, counted in ``chunks_sent``).

        Raises:
            NotFoundError: no remote of that name, or no store at its URL.
            CorruptionError: a chunk of the remote is damaged: the message names the chunk, its
                pack and the remote, and the snapshots that need it, which are not committed
                here; the others are.
            ConflictError: a tag is held here at another snapshot (without ``force``).
        """
        report = _remote().pull(self._repo, remote_name, refs, force=force, progress=progress)
        _refuse_tags(report, remote_name)
        return report

    # --- the two-tier store -----------------------------------------------------------------
    def push_status(self) -> dict[str, PushStatus]:
        """Snapshot id -> its state (``local``, ``pushing``, ``pushed``) and the remotes holding it."""
        from .remote.status import statuses

        return statuses(self._repo.index)

    def wait_pushed(self, timeout: float | None = None) -> bool:
        """Wait until every snapshot is at the persistent tier (``push_to``); False on timeout.

        Raises:
            InvalidInputError: the store was not opened with ``push_to``.
            StorageError (or another CkstoreError): the latest push failed; it is retried in the
                background, and the message names the remote.
        """
        if self._uploader is None:
            raise InvalidInputError(
                f"store {self._repo.url} has no persistent tier: open it with push_to=REMOTE"
            )
        return self._uploader.wait(timeout)

    def hydrate(self, remote_name: str | None = None) -> HydrateReport:
        """Bring the chunks the local budget evicted to ``remote_name`` (None: to any remote)
        back into local packs, each verified (``remote.hydrate``): afterwards this store reads
        nothing from there, and the remote can be removed. Open the store without
        ``local_budget`` first, or the next eviction sends them away again.

        Raises:
            ReadOnlyStoreError: the store is read-only (refused before anything is written).
            CorruptionError: a payload at the remote is damaged (named); its pack stays evicted.
            StorageError: the remote cannot be read.
        """
        return _remote().hydrate.hydrate(self._repo, remote_name)

    @property
    def last_push(self) -> remote.TransferReport | None:
        """What the background uploader's last push did (None before one ran)."""
        return None if self._uploader is None else self._uploader.last

    @property
    def last_eviction(self) -> EvictReport | None:
        """What the local budget's last eviction pass did (None before one ran)."""
        return None if self._uploader is None else self._uploader.last_eviction


def _refuse_tags(report: remote.TransferReport, name: str) -> None:
    if report.tags_rejected:
        from .errors import ConflictError

        where = "remote " + repr(name) if report.direction == "push" else "this store"
        raise ConflictError(
            f"{report.direction}: tag(s) {', '.join(report.tags_rejected)} exist at {where} at other snapshots "
            f"and were not moved (everything else was {report.direction}ed: {len(report.snapshots_sent)} "
            f"snapshot(s) sent); pass force=True (--force) to move them"
        )


def clone(
    url: str | os.PathLike[str],
    dest: str | os.PathLike[str],
    *,
    index: str | None = None,
    storage_options: dict[str, Any] | None = None,
    dest_index: str | None = None,
    dest_storage_options: dict[str, Any] | None = None,
    name: str = "origin",
    progress: Progress | None = None,
) -> Repository:
    """Make a new store at ``dest`` holding everything of the store at ``url`` (every run,
    snapshot and tag, verified on the way), with ``url`` as its remote ``name``; returns its
    repository, open (``ckstore.clone`` returns it as a Store).

    ``index`` and ``storage_options`` open the source; ``dest_index`` and
    ``dest_storage_options`` the new store (default: SQLite inside a local ``dest``). The new
    store gets the source's chunk, pack and inline sizes, so the two dedup alike. Credentials
    among ``storage_options`` serve the clone only: the remote is recorded without them (pass
    them through the environment for later pulls).

    Raises:
        NotFoundError: no store at ``url``.
        DestinationExistsError: ``dest`` is a non-empty folder (or prefix) that is no store, or
            holds a store already.
        CorruptionError: a chunk of the source is damaged (named): the snapshot that needs it is
            not cloned (the others are; pull again once it is repaired).
    """
    from .engine.opening import open_repository

    # opened as a pull opens a remote (writable where it can be: its session pins what is read)
    source = open_repository(url, index=index, storage_options=storage_options)
    try:
        repo = _new_store(source, dest, dest_index, dest_storage_options)
        try:
            kept, _ = _remote().config.split_credentials(storage_options or {})
            _remote().config.add(
                repo.index,
                name,
                url,
                remote_index=index,
                options=kept or None,
                store_id=source.config.store_id,
            )
            _refuse_tags(_remote().pull(repo, name, progress=progress, source=source), name)
        except BaseException:
            repo.close()
            raise
    finally:
        source.close()  # opened once: the pull reads through it
    return repo


def _new_store(
    source: Repository,
    dest: str | os.PathLike[str],
    index: str | None,
    options: dict[str, Any] | None,
) -> Repository:
    """A new store at ``dest`` with ``source``'s chunk, pack and inline sizes.

    Raises:
        DestinationExistsError: ``dest`` holds a store already.
    """
    from .engine.opening import open_repository
    from .errors import DestinationExistsError

    try:
        existing = open_repository(dest, index=index, storage_options=options)
    except NotFoundError:
        existing = None
    if existing is not None:
        existing.close()
        raise DestinationExistsError(
            f"{dest} holds a store already: clone into a new or empty folder"
        )
    return open_repository(
        dest,
        index=index,
        storage_options=options,
        create=True,
        chunk_bytes=source.config.chunk_bytes,
        pack_bytes=source.config.pack_bytes,
        inline_bytes=source.config.inline_bytes,
    )


def attach(
    store: RemoteVerbs,
    repo: Repository,
    push_to: str | None,
    remote_index: str | None,
    remote_options: dict[str, Any] | None,
    local_budget: int | str | None,
) -> None:
    """What :func:`ckstore.open` does for remotes: reads of evicted chunks, and with
    ``push_to`` the persistent tier and its uploader."""
    if push_to is None:
        if local_budget is not None:
            raise InvalidInputError(
                "local_budget needs a persistent tier to evict to: pass push_to=REMOTE"
            )
        if remote_index is not None or remote_options is not None:
            raise InvalidInputError(
                "remote_index and remote_options describe push_to's store: pass push_to too"
            )
        # chunks evicted to a remote are read there (any store opened without push_to);
        # asked first through the resume's fast reads, so a store with none loads no remote code
        if repo.reads.remote_pack_ids():
            _remote().twotier.install_reads(repo)
        return
    if repo.read_only:
        raise ReadOnlyStoreError(f"cannot push from {repo.url}: {repo.index.read_only}")
    store._uploader = _remote().twotier.attach_tier(
        repo,
        push_to,
        remote_index=remote_index,
        remote_options=remote_options,
        local_budget=local_budget,
    )
