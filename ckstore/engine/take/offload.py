"""Async takes finished in a helper process, fed through shared memory (``background_process``).

The training loop's bench phase (each step's extra time split with schedstat) showed a
one-thread CPU trainer sleeping 47 to 101 ms a step after an async take, where DCP's and
``torch.save``'s threads cost under 3 ms: the take's background threads hold the GIL for their
Python between the C calls that hash, encode and write (at nice 19, a holder the kernel
preempts keeps the trainer waiting the longer). A process of its own shares no GIL with the
trainer: the training process only copies the state into shared memory and plans the take (as
it does for a thread), and a helper process, at the lowest CPU priority, stores that copy with
the ordinary take (:func:`single.take`). Off by default: on a shared, heavily loaded machine
the bench's ``ckstore-process`` system has not yet shown the steps after a take to lose less.

One helper per repository handle (``engine/helper.py``: started on its first offloaded take,
stopped when the repository closes; its side is ``offload_server.py``). A job is the store to
open, the knobs, the spec, each app's tree and leaves, the staged tensors as offsets into the
arena, with the arena's memfd passed alongside; the reply holds the committed record and
manifest and the warnings the take raised (re-raised here), or the error. The helper commits:
the training process then tells its repository (pushes follow here, as after any take; the
compaction after it runs in a helper of its own, ``history/compact_process.py``). If the helper
dies, the take in flight fails and the next one starts a new helper; if the training process
dies, the helper finishes the take in flight (committed or aborted whole, as any take) and
exits.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import warnings
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch

from ... import errors
from ...format.manifest import Manifest
from ...format.tree import Flat
from ...format.values import decode_value, encode_value
from .. import helper
from ..helper import Helper
from ..repository import Repository
from .spec import TakeSpec
from .staging import StagingArena

SERVER = f"{__package__}.offload_server"
"""The module the helper that finishes async takes runs (``engine/helper.py``)."""

KNOBS = ("io_threads", "lease_seconds", "delta_depth", "take_codec")
"""Knobs of the training process's repository the helper's repository takes with (and
``threads``, set to the background threads)."""


def unavailable(repo: Repository) -> str | None:
    """Why a take into ``repo`` cannot be offloaded (None: it can): the helper must reopen the
    store and its index, and pass memory by file descriptor (Linux)."""
    if not hasattr(os, "memfd_create") or not hasattr(socket, "send_fds"):
        return "no memfd or descriptor passing on this platform"
    if repo.read_only:
        return "the store is read-only"
    index = repo.opened_with.get("index") or ""
    if repo.url.startswith("memory://") or ":memory:" in index:
        return "an in-memory store or index lives in this process alone"
    if repo.reads.remote_pack_ids():
        return "chunks were evicted to a remote tier, which only this process reads through"
    return None


def shareable(flats: Mapping[str, Flat], arena: StagingArena, live: set[str]) -> bool:
    """Whether a take of ``flats`` staged in ``arena`` can go to the helper: everything was
    copied (nothing past the budget), into a shared arena, each tensor cut from it."""
    if not arena.shared or live:
        return False
    return all(
        arena.offset_of(v) is not None
        for flat in flats.values()
        for v in flat.leaves.values()
        if isinstance(v, (torch.Tensor, np.ndarray))
    )


def job(
    repo: Repository,
    spec: TakeSpec,
    flats: Mapping[str, Flat],
    arena: StagingArena,
    threads: int,
) -> bytes | None:
    """The message that has the helper take ``flats`` (staged in ``arena``) as ``spec`` says,
    encoded at once, so the plain values it holds (a list, a ``bytearray`` the training loop
    changes after the call) are those of the call; None if one of them cannot go to another
    process (the take then finishes in a thread of this one)."""
    message = {
        "open": {"url": repo.url, **repo.opened_with},
        "knobs": {"threads": threads, **{k: getattr(repo, k) for k in KNOBS}},
        "spec": {
            **{f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)},
            "metadata": dict(spec.metadata),
        },
        "apps": {
            name: (flat.tree, {k: _describe(arena, k, v) for k, v in flat.leaves.items()})
            for name, flat in flats.items()
        },
        "size": arena.size,
    }
    try:
        return helper.encode(message)
    except errors.UnsupportedValueError:
        return None


def _describe(arena: StagingArena, key: str, value: Any) -> Any:
    """A leaf as the helper rebuilds it: a staged tensor or array as where it is in the arena,
    a plain value as the snapshot stores it (builtin types: an ``IntEnum`` of the training
    script's ``__main__`` is its int, which the helper process can unpickle, and stores the same
    way)."""
    if isinstance(value, torch.Tensor):
        return Staged(
            "torch", str(value.dtype).removeprefix("torch."), value.shape, arena.offset_of(value)
        )
    if isinstance(value, np.ndarray):
        return Staged("numpy", value.dtype.str, value.shape, arena.offset_of(value))
    return decode_value(encode_value(value, key))


@dataclasses.dataclass(frozen=True)
class Staged:
    """A staged tensor or array as the helper process finds it: at ``offset`` in the arena."""

    kind: str
    dtype: str
    shape: tuple[int, ...]
    offset: int | None

    def view(self, mem: Any) -> Any:
        """The tensor or array over ``mem`` (the arena, mapped in the helper process)."""
        count = int(np.prod(self.shape, dtype=np.int64))
        if self.kind == "numpy":
            dtype = np.dtype(self.dtype)
            return np.frombuffer(mem, dtype=dtype, count=count, offset=self.offset or 0).reshape(
                self.shape
            )
        dtype = getattr(torch, self.dtype)
        if count == 0:
            return torch.empty(self.shape, dtype=dtype)
        return torch.frombuffer(mem, dtype=dtype, count=count, offset=self.offset or 0).view(
            self.shape
        )


def result_of(reply: dict[str, Any]) -> tuple[Any, Manifest]:
    """The committed ``(record, manifest)`` of a reply, after re-raising the take's warnings;
    raises the take's error."""
    for category, message in reply.get("warnings", ()):
        cls = getattr(errors, category, None)
        warnings.warn(
            cls(message) if isinstance(cls, type) and issubclass(cls, Warning) else message,
            stacklevel=2,
        )
    if "error" in reply:
        raise reply["error"]
    return reply["record"], Manifest.from_json(reply["manifest"])


def helper_for(repo: Repository) -> Helper:
    """The repository's helper that finishes its offloaded takes (``engine/helper.py``)."""
    return helper.helper_for(repo, SERVER, "take", "nothing was committed for it")


def submit(repo: Repository, message: bytes, arena: StagingArena) -> Future[dict[str, Any]]:
    """Send one take (the copies in ``arena``, a shared one) to ``repo``'s helper; its reply,
    once the helper is done.

    Raises:
        InvalidInputError: ``arena`` is not shared.
        StorageError: the helper could not be reached (it is stopped; the next take starts a
            new one).
    """
    if arena.fd is None:
        raise errors.InvalidInputError(
            "only copies in a shared staging arena can go to the helper process; "
            "this take should have finished in a thread (a bug: please report it)"
        )
    return helper_for(repo).send(message, arena.fd)
