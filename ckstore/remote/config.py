"""A store's remotes, kept in its index (revisions 0006, 0007): add, list, remove, resolve and
open one, knowing which store it is.

A remote is another store, named as git names remotes (``origin``): a URL that
``ckstore.open`` opens (a local directory, ``s3://bucket/prefix``, ...), the index URL it needs
(None: its default, SQLite inside a local store) and its fsspec storage options. A local path
is kept absolute, so the remote means the same from any working directory.

**Which store it is.** The id of the store at the URL (its ``ckstore.json``) is recorded when
the remote is added, or, when there is none yet, when a first push creates it; every open
compares it. A store with another id there is refused (a share mounted elsewhere, a bucket
reused). No store there is a *missing* remote once the remote was used (an id recorded, or
snapshots or evicted chunks held there): it is never created anew, so an unmounted share (an
empty mount point) can never take pushes, be reported as holding them, and let the local tier
evict (docs/RELIABILITY.md, I7). Reads never create.

**No credentials in the index.** Storage options are kept in the index in plain text, so a
credential among them (``secret``, ``token``, ``password``, ...: :func:`credentials_in`) is
refused when a remote is added; credentials come from the environment or the filesystem's own
configuration (for S3: ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``, or a profile in
``~/.aws``). Where options are given for immediate use (``clone``, ``ckstore.open(...,
push_to=..., remote_options=...)``), the credentials serve this process only and the rest is
kept (:func:`split_credentials`).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..engine.config import CONFIG_NAME, StoreConfig
from ..engine.opening import is_local, local_path, open_repository
from ..errors import (
    CkstoreError,
    ConflictError,
    InvalidInputError,
    NotFoundError,
    ObjectNotFoundError,
)
from ..index import RemoteRecord, validate_name
from ..objects import open_backend

if TYPE_CHECKING:
    from ..engine.interfaces import RemoteIndex
    from ..engine.repository import Repository

log = logging.getLogger("ckstore")

_CREDENTIAL = re.compile(
    r"(secret|token|passw|credential|private_key|account_key|connection_string|^key$|"
    r"access_key|api_key|auth)",
    re.IGNORECASE,
)

HOW_TO_PASS_CREDENTIALS = (
    "credentials are never kept in the index (it is plain text): put them in the environment "
    "or the filesystem's own configuration (for S3: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
    "or AWS_PROFILE and ~/.aws/credentials), or give them to ckstore.open(..., push_to=..., "
    "remote_options=...) for one process"
)


def credentials_in(options: Mapping[str, Any], where: str = "") -> list[str]:
    """The keys of ``options`` (nested ones dotted: ``client_kwargs.aws_secret_access_key``)
    that name credentials."""
    found = []
    for key, value in options.items():
        name = f"{where}{key}"
        if isinstance(value, Mapping):
            found += credentials_in(value, f"{name}.")
        elif _CREDENTIAL.search(str(key)):
            found.append(name)
    return found


def split_credentials(options: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``options`` without its credentials, and the credentials alone (same nesting)."""
    kept: dict[str, Any] = {}
    secret: dict[str, Any] = {}
    for key, value in options.items():
        if isinstance(value, Mapping):
            k, s = split_credentials(value)
            if k:
                kept[key] = k
            if s:
                secret[key] = s
        elif _CREDENTIAL.search(str(key)):
            secret[key] = value
        else:
            kept[key] = value
    return kept, secret


