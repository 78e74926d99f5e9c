"""One folder per store identity on a shared index.

A local store with an index of its own kind (PostgreSQL, ``index=``) keeps its packs in its
folder and their rows in that index. A copy of the folder (``cp -r``, a backup, a move to a new
disk that left the old one in place) holds the same store id, so the index accepts it, and the
two folders then share rows while each holds only its own packs: a gc in one rewrites packs
into it alone and points the shared rows there, and the other's committed snapshots stop
restoring. So the index records the folder it serves (``meta.store_path``), and an open from
another folder is refused while the recorded one is still there, holds the same store and is
not the same folder under another name (a bind mount, another mount of one network share: a
probe file written here and looked for there tells). A store moved away from a folder that is
gone is followed: the index records its new place.
"""

from __future__ import annotations

import json
import os
import uuid
from typing import Protocol

from ..errors import ConflictError
from .config import CONFIG_NAME

PATH_KEY = "store_path"
"""The index's meta key naming the folder it serves (its real path)."""


class _Meta(Protocol):
    @property
    def url(self) -> str: ...

    @property
    def read_only(self) -> str | None: ...

    def get_meta(self, key: str) -> str | None: ...

    def set_meta(self, key: str, value: str, *, only_if_absent: bool = False) -> str: ...


def check_folder(index: _Meta, url: str, store_id: str) -> None:
    """Record ``url`` as the folder ``index`` serves, or refuse it as a copy of the one recorded.

    Raises:
        ConflictError: the recorded folder is another one, still there, holding this store.
    """
    here = os.path.realpath(url)
    recorded = index.get_meta(PATH_KEY)
    if recorded == here:
        return
    if (
        recorded is not None
        and _holds_store(recorded, store_id)
        and not _same_folder(here, recorded)
    ):
        raise ConflictError(
            f"store {url} is a copy of the store at {recorded}: both folders hold store "
            f"{store_id} and share the index {index.url}, so a gc in one would move packs the "
            f"other's snapshots need. Open {recorded}; or give the copy an index of its own "
            f"(open it with a new index= and run `ckstore reindex`); or, if {recorded} is a "
            "stale copy, delete it"
        )
    if index.read_only is None:
        index.set_meta(PATH_KEY, here)  # the first open, or the store moved here


def _holds_store(folder: str, store_id: str) -> bool:
    try:
        with open(os.path.join(folder, CONFIG_NAME), "rb") as f:
            return bool(json.loads(f.read()).get("store_id") == store_id)
    except (OSError, ValueError, AttributeError):
        return False


def _same_folder(here: str, there: str) -> bool:
    """Whether two paths name one folder (one inode, or a probe written in one seen in the
    other); a folder that cannot be written is taken to be the same (nothing is refused on a
    guess)."""
    try:
        if os.path.samefile(here, there):
            return True
    except OSError:
        return False
    probe = f".ckstore-probe-{uuid.uuid4().hex}"
    try:
        with open(os.path.join(here, probe), "x"):
            pass
    except OSError:
        return True
    try:
        return os.path.exists(os.path.join(there, probe))
    finally:
        try:
            os.unlink(os.path.join(here, probe))
        except OSError:
            pass
