"""Helper processes of a repository handle: work that must not share the training process's
GIL (an ``async_take``'s hashing and writing, ``engine/take/offload.py``; the compaction after
takes, ``history/compact_process.py``) runs in a process of its own, at the lowest CPU priority.

One helper per repository handle and server module (:func:`helper_for`), started on its first
job (``python -m SERVER FD``: a Unix socket at FD, a session of its own so a terminal's Ctrl-C
reaches the training process alone, which waits for its jobs), stopped when the repository
closes. Jobs run one at a time, in order: a message is a pickled dict, with descriptors passed
alongside (``SCM_RIGHTS``), and so is each reply. The helper's side is :func:`serve`: it opens
the store each job names (kept open while jobs name the same one) and replies with what the
server's function returns, or the error. If the helper dies, the job in flight fails with
:class:`~ckstore.errors.StorageError` and the next job starts a new helper; if the training
process dies, the helper finishes the job in flight and exits.
"""

from __future__ import annotations

import os
import pickle
import socket
import struct
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from ..errors import StorageError, UnsupportedValueError
from .opening import open_repository
from .repository import Repository

HEADER = struct.Struct("<Q")


class Helper:
    """A helper process of ``repo`` that runs ``server`` (``python -m server FD``, FD a Unix
    socket; :func:`serve` on its side) and its jobs one at a time, in order. For messages:
    ``job`` names one job (``"take"``), ``on_death`` what a job in flight leaves when the
    helper dies."""

    def __init__(self, repo: Repository, server: str, job: str, on_death: str) -> None:
        self._repo = repo
        self._server, self._job, self._on_death = server, job, on_death
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._waiting: deque[Future[dict[str, Any]]] = deque()
        self._owner = os.getpid()  # a forked child inherits this object, not the helper

    @property
    def pid(self) -> int | None:
        """The helper process's id while one runs."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def start(self) -> None:
        """Start the helper process now if none runs (its imports then overlap training)."""
        if self._owner != os.getpid():
            self._forget_parents()
        with self._lock:
            self._running()

    def send(self, message: dict[str, Any] | bytes, fd: int) -> Future[dict[str, Any]]:
        """Send one job (or the bytes :func:`encode` made of it) with the descriptor ``fd``
        (duplicated into the helper); its reply, once the helper is done.

        Raises:
            UnsupportedValueError: the job cannot be encoded (nothing was sent).
            StorageError: the helper could not be reached (it is stopped; the next job starts
                a new one).
        """
        future: Future[dict[str, Any]] = Future()
        if self._owner != os.getpid():
            self._forget_parents()
        if not isinstance(message, bytes):
            message = encode(message)  # before its reply is awaited: one that fails leaves none
        with self._lock:
            sock = self._running()
            self._waiting.append(future)
            try:
                send(sock, message, [fd])
            except OSError as exc:
                self._waiting.remove(future)
                self._stop()
                raise StorageError(
                    f"the helper process of {self._repo.url} took no {self._job} ({exc}); "
                    f"the next {self._job} starts a new helper"
                ) from exc
        return future

    def _running(self) -> socket.socket:
        if self._sock is not None and self._proc is not None and self._proc.poll() is None:
            return self._sock
        self._stop()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        root = str(Path(__file__).resolve().parents[2])  # this ckstore, wherever it was imported
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(p for p in [root, os.environ.get("PYTHONPATH", "")] if p),
        }
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", self._server, str(theirs.fileno())],
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
                    f"the helper process of {self._repo.url} exited before this {self._job} was "
                    f"done; {self._on_death}; the next {self._job} starts a new helper"
                )
            )

    def _forget_parents(self) -> None:
        """In a forked child: let go of the parent's helper without touching it (a shutdown
        of the socket both share would end it for the parent; its replies are the
        parent's), and of a lock a thread of the parent may have held at the fork."""
        self._lock = threading.Lock()
        sock, self._sock, self._proc = self._sock, None, None
        self._waiting = deque()
        self._owner = os.getpid()
        if sock is not None:
            sock.close()  # this process's descriptor only

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
        if self._owner != os.getpid():
            self._forget_parents()
            return
        with self._lock:
            waiting = list(self._waiting)
        for future in waiting:
            future.exception()
        with self._lock:
            proc = self._proc
            self._stop()
        if proc is not None:
            proc.wait()


