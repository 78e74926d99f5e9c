"""A write session's lease, kept alive by a heartbeat thread while a take runs.

GC trusts a lease only while it is fresh (reliability contract I4): a take that stops beating
(paused, partitioned) loses its pins and then fails at commit with LeaseExpiredError.

A take ends its lease when it leaves, whatever the reason (an error, Ctrl-C's
KeyboardInterrupt), so gc may reclaim what it wrote at once. SIGTERM (a scheduler preempting
the job, ``docker stop``, ``kill``) used to end the process on the spot and leave the lease,
and what the take had written, held until it ran out. So while a lease is held, ckstore
handles SIGTERM in the main thread, if nothing else does: the handler raises
:class:`Terminated` (a ``SystemExit`` with code 143, the shell's code for SIGTERM), the take
unwinds and ends its lease as on Ctrl-C, and the process exits with that code. It is installed
only when the main thread begins a lease and SIGTERM has its default action, put back when the
last lease ends (or at the first SIGTERM, so a second one kills at once), and never replaces a
handler of the program's own: that handler stays in charge.

A process that exits without closing its store (its main thread returns while a background
compaction, an ``async_take`` or a push still runs in a daemon thread) used to leave those
sessions active until their leases ran out. At interpreter exit ckstore ends every session this
process still holds, as aborted: the same as the lease running out at that moment, which
every write that records anything checks. A process that never gets there (SIGKILL, a crash)
is recognised by gc on its own host: a session's owner says where its pid means something
(:func:`owner`), and gc expires the sessions of processes that are gone (:func:`gone`).
"""

from __future__ import annotations

import atexit
import functools
import os
import re
import signal
import socket
import threading
import time
from types import FrameType
from typing import TYPE_CHECKING

from ..errors import CkstoreError, LeaseExpiredError

if TYPE_CHECKING:
    from .interfaces import LeaseIndex


class Lease:
    """Context manager: begin a session, heartbeat every ``seconds / 3``, end it on exit.

    With ``eager=False`` the session begins in the heartbeat thread, beside the caller's own
    work (a take plans and hashes meanwhile): :attr:`id` waits for it, and raises what beginning
    it raised. A small take saves its first index transaction's time that way.
    """

    def __init__(self, index: LeaseIndex, seconds: float, eager: bool = True) -> None:
        self._index = index
        self._seconds = seconds
        self._eager = eager
        self._stop = threading.Event()
        self._begun = threading.Event()
        self._thread: threading.Thread | None = None
        self._id = ""
        self._failed: BaseException | None = None
        self._pid = os.getpid()
        self.error: CkstoreError | None = None
        self.committed = False

    @property
    def id(self) -> str:
        """The session's id (waits until the session has begun)."""
        self._begun.wait()
        if self._failed is not None:
            raise self._failed
        return self._id

    def __enter__(self) -> Lease:
        if self._eager:
            self._begin()
            if self._failed is not None:
                raise self._failed
        _arm(self)
        self._thread = threading.Thread(target=self._beat, name="ckstore-lease", daemon=True)
        self._thread.start()
        return self

    def _begin(self) -> None:
        try:
            self._id = self._index.begin_session(owner(), self._seconds).id
        except BaseException as exc:  # noqa: BLE001 - raised to the caller by id (or __enter__)
            self._failed = exc
        finally:
            self._begun.set()

    def _beat(self) -> None:
        if not self._begun.is_set():
            self._begin()
        if self._failed is not None:
            return
        renewed = time.monotonic()
        while not self._stop.wait(self._seconds / 3):
            try:
                self._index.heartbeat(self._id, self._seconds)
                renewed = time.monotonic()
            except LeaseExpiredError as exc:  # the commit will fail with the typed error
                self.error = exc
                return
            except CkstoreError as exc:
                # The index out of reach for now (a database restarting, a network blip):
                # beat again while the lease may still run, as the index decides that.
                if time.monotonic() - renewed >= self._seconds:
                    self.error = exc
                    return

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            if not self.committed and self._id:
                try:
                    self._index.end_session(self._id, "aborted")
                except CkstoreError:
                    pass  # the lease simply expires; GC treats it as gone
        finally:
            _disarm(self)

    def abandon(self) -> None:
        """End the session now, from any thread, without waiting for its owner (interpreter
        exit): the heartbeat stops, and every later write of the owner that records anything
        fails its lease check, as if the lease had run out."""
        self._stop.set()
        if self.committed or not self._begun.is_set() or not self._id:
            return
        try:
            self._index.end_session(self._id, "aborted")
        except Exception:  # noqa: BLE001 - at exit: the lease simply runs out instead
            pass


