"""An export's output directory: built beside its destination, published whole.

The files are written into a hidden temporary directory next to the destination and fsynced;
only then does the directory take the destination's name (one rename onto a missing or empty
directory; with ``force``, a non-empty one is moved aside first and deleted after). A failed
export leaves nothing at the destination and removes its temporary directory.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from ..engine.config import CONFIG_NAME
from ..errors import CorruptionError, DestinationExistsError


def check_destination(dest: str, force: bool, store: str | None = None) -> None:
    """Refuse a destination that is a file, a non-empty directory without ``force``, a store
    (``force`` never replaces one), or one that is, holds or lies inside ``store`` (the local
    folder of the store exported from: replacing it would delete the store).

    Raises:
        DestinationExistsError: for each of those, naming the destination.
    """
    if store is not None and _overlaps(dest, store):
        raise DestinationExistsError(
            f"export destination {dest!r} is, holds or lies inside the store's own folder "
            f"{store!r}; choose a directory outside the store"
        )
    if os.path.isfile(dest) or (os.path.lexists(dest) and not os.path.isdir(dest)):
        raise DestinationExistsError(f"export destination {dest!r} exists and is not a directory")
    if os.path.isdir(dest) and os.listdir(dest):
        if os.path.exists(os.path.join(dest, STORE_MARK)):
            raise DestinationExistsError(
                f"export destination {dest!r} is a ckstore store ({STORE_MARK}), which an "
                "export never replaces; choose another directory"
            )
        if not force:
            raise DestinationExistsError(
                f"export destination {dest!r} is not empty; choose another directory or pass "
                "force=True (--force) to replace it"
            )


STORE_MARK = CONFIG_NAME


def _overlaps(dest: str, store: str) -> bool:
    d, s = os.path.realpath(dest), os.path.realpath(store)
    return d == s or s.startswith(d.rstrip(os.sep) + os.sep) or d.startswith(s + os.sep)


@contextmanager
def staged(dest: str, force: bool, store: str | None = None) -> Iterator[str]:
    """Yield a temporary directory to fill; on success it becomes ``dest`` (refused as
    :func:`check_destination` says; ``store``: the local folder of the store exported from).

    A ``dest`` that is a symbolic link to a directory stands for that directory: the export
    is published there (renaming onto the link itself would fail once everything is written).
    """
    dest = os.path.abspath(dest)
    if os.path.islink(dest) and os.path.isdir(dest):
        dest = os.path.realpath(dest)  # the directory the link names is the one to fill
    check_destination(dest, force, store)
    parent = os.path.dirname(dest)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(dest)}.tmp-", dir=parent)
    try:
        yield tmp
        _sync_tree(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)
        _publish(tmp, dest, force, store)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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


def _publish(tmp: str, dest: str, force: bool, store: str | None) -> None:
    check_destination(dest, force, store)
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