def merged(options: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` with ``extra`` laid over it (nested mappings merged)."""
    out = dict(options)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


def add(
    index: RemoteIndex,
    name: str,
    url: str | os.PathLike[str],
    *,
    remote_index: str | None = None,
    options: Mapping[str, Any] | None = None,
    store_id: str | None = None,
) -> RemoteRecord:
    """Add remote ``name`` at ``url`` (with its index URL and storage options), recording the id
    of the store there (``store_id`` if known, else read from its ``ckstore.json``; none there
    yet: recorded when a first push creates it).

    Raises:
        InvalidInputError: a bad name or URL, a local path below a file (no store can ever be
            there), or a credential among the options (the message says how to pass it).
        ConflictError: a remote of that name exists.
    """
    rec = record(name, url, remote_index, options)
    secrets = credentials_in(rec.options)
    if secrets:
        raise InvalidInputError(
            f"remote {name!r}: storage option(s) {', '.join(secrets)} hold credentials: "
            f"{HOW_TO_PASS_CREDENTIALS}"
        )
    if store_id is None:
        store_id = store_id_at(rec)
    return index.add_remote(replace(rec, store_id=store_id))


def record(
    name: str,
    url: str | os.PathLike[str],
    remote_index: str | None = None,
    options: Mapping[str, Any] | None = None,
    tier: bool = False,
) -> RemoteRecord:
    """A checked remote record (not stored).

    Raises:
        InvalidInputError: a bad name, an empty URL, bad options, or a local path where no
            store can ever be (the path, or a folder above it, is a file).
    """
    validate_name(name, "remote")
    text = os.fspath(url)
    if not isinstance(text, str) or not text.strip():
        raise InvalidInputError(
            f"remote {name!r}: the URL must be a store URL or path, got {url!r}"
        )
    if is_local(text):
        text = local_path(text)
        _refuse_impossible_path(name, text)
    if options is not None and not isinstance(options, Mapping):
        raise InvalidInputError(
            f"remote {name!r}: storage options must be a mapping, got {type(options).__name__}"
        )
    return RemoteRecord(name, text, remote_index or None, dict(options or {}), tier)


def _refuse_impossible_path(name: str, path: str) -> None:
    """A local path that is a file, or lies below one, can never hold a store: a typo, refused
    now rather than retried as if the remote were briefly unreachable."""
    d = path
    while d and not os.path.exists(d):
        parent = os.path.dirname(d)
        if parent == d:
            return
        d = parent
    if d and os.path.exists(d) and not os.path.isdir(d):
        where = "is a file" if d == path else f"lies below the file {d}"
        raise InvalidInputError(
            f"remote {name!r}: {path} {where}, so no store can ever be there (a store is a "
            "folder): check the path"
        )


def store_id_at(remote: RemoteRecord) -> str | None:
    """The id of the store at ``remote``'s URL (its ``ckstore.json``); None if there is none,
    or it cannot be read now (recorded then at the first open that finds it)."""
    if is_local(remote.url) and not os.path.isfile(os.path.join(remote.url, CONFIG_NAME)):
        return None
    try:
        backend = open_backend(remote.url, remote.options or None)
        try:
            return StoreConfig.from_json(backend.get(CONFIG_NAME), remote.url).store_id
        finally:
            backend.close()
    except ObjectNotFoundError:
        return None
    except CkstoreError as exc:
        log.info("ckstore: could not read the store id of remote %r yet: %s", remote.name, exc)
        return None


def get(index: RemoteIndex, name: str) -> RemoteRecord:
    """The remote named ``name``.

    Raises:
        NotFoundError: there is none (the message lists the remotes there are).
    """
    found = index.get_remote(name)
    if found is None:
        names = [r.name for r in index.list_remotes()]
        known = f"its remotes: {', '.join(names)}" if names else "it has no remote"
        raise NotFoundError(
            f"no remote named {name!r} in this store ({known}); add one with "
            f"`ckstore remote add {name} URL`"
        )
    return found


def by_url(index: RemoteIndex, url: str | os.PathLike[str]) -> RemoteRecord | None:
    """The remote whose URL is ``url`` (compared as stored: absolute for a local path), if any."""
    text = os.fspath(url)
    text = local_path(text) if is_local(text) else text
    return next((r for r in index.list_remotes() if r.url == text), None)


def open_remote(index: RemoteIndex, remote: RemoteRecord, read_only: bool = False) -> Repository:
    """Open the store ``remote`` names, and show that it is the one this store knows
    (module docstring); never creates one. ``read_only``: for reading alone (its index opened
    without writing anything there, every write refused), as healing reads.

    Raises:
        NotFoundError: no store there (the message says whether the remote was used before:
            then it is missing, and nothing is created).
        ConflictError: the store there has another id than the one recorded.
        StorageError, IndexError_: it cannot be opened.
    """
    try:
        repo = _open(remote, read_only=read_only or None)
    except NotFoundError as exc:
        raise _missing(index, remote, exc) from exc
    return _checked(index, remote, repo)


def open_or_create(
    index: RemoteIndex, remote: RemoteRecord, like: Repository
) -> tuple[Repository, bool]:
    """Open the store ``remote`` names, or create it there with the chunk, pack and inline
    sizes of ``like`` (so the two stores cut tensors alike and dedup) when there is none and
    the remote was never used; returns it and whether it was created.

    Raises:
        NotFoundError: no store there and the remote was used before (missing: never made
            anew, so nothing ever counts as pushed to an empty stand-in).
        ConflictError, StorageError, IndexError_: as for :func:`open_remote`.
    """
    try:
        return _checked(index, remote, _open(remote)), False
    except NotFoundError as exc:
        if remote.store_id is not None or index.remote_used(remote.name):
            raise _missing(index, remote, exc) from exc
    repo = _open(
        remote,
        create=True,
        chunk_bytes=like.config.chunk_bytes,
        pack_bytes=like.config.pack_bytes,
        inline_bytes=like.config.inline_bytes,
    )
    return _checked(index, remote, repo), True


def confirm(repo: Repository, name: str) -> None:
    """Show that the store ``repo`` was opened on is still at its URL, now: its ``ckstore.json``
    is read again (one small read) and its id compared. A handle opened earlier keeps its
    place's path, or its index connection, after the share under it went away, and would write
    into an empty mount point; this is asked before a snapshot is committed there and before
    anything is evicted on its word.

    Raises:
        NotFoundError: no store there now; ConflictError: another store there now.
    """
    try:
        found = StoreConfig.from_json(repo.objects.backend.get(CONFIG_NAME), repo.url).store_id
    except ObjectNotFoundError as exc:
        raise NotFoundError(
            f"remote {name!r}: the store at {repo.url} is gone (no {CONFIG_NAME} there now: an "
            "unmounted share, a moved folder, a deleted prefix); nothing more is sent to it or "
            "evicted on its word until it is back"
        ) from exc
    if found != repo.config.store_id:
        raise ConflictError(
            f"remote {name!r}: {repo.url} now holds another store (id {found}) than the one "
            f"opened there (id {repo.config.store_id}); nothing more is sent to it or evicted "
            "on its word"
        )


def _open(
    remote: RemoteRecord, create: bool = False, read_only: bool | None = None, **kw: Any
) -> Repository:
    index_file = _sqlite_file(remote.url, remote.index)
    if not create and index_file is not None and not os.path.exists(index_file):
        raise NotFoundError(  # opening it would leave an empty database file there
            f"no index at {index_file} for the store at {remote.url}"
        )
    return open_repository(
        remote.url,
        index=remote.index,
        storage_options=remote.options or None,
        create=create,
        read_only=read_only,
        **kw,
    )


def _sqlite_file(url: str, index_url: str | None) -> str | None:
    """The SQLite file of the index (``index_url``, None: its default) of the store at ``url``,
    when it is one."""
    if index_url is None:
        return os.path.join(url, "index.sqlite") if is_local(url) else None
    prefix = "sqlite:///"
    if not index_url.startswith(prefix) or "?" in index_url:
        return None
    path = index_url[len(prefix) :]
    return None if path in ("", ":memory:") or path.startswith("file:") else path


def _checked(index: RemoteIndex, remote: RemoteRecord, repo: Repository) -> Repository:
    """``repo`` if its id is the one recorded for ``remote`` (recorded now if none was)."""
    found = repo.config.store_id
    known = remote.store_id
    if known is None and index.read_only is None:
        known = index.record_remote_store_id(remote.name, found)
    if known is not None and known != found:
        repo.close()
        raise ConflictError(
            f"remote {remote.name!r} at {remote.url} is another store (id {found}) than the one "
            f"this store pushed to and pulled from there (id {known}): a different share or "
            "bucket is mounted or configured at that URL. Nothing was read or written there; "
            f"point the remote at its store again, or, if this really is its replacement, "
            f"`ckstore remote rm {remote.name}` and add it anew"
        )
    return repo


def _missing(index: RemoteIndex, remote: RemoteRecord, exc: NotFoundError) -> NotFoundError:
    if remote.store_id is None and not index.remote_used(remote.name):
        return exc
    return NotFoundError(
        f"remote {remote.name!r}: no store at {remote.url} any more, where store "
        f"{remote.store_id or '(id not recorded)'} held snapshots of this store: the remote is "
        "missing (an unmounted share, a moved folder, a deleted bucket or prefix, another "
        "index). Nothing is created there: snapshots stay `pushing` and nothing is evicted "
        "until it is back"
    )
