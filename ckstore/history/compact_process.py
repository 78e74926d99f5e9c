"""The compaction after takes, run in a helper process of the store handle when the knob
``background_process`` is on (:func:`compact_in_helper`; the helper's side is
``compact_server.py``).

Compaction in a thread of the training process holds the GIL for its Python between the C
calls that read, encode, check and write each chunk, and a trainer whose Python waits for the
GIL sleeps: on the bench's training loop (a one-thread CPU trainer, 270 MiB state, a take every
10 steps, compaction after each) most of what the steps after a take lost was such sleep. A
process of its own shares no GIL with the trainer. It runs at the lowest CPU priority, as the
thread would, and waits between chunks while the training process takes or restores, as the
thread would (``pause``).

The compaction thread of the training process sends one job (the store to open, the knobs
compaction reads, ``keep_loose``) with a one-page block of flags in shared memory: byte
:data:`BUSY` is 1 while this process takes or restores (the helper waits between chunks), byte
:data:`STOP` asks it to end after switching what it wrote (the handle closes). The thread
refreshes them every :data:`POLL` seconds while it waits for the reply, the
:class:`~ckstore.history.compact.CompactReport`. Compaction's crash guarantees hold whichever
process runs it: a helper killed mid-run leaves at most an orphan pack ``gc`` removes, and the
next kick starts a new helper.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any

from ..engine import helper

if TYPE_CHECKING:
    from ..engine.repository import Repository

SERVER = f"{__package__}.compact_server"
"""The module the compaction helper runs."""

KNOBS = ("background_threads", "delta_depth", "io_threads", "lease_seconds", "threads")
"""Knobs of the training process's repository that compaction reads, set on the helper's."""

BUSY, STOP = 0, 1
"""Offsets of the flags in the shared block."""

POLL = 0.05
"""Seconds between refreshes of the flags while the helper compacts."""


def helper_for(repo: Repository) -> helper.Helper:
    """The repository's compaction helper (``engine/helper.py``)."""
    return helper.helper_for(
        repo, SERVER, "compaction", "the chunks it switched stay switched, the rest stay loose"
    )


def in_helper(repo: Repository) -> bool:
    """Whether compaction after takes into ``repo`` runs in the helper process: the knob
    ``background_process`` is on and another process can open the store (``offload``)."""
    if not repo.background_process:
        return False
    from ..engine.take import offload  # torch: only where the knob asks for a helper

    return offload.unavailable(repo) is None


def compact_in_helper(
    repo: Repository,
    keep_loose: int,
    pause: Callable[[], bool],
    stop: Callable[[], bool],
    young: set[str] | None = None,
) -> dict[str, Any]:
    """Compact ``repo`` in its compaction helper (started on first use, stopped when the
    repository closes) as :func:`~ckstore.history.compact.compact` with ``pause`` and
    ``stop`` would (and ``young``), polled here and passed on through the shared flags; the
    :class:`~ckstore.history.compact.CompactReport`'s fields.

    Raises:
        StorageError: the helper could not be reached or exited mid-run (compaction's crash
            guarantees hold; the next call starts a new helper).
        Whatever the compaction raised in the helper.
    """

    fd = os.memfd_create("ckstore-compact-flags")
    try:
        os.ftruncate(fd, mmap.PAGESIZE)
        flags = mmap.mmap(fd, mmap.PAGESIZE, flags=mmap.MAP_SHARED)
        message = {
            "open": {"url": repo.url, **repo.opened_with},
            "knobs": {k: getattr(repo, k) for k in KNOBS},
            "keep_loose": keep_loose,
            "young": sorted(young or ()),
        }
        reply_future = helper_for(repo).send(message, fd)
    finally:
        os.close(fd)  # the helper holds its own duplicate
    try:
        while True:
            flags[BUSY] = 1 if pause() else 0
            flags[STOP] = 1 if stop() else 0
            try:
                reply = reply_future.result(timeout=POLL)
                break
            except FutureTimeout:
                continue
    finally:
        flags.close()
    if "error" in reply:
        raise reply["error"]
    report: dict[str, Any] = reply["report"]
    return report