def owner() -> str:
    """This process as the owner of a write session: ``host:pid``, and where the pid is known
    to mean something (Linux: its PID namespace and the boot) ``host:pid (pidns N, boot B)``,
    so that only a gc that sees the same pids judges whether the process is gone."""
    return f"{socket.gethostname()}:{os.getpid()}{_where()}"


@functools.cache
def _where() -> str:
    try:
        pidns = os.stat("/proc/self/ns/pid").st_ino
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        return ""
    return f" (pidns {pidns}, boot {boot})"


_OWNER = re.compile(r"(?P<host>.+):(?P<pid>\d+)(?P<where>( \(pidns \d+, boot [0-9a-f-]+\))?)")


def gone(session_owner: str) -> bool:
    """Whether the process that owns a session is known to be gone: its owner (:func:`owner`)
    names this host and the same PID namespace and boot as this process, and no process has
    its pid. Anything else (another host or container, an owner written otherwise, a pid in
    use, perhaps by another process now) is not known to be gone."""
    m = _OWNER.fullmatch(session_owner)
    if m is None or m["host"] != socket.gethostname() or m["where"] != _where():
        return False
    pid = int(m["pid"])
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # another user's process: alive
        return False
    return False


def exiting() -> bool:
    """Whether this process began to exit: its sessions were ended at interpreter exit, so a
    background job's write that fails its lease check now is that stop, not a fault."""
    return _exiting.is_set()


def _end_at_exit() -> None:
    """At interpreter exit, end the sessions this process still holds (see the module
    docstring); leases a forked child inherited are its parent's, and are left alone."""
    _exiting.set()
    with _guard:
        mine = [lease for lease in _held if lease._pid == os.getpid()]
    for lease in mine:
        lease.abandon()


atexit.register(_end_at_exit)


class Terminated(SystemExit):
    """SIGTERM arrived while a take held its lease: the take unwinds (nothing is committed, its
    lease ends) and the process exits with code 143 (128 + SIGTERM), without a traceback."""

    def __init__(self) -> None:
        super().__init__(128 + signal.SIGTERM)


_held: set[Lease] = set()
_guard = threading.Lock()
_exiting = threading.Event()
_installed = False


def _after_fork_in_child() -> None:
    """A forked child holds none of its parent's leases (they are the parent's to end, and
    ``_end_at_exit`` leaves them alone): counted, the child's last lease out never put
    SIGTERM's default back. A thread of the parent may have held ``_guard`` at the fork."""
    global _guard
    _guard = threading.Lock()
    _held.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    global _installed
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    _installed = False
    if not _held:  # left installed by a lease that ended in another thread: the default action
        os.kill(os.getpid(), signal.SIGTERM)
        return
    raise Terminated()


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _arm(lease: Lease) -> None:
    """Hold ``lease``; from the main thread, install the SIGTERM handler if SIGTERM has its
    default action (a handler of the program's own, or an ignored SIGTERM, is left alone)."""
    global _installed
    with _guard:
        _held.add(lease)
        if (
            _installed
            or not _main_thread()
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        ):
            return
        signal.signal(signal.SIGTERM, _on_sigterm)
        _installed = True


def _disarm(lease: Lease) -> None:
    """Let go of ``lease``; the last one out, in the main thread, puts SIGTERM's default back
    (a lease ended in a background thread leaves that to the next main-thread lease; the
    handler then only turns a SIGTERM into exit code 143 after an orderly unwind)."""
    global _installed
    with _guard:
        _held.discard(lease)
        if _held or not _installed or not _main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _installed = False
