"""How a user gets a :class:`~ckstore.store.Store`: :func:`open` (an existing store, or a new
one with ``create``) and :func:`clone` (a new store holding everything of another)."""

from __future__ import annotations

import os
from typing import Any

from . import _remote_verbs
from .engine.opening import open_repository
from .engine.progress import ProgressFn
from .engine.repository import Repository
from .store import Store


def open(  # noqa: A001 - the public verb is ckstore.open
    url: str | os.PathLike[str],
    *,
    index: str | None = None,
    storage_options: dict[str, Any] | None = None,
    create: bool = False,
    chunk_bytes: int | None = None,
    pack_bytes: int | None = None,
    inline_bytes: int | None = None,
    create_index: bool | None = None,
    delta_base: str | None = None,
    delta_depth: int | None = None,
    take_codec: str | None = None,
    auto_compact: bool | None = None,
    read_only: bool | None = None,
    push_to: str | None = None,
    remote_index: str | None = None,
    remote_options: dict[str, Any] | None = None,
    local_budget: int | str | None = None,
) -> Store:
    """Open a store; with ``create=True``, create it first if there is none.

    Args:
        url: a local directory, ``file://``, ``memory://name``, ``s3://bucket/prefix`` or any
            fsspec URL.
        index: SQLAlchemy URL of the index. Default: SQLite inside a local store. Required for
            remote stores (PostgreSQL when many hosts share one).
        storage_options: passed to fsspec (e.g. s3fs credentials, endpoint_url).
        create: make the store if there is none at ``url``: in a new or empty folder (or
            prefix), never in a non-empty one that is not a store. False (the default, as
            git outside ``git init``) raises NotFoundError, so a mistyped path is an error, not a
            new empty store.
        chunk_bytes, pack_bytes, inline_bytes: knobs for a NEW store (ignored when it exists).
        create_index: give an empty index database the schema even when ``create`` is False
            (to ``reindex`` an existing store into a fresh index); None: the same as ``create``.
        delta_base, delta_depth: this handle's defaults for takes (see :meth:`Store.take`):
            ``delta_base="parent"`` stores every take of a run as deltas against the one before
            where that is smaller; ``delta_depth`` (default 1, or ``$CKSTORE_DELTA_DEPTH``) bounds the chains.
        take_codec: how this handle's takes encode new chunks: ``"raw"`` (default, or
            ``$CKSTORE_TAKE_CODEC``: no encoding, so the newest snapshot restores at the
            speed of a copy; compaction rewrites older snapshots densely), ``"fast"``
            (``exp-zstd`` for floats: 17% fewer bytes until compaction, restores decode them)
            or ``"dense"`` (compact at once).
        auto_compact: whether takes start a background compaction (default True, or
            ``$CKSTORE_AUTO_COMPACT``); see :meth:`Store.compact`.
        read_only: True opens without writing anything (reads, restores, exports, check and
            du work; a take, tag, delete, gc or reindex raises ReadOnlyStoreError). None (the
            default) does so when a local store's folder or index is not writable (a
            read-only mount), or the index URL is SQLite ``mode=ro`` / ``immutable=1``.
        push_to: make this store the fast local tier of a two-tier store: a remote's name (see
            :meth:`Store.add_remote`) or a store URL (``s3://bucket/prefix``; a folder as
            ``./name`` or an absolute path), which becomes its persistent tier. Takes commit
            here at local speed; a background thread pushes each one (:meth:`Store.push`),
            ``log`` and ``show`` say ``local``, ``pushing`` or ``pushed``, retention and gc keep
            whatever the tier does not hold yet, :meth:`Store.wait_pushed` waits, and a clean
            :meth:`Store.close` pushes what is pending first.
        remote_index, remote_options: the index URL and storage options of ``push_to`` (kept
            with a new remote, ``tier``, but credentials: those serve this process alone).
        local_budget: with ``push_to``: bytes (or a size such as ``"200GiB"``) the local packs
            may hold; past it, pushed packs are evicted, least recently used first, and reads
            of their chunks go to the remote (verified as always).

    Raises:
        NotFoundError: no store at ``url`` and ``create`` is False (the message says how to
            create one).
        InvalidInputError: ``url`` is a file.
        errors.DestinationExistsError: ``create`` is True and ``url`` is a non-empty folder
            (or prefix) that is not a store.
        SchemaError: the store or index was written by another format version.
    """
    repo: Repository = open_repository(
        url,
        index=index,
        storage_options=storage_options,
        create=create,
        chunk_bytes=chunk_bytes,
        pack_bytes=pack_bytes,
        inline_bytes=inline_bytes,
        create_index=create_index,
        read_only=read_only,
    )
    try:
        repo.delta_base = delta_base
        if delta_depth is not None:
            repo.delta_depth = delta_depth
        if take_codec is not None:
            repo.take_codec = take_codec
        if auto_compact is not None:
            repo.auto_compact = auto_compact
        store = Store(repo)
        _remote_verbs.attach(store, repo, push_to, remote_index, remote_options, local_budget)
    except BaseException:
        repo.close()
        raise
    return store


def clone(
    url: str | os.PathLike[str],
    dest: str | os.PathLike[str],
    *,
    index: str | None = None,
    storage_options: dict[str, Any] | None = None,
    dest_index: str | None = None,
    dest_storage_options: dict[str, Any] | None = None,
    name: str = "origin",
    progress: ProgressFn | None = None,
) -> Store:
    """Make a new store at ``dest`` holding every run, snapshot and tag of the store at ``url``
    (chunks verified on the way), with its chunk, pack and inline sizes and ``url`` as its
    remote ``name`` (default ``origin``); return it, open.

    ``index`` and ``storage_options`` open the source; ``dest_index`` and
    ``dest_storage_options`` the new store (default: SQLite inside a local ``dest``).
    ``progress(what, done, total)`` is told the stored bytes copied or found there (``what``:
    ``"pull"``; :mod:`ckstore.engine.progress`).

    Raises:
        NotFoundError: no store at ``url``.
        DestinationExistsError: ``dest`` holds a store, or is a non-empty folder (or prefix).
        CorruptionError: a chunk of the source is damaged (named): the snapshot that needs it
            is not cloned, those before it are.
    """
    return Store(
        _remote_verbs.clone(
            url,
            dest,
            index=index,
            storage_options=storage_options,
            dest_index=dest_index,
            dest_storage_options=dest_storage_options,
            name=name,
            progress=progress,
        )
    )