def helper_for(repo: Repository, server: str, job: str, on_death: str) -> Helper:
    """The repository's :class:`Helper` that runs ``server`` (made on first use, stopped when
    the repository closes): one per repository handle and server module."""
    key = (id(repo), server)
    with _HELPERS_LOCK:
        helper = _HELPERS.get(key)
        if helper is None:
            helper = _HELPERS[key] = Helper(repo, server, job, on_death)

            def close() -> None:
                with _HELPERS_LOCK:
                    _HELPERS.pop(key, None)
                helper.close()

            repo.before_close.append(close)
        return helper


_HELPERS: dict[tuple[int, str], Helper] = {}
_HELPERS_LOCK = threading.Lock()


# ---------------------------------------------------------------------------------------------
# the wire: a length, then a pickle (between this process and its own helper only)


def encode(message: Any) -> bytes:
    """``message`` as :func:`send` sends it: encoded now, so the values it holds are those of
    this moment, whatever their owner does to them after.

    Raises:
        UnsupportedValueError: something in it cannot go to another process (a class defined
            inside a function, a lock).
    """
    try:
        return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise UnsupportedValueError(
            f"a message for the helper process cannot be encoded: {exc}"
        ) from exc


def send(sock: socket.socket, message: Any, fds: Sequence[int] = ()) -> None:
    """Send ``message`` (or the bytes :func:`encode` made of it) and the descriptors ``fds``
    (duplicated into the receiver)."""
    data = message if isinstance(message, bytes) else encode(message)
    socket.send_fds(sock, [HEADER.pack(len(data))], list(fds))
    sock.sendall(data)


def receive(sock: socket.socket) -> tuple[Any, list[int]]:
    """One message and the descriptors that came with it; EOFError at the end."""
    data, fds = _frame(sock)
    return pickle.loads(data), fds


def _frame(sock: socket.socket) -> tuple[bytes, list[int]]:
    """The bytes of one message, not decoded, and the descriptors that came with it; EOFError
    at the end."""
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
    return bytes(data), fds


def serve(fd: int, run: Callable[[Repository, dict[str, Any], int], dict[str, Any]]) -> None:
    """A helper's loop (its ``__main__``): for each job, ``run(repo, message, fd)`` with the
    repository the job names (``message["open"]``) and the descriptor sent with it; its
    result, or the error, is the reply. Ends when the training process hangs up."""
    lowest_priority()
    sock = socket.socket(fileno=fd)
    repo: Repository | None = None
    opened: dict[str, Any] | None = None
    while True:
        try:
            data, fds = _frame(sock)
        except (EOFError, OSError):
            break
        try:  # a job this process cannot decode is that job's error, not the helper's end
            message = pickle.loads(data)
            if repo is None or message["open"] != opened:
                if repo is not None:
                    repo.close()
                how = message["open"]
                repo = open_repository(
                    how["url"], index=how.get("index"), storage_options=how.get("storage_options")
                )
                opened = how
            reply = run(repo, message, fds[0])
        except BaseException as exc:  # noqa: BLE001 - sent to the training process
            reply = {"error": portable(exc)}
        finally:
            for f in fds:
                os.close(f)
        try:
            send(sock, reply)
        except OSError:
            break
    if repo is not None:
        repo.close()


def portable(exc: BaseException) -> BaseException:
    """``exc``, or a StorageError with its text where it does not survive pickling."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - any failure: send its text instead
        return StorageError(f"{type(exc).__name__}: {exc}")
    return exc


AUTOGROUP = "/proc/self/autogroup"


def lowest_priority() -> None:
    """Put this process (a helper: a session of its own) at the lowest CPU priority: nice 19
    for every thread it starts, and the same for its autogroup. Where the kernel groups
    processes by session (``sched_autogroup_enabled``, sched(7)), a new session is a new group
    that the scheduler weighs against the training process's group as an equal, whatever its
    threads' nice values; the group's own nice value is what puts it behind training (raising
    it needs no privilege). Either may be refused; the helper then runs as it is."""
    try:
        os.nice(19)
    except OSError:
        pass
    try:
        with open(AUTOGROUP, "w") as f:
            f.write("19")
    except OSError:
        pass
