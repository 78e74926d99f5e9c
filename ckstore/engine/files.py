"""Small files written whole: a reader sees the old file or the new one, never part of one.

The integrations write small files beside a trainer's checkpoints (pointer files, a marked
folder's marker): :func:`write_atomic` writes the bytes to a temporary file in the same
folder, fsyncs it, renames it over the target and fsyncs the folder, so a crash at any point
leaves either the old file (or none) or the whole new one. The temporary file's name starts
with ``.`` followed by the target's name, so a listing that parses names (a trainer's
``step-(\\d+)``) reads it as it reads the target.
"""

from __future__ import annotations

import os
import tempfile


def write_atomic(path: str, data: bytes | str) -> None:
    """Write ``data`` (text is UTF-8) at ``path`` atomically and durably (module docstring).

    Raises:
        OSError: the folder cannot be written; no temporary file is left behind.
    """
    folder, name = os.path.split(os.path.abspath(path))
    raw = data.encode("utf-8") if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
