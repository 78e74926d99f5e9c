"""An export's output directory: built beside its destination, published whole.

The files are written into a hidden temporary directory next to the destination and fsynced;
only then does the directory take the destination's name (one rename onto a missing or empty
directory; with ``force``, a non-empty one is moved aside first and deleted after). A failed
export leaves nothing at the destination and removes its temporary directory.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from ..engine.config import CONFIG_NAME
from ..errors import CorruptionError, DestinationExistsError, NoSpaceError


def check_destination(dest: str, force: bool, keep: Mapping[str, str] | None = None) -> None:
    """Refuse a destination that is a file, or a non-empty directory without ``force``; and,
    with or without it, one that is, holds or lies inside a store, or holds a path of ``keep``
    (path -> who uses it: the store exported from, its remotes, and their index files, which
    may lie elsewhere).

    Raises:
        DestinationExistsError: for each of those, naming the destination and what it hits.
    """
    for path, user in (keep or {}).items():
        if _holds(dest, path):
            raise DestinationExistsError(
                f"export destination {dest!r} is or holds {path!r}, which {user} uses; "
                "choose a directory outside every store and index"
            )
    inside = _store_above(dest)
    if inside is not None:
        raise DestinationExistsError(
            f"export destination {dest!r} lies inside the store {inside!r}; choose a "
            "directory outside every store"
        )
    if os.path.isfile(dest) or (os.path.lexists(dest) and not os.path.isdir(dest)):
        raise DestinationExistsError(f"export destination {dest!r} exists and is not a directory")
    if os.path.isdir(dest) and os.listdir(dest):
        if not force:
            raise DestinationExistsError(
                f"export destination {dest!r} is not empty; choose another directory or pass "
                "force=True (--force) to replace it"
            )
        held = _store_within(dest)
        if held is not None:
            raise DestinationExistsError(
                f"export destination {dest!r} is or holds the ckstore store {held!r}, which "
                "an export never replaces; choose another directory"
            )


STORE_MARK = CONFIG_NAME


def _holds(dest: str, path: str) -> bool:
    """Whether ``path`` is ``dest`` or lies under it (links resolved)."""
    d, p = os.path.realpath(dest), os.path.realpath(path)
    return p == d or p.startswith(d.rstrip(os.sep) + os.sep)


def _store_above(dest: str) -> str | None:
    """The store a folder above ``dest`` is (its ``ckstore.json``), if any."""
    here = os.path.dirname(os.path.realpath(dest))
    while True:
        if os.path.isfile(os.path.join(here, STORE_MARK)):
            return here
        up = os.path.dirname(here)
        if up == here:
            return None
        here = up


def _store_within(dest: str) -> str | None:
    """A store ``dest`` is or holds (a folder with ``ckstore.json`` in its tree), if any."""
    for folder, _dirs, files in os.walk(dest):
        if STORE_MARK in files:
            return folder
    return None


@contextmanager
def staged(dest: str, force: bool, keep: Mapping[str, str] | None = None) -> Iterator[str]:
    """Yield a temporary directory to fill; on success it becomes ``dest`` (refused as
    :func:`check_destination` says; ``keep``: the paths the store exported from uses).

    A ``dest`` that is a symbolic link to a directory stands for that directory: the export
    is published there (renaming onto the link itself would fail once everything is written).
    """
    dest = os.path.abspath(dest)
    if os.path.islink(dest) and os.path.isdir(dest):
        dest = os.path.realpath(dest)  # the directory the link names is the one to fill
    check_destination(dest, force, keep)
    parent = os.path.dirname(dest)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(dest)}.tmp-", dir=parent)
    try:
        yield tmp
        _sync_tree(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)
        _publish(tmp, dest, force, keep)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if exc.errno in _FULL:
            raise NoSpaceError(
                f"no space left to export to {dest} ({exc.strerror}): nothing was published "
                "there and the partial files are removed; free some space (or export fewer "
                "keys, `keys=`) and export again"
            ) from exc
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}


def inside(out: str, rel: str, where: str) -> str:
    """The path of file ``rel`` (relative, '/'-separated, from a snapshot) under ``out``.

    Raises:
        CorruptionError: ``rel`` is absolute, empty, or has an empty, ``.`` or ``..`` part: a
            name recorded in a snapshot must never reach outside the export's directory.
    """
    parts = rel.split("/")
    if not rel or os.path.isabs(rel) or "\x00" in rel or any(p in ("", ".", "..") for p in parts):
        raise CorruptionError(
            f"{where}: file name {rel!r} is not a relative path inside the export"
        )
    return os.path.join(out, *parts)


def _publish(tmp: str, dest: str, force: bool, keep: Mapping[str, str] | None) -> None:
    check_destination(dest, force, keep)
    if os.path.isdir(dest) and os.listdir(dest):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(dest)}.old-", dir=os.path.dirname(dest))
        os.rename(dest, os.path.join(old, "d"))
        os.rename(tmp, dest)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, dest)  # onto a missing or empty directory: atomic
    _fsync_dir(os.path.dirname(dest))


def _sync_tree(root: str) -> None:
    for d, _dirs, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(d)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
