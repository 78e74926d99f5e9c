"""A checkpoint's identity is the full path the trainer gave, normalised; its tag derives from it.

Two checkpoints with one file name in different folders (``exp_a/last.ckpt``,
``exp_b/last.ckpt``) are two checkpoints: the integrations key everything by
:func:`identity`, and the tag that marks a checkpoint in the store carries a digest of its
folder (:func:`path_tag`), so no save ever moves another folder's tag.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import re
from typing import Any

from ..index.names import MAX_NAME_LENGTH

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_DIGEST = 10


def is_url(path: str) -> bool:
    """True for an fsspec URL (``memory://``, ``s3://``...), False for a local path."""
    return "://" in path and not path.startswith("file://")


def identity(path: Any) -> str:
    """The normalised full path of ``path``: absolute, its folder's symlinks resolved (the file
    name itself is kept: a link to a checkpoint is another file); URLs keep their scheme and get
    their path normalised."""
    text = os.fspath(path)
    if is_url(text):
        scheme, rest = text.split("://", 1)
        return f"{scheme}://{posixpath.normpath(rest) if rest else rest}"
    if text.startswith("file://"):
        text = text[len("file://") :]
    full = os.path.abspath(os.path.expanduser(text))
    head, tail = os.path.split(full)
    return os.path.join(os.path.realpath(head), tail)


def path_tag(run: str, ident: str) -> str:
    """The tag of the checkpoint saved at ``ident``: ``<run>/<folder digest>/<file name>``, the
    file name in tag-safe characters (``epoch=3.ckpt`` -> ``epoch_3.ckpt``)."""
    folder, name = posixpath.split(ident) if is_url(ident) else os.path.split(ident)
    base = _UNSAFE.sub("_", name).strip("._-") or "checkpoint"
    tag = f"{tag_prefix(run, folder)}{base}"
    if len(tag) > MAX_NAME_LENGTH:
        whole = hashlib.sha256(ident.encode()).hexdigest()[:_DIGEST]
        tag = f"{tag[: MAX_NAME_LENGTH - _DIGEST - 1]}-{whole}"
    return tag


def tag_prefix(run: str, folder: str) -> str:
    """What the :func:`path_tag` of every checkpoint directly in ``folder`` (an
    :func:`identity`'s folder part) starts with: ``<run>/<folder digest>/``."""
    return f"{run}/{hashlib.sha256(folder.encode()).hexdigest()[:_DIGEST]}/"
