"""A store's remotes, kept in its index (revision 0006): add, list, remove, resolve and open one.

A remote is another store, named as git names remotes (``origin``): a URL that
``ckstore.open`` opens (a local directory, ``s3://bucket/prefix``, ...), the index URL it needs
(None: its default, SQLite inside a local store) and its fsspec storage options. A local path
is kept absolute, so the remote means the same from any working directory. Storage options are
stored in the index as given (credentials included, as git keeps them in its config): prefer
the environment or ``~/.aws`` for secrets.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..engine.opening import is_local, local_path, open_repository
from ..errors import InvalidInputError, NotFoundError
from ..index import RemoteRecord, validate_name

if TYPE_CHECKING:
    from ..engine.interfaces import RemoteIndex
    from ..engine.repository import Repository


def add(
    index: RemoteIndex,
    name: str,
    url: str | os.PathLike[str],
    *,
    remote_index: str | None = None,
    options: Mapping[str, Any] | None = None,
) -> RemoteRecord:
    """Add remote ``name`` at ``url`` (with its index URL and storage options).

    Raises:
        InvalidInputError: a bad name or an empty URL.
        ConflictError: a remote of that name exists.
    """
    return index.add_remote(record(name, url, remote_index, options))


def record(
    name: str,
    url: str | os.PathLike[str],
    remote_index: str | None = None,
    options: Mapping[str, Any] | None = None,
    tier: bool = False,
) -> RemoteRecord:
    """A checked remote record (not stored)."""
    validate_name(name, "remote")
    text = os.fspath(url)
    if not isinstance(text, str) or not text.strip():
        raise InvalidInputError(
            f"remote {name!r}: the URL must be a store URL or path, got {url!r}"
        )
    if is_local(text):
        text = local_path(text)
    if options is not None and not isinstance(options, Mapping):
        raise InvalidInputError(
            f"remote {name!r}: storage options must be a mapping, got {type(options).__name__}"
        )
    return RemoteRecord(name, text, remote_index or None, dict(options or {}), tier)


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


def open_remote(
    remote: RemoteRecord, *, create: bool = False, like: Repository | None = None
) -> Repository:
    """Open the store ``remote`` names; with ``create``, make it if there is none, with the
    chunk, pack and inline sizes of ``like`` (so the two stores cut tensors alike and dedup)."""
    knobs: dict[str, Any] = {}
    if create and like is not None:
        knobs = {
            "chunk_bytes": like.config.chunk_bytes,
            "pack_bytes": like.config.pack_bytes,
            "inline_bytes": like.config.inline_bytes,
        }
    return open_repository(
        remote.url,
        index=remote.index,
        storage_options=remote.options or None,
        create=create,
        **knobs,
    )
