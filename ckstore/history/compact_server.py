"""The compaction helper's side of ``compact_process.py``: compact each store the training
process names, waiting and stopping as the shared flags say, and reply (``python -m
ckstore.history.compact_server FD``, FD a Unix socket to the training process)."""

from __future__ import annotations

import mmap
import sys
from dataclasses import asdict
from typing import Any

from ..engine import helper
from ..engine.repository import Repository
from .compact import compact
from .compact_process import BUSY, STOP


def serve(fd: int) -> None:
    """The helper's loop: one compaction per job, a reply each, until the training process
    hangs up."""
    helper.serve(fd, _compact)


def _compact(repo: Repository, message: dict[str, Any], fd: int) -> dict[str, Any]:
    for knob, value in message["knobs"].items():
        setattr(repo, knob, value)
    flags = mmap.mmap(fd, mmap.PAGESIZE, flags=mmap.MAP_SHARED)
    try:
        report = compact(
            repo,
            keep_loose=message["keep_loose"],
            pause=lambda: flags[BUSY] == 1,
            stop=lambda: flags[STOP] == 1,
            young=set(message.get("young", ())),
        )
    finally:
        flags.close()
    return {"report": asdict(report)}


if __name__ == "__main__":  # run as a module: imports what the jobs were pickled against
    from ckstore.history import compact_server

    compact_server.serve(int(sys.argv[1]))
