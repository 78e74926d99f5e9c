"""Damage done on purpose to a local store's packs."""

from __future__ import annotations

import os
from pathlib import Path

from ckstore import objects
from ckstore.index import ChunkRecord


def pack_path(root: Path, pack_id: str) -> Path:
    """The file of pack ``pack_id`` in the local store at ``root``."""
    return root.joinpath(*objects.pack_name(pack_id).split("/"))


def flip(root: Path, rec: ChunkRecord) -> None:
    """Flip one bit in the middle of the chunk's payload in its pack file under ``root``."""
    path = pack_path(root, rec.pack_id)
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(rec.offset + rec.length // 2)
        byte = f.read(1)
        f.seek(rec.offset + rec.length // 2)
        f.write(bytes([byte[0] ^ 0x10]))
