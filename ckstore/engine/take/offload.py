"""Async takes finished in a helper process, fed through shared memory (``background_process``).

The training loop's bench phase (each step's extra time split with schedstat) showed a
one-thread CPU trainer sleeping 47 to 101 ms a step after an async take, where DCP's and
``torch.save``'s threads cost under 3 ms: the take's background threads hold the GIL for their
Python between the C calls that hash, encode and write (at nice 19, a holder the kernel
preempts keeps the trainer waiting the longer). A process of its own shares no GIL with the
trainer: the training process only copies the state into shared memory and plans the take (as
it does for a thread), and a helper process, at the lowest CPU priority, stores that copy with
the ordinary take (:func:`single.take`). Off by default: on a shared, heavily loaded machine
the bench's ``ckstore-process`` system has not yet shown the steps after a take to lose less
(the compaction after takes stays in the training process).

One helper per repository handle, started on its first offloaded take (``python -m
ckstore.engine.take.offload_server FD``, the helper's side: a Unix socket at FD, a session of its own so a terminal's
Ctrl-C reaches the training process alone, which waits for its takes), stopped when the
repository closes. Jobs run one at a time, in order. A job is a pickled dict (the store to
open, the knobs, the spec, each app's tree and leaves, the staged tensors as offsets into the
arena) with the arena's memfd passed alongside (``SCM_RIGHTS``); the reply holds the committed
record and manifest and the warnings the take raised (re-raised here), or the error. The
helper commits: the training process then tells its repository (compaction and pushes follow
here, as after any take). If the helper dies, the take in flight fails and the next one starts
a new helper; if the training process dies, the helper finishes the take in flight (committed
or aborted whole, as any take) and exits.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import socket
import struct
import subprocess
import sys
import threading
import warnings
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ... import errors
from ...errors import StorageError
from ...format.manifest import Manifest
from ...format.tree import Flat
from ..repository import Repository
from .spec import TakeSpec
from .staging import StagingArena

HEADER = struct.Struct("<Q")
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
    if repo.index.remote_pack_ids():
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
) -> dict[str, Any]:
    """The message that has the helper take ``flats`` (staged in ``arena``) as ``spec`` says."""
    return {
        "open": {"url": repo.url, **repo.opened_with},
        "knobs": {"threads": threads, **{k: getattr(repo, k) for k in KNOBS}},
        "spec": {
            **{f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)},
            "metadata": dict(spec.metadata),
        },
        "apps": {
            name: (flat.tree, {k: _describe(arena, v) for k, v in flat.leaves.items()})
            for name, flat in flats.items()
        },
        "size": arena.size,
    }


def _describe(arena: StagingArena, value: Any) -> Any:
    """A leaf as the helper rebuilds it: a staged tensor or array as where it is in the arena."""
    if isinstance(value, torch.Tensor):
        return Staged(
            "torch", str(value.dtype).removeprefix("torch."), value.shape, arena.offset_of(value)
        )
    if isinstance(value, np.ndarray):
        return Staged("numpy", value.dtype.str, value.shape, arena.offset_of(value))
    return value


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


class Helper:
    """The helper process that finishes ``repo``'s offloaded takes (see the module docstring)."""

    def __init__(self, repo: Repository) -> None:
        self._repo = repo
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._waiting: deque[Future[dict[str, Any]]] = deque()

    @property
    def pid(self) -> int | None:
        """The helper process's id while one runs."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def start(self) -> None:
        """Start the helper process now if none runs (its imports then overlap training)."""
        with self._lock:
            self._running()

    def submit(self, message: dict[str, Any], arena: StagingArena) -> Future[dict[str, Any]]:
        """Send one job (the copies in ``arena``, a shared one); its reply, once the helper is
        done.

        Raises:
            InvalidInputError: ``arena`` is not shared.
            StorageError: the helper could not be reached (it is stopped; the next job starts
                a new one).
        """
        if arena.fd is None:
            raise errors.InvalidInputError(
                "only copies in a shared staging arena can go to the helper process; "
                "this take should have finished in a thread (a bug: please report it)"
            )
        fd = arena.fd
        future: Future[dict[str, Any]] = Future()
        with self._lock:
            sock = self._running()
            self._waiting.append(future)
            try:
                send(sock, message, [fd])
            except OSError as exc:
                self._waiting.remove(future)
                self._stop()
                raise StorageError(
                    f"the helper process of {self._repo.url} took no take ({exc}); the next "
                    "async take starts a new one"
                ) from exc
        return future

    def _running(self) -> socket.socket:
        if self._sock is not None and self._proc is not None and self._proc.poll() is None:
            return self._sock
        self._stop()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        root = str(Path(__file__).resolve().parents[3])  # this ckstore, wherever it was imported
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(p for p in [root, os.environ.get("PYTHONPATH", "")] if p),
        }
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", f"{__package__}.offload_server", str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                start_new_session=True,
                env=env,
            )
        finally:
            theirs.close()
        self._sock = ours
        threading.Thread(
            target=self._replies, args=(ours,), name="ckstore-helper", daemon=True
        ).start()
        return ours

    def _replies(self, sock: socket.socket) -> None:
        """Resolve each waiting take with its reply, in order; fail them all on EOF."""
        while True:
            try:
                reply, _ = receive(sock)
            except (OSError, EOFError, pickle.UnpicklingError):
                reply = None
            with self._lock:
                if reply is None or not self._waiting:
                    waiting, self._waiting = self._waiting, deque()
                    if self._sock is sock:
                        self._stop()
                    break
                future = self._waiting.popleft()
            future.set_result(reply)
        for future in waiting:
            future.set_exception(
                StorageError(
                    f"the helper process that finishes async takes of {self._repo.url} exited "
                    "before this take was done; nothing was committed for it, and the next "
                    "async take starts a new helper"
                )
            )

    def _stop(self) -> None:
        sock, self._sock = self._sock, None
        proc, self._proc = self._proc, None
        if sock is not None:
            try:  # wakes the thread reading replies, and the helper sees EOF (closing alone
                sock.shutdown(socket.SHUT_RDWR)  # does neither while a read is in flight)
            except OSError:
                pass
            sock.close()  # the helper exits once its take in flight is done
        if proc is not None:
            threading.Thread(target=proc.wait, daemon=True).start()  # reaped when it exits

    def close(self) -> None:
        """Stop the helper once the takes sent to it are done (it finishes them first)."""
        with self._lock:
            waiting = list(self._waiting)
        for future in waiting:
            future.exception()
        with self._lock:
            proc = self._proc
            self._stop()
        if proc is not None:
            proc.wait()


def helper_for(repo: Repository) -> Helper:
    """The repository's helper (made on first use, stopped when the repository closes)."""
    with _HELPERS_LOCK:
        helper = _HELPERS.get(id(repo))
        if helper is None:
            helper = _HELPERS[id(repo)] = Helper(repo)

            def close() -> None:
                with _HELPERS_LOCK:
                    _HELPERS.pop(id(repo), None)
                helper.close()

            repo.before_close.append(close)
        return helper


_HELPERS: dict[int, Helper] = {}
_HELPERS_LOCK = threading.Lock()


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


# ---------------------------------------------------------------------------------------------
# the wire: a length, then a pickle (between this process and its own helper only)


def send(sock: socket.socket, message: Any, fds: Sequence[int] = ()) -> None:
    """Send ``message`` and the descriptors ``fds`` (duplicated into the receiver)."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    socket.send_fds(sock, [HEADER.pack(len(data))], list(fds))
    sock.sendall(data)


def receive(sock: socket.socket) -> tuple[Any, list[int]]:
    """One message and the descriptors that came with it; EOFError at the end."""
    head, fds, _, _ = socket.recv_fds(sock, HEADER.size, 4)
    while head and len(head) < HEADER.size:
        more = sock.recv(HEADER.size - len(head))
        if not more:
            break
        head += more
    if len(head) < HEADER.size:
        for fd in fds:
            os.close(fd)
        raise EOFError
    (n,) = HEADER.unpack(head)
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(min(n - len(data), 1 << 20))
        if not chunk:
            raise EOFError
        data += chunk
    return pickle.loads(data), fds
