"""Kill points of a push: every call a push makes that changes the destination (its backend's
puts and streamed pack writes, its index's session, pins, pack rows, commits and tags) and the
source's record of what the remote holds, counted in the order they happen.

:func:`push_in_child` forks a child (torch is imported already: no start-up cost) that opens the
source store afresh and pushes to remote ``origin`` with these calls wrapped. Traced (``kill_at``
None), the child writes the list of events it saw to a file; armed, it SIGKILLs itself just
before or just after event number ``kill_at`` (no ``finally``, no atexit: what a power cut or the
OOM killer leaves). A point chosen from a trace that the armed child never reaches fails the test.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import threading
from pathlib import Path
from typing import Any

from ckstore.objects.wrappers import WrappingBackend

DEST_INDEX_CALLS = (
    "begin_session",
    "lookup_chunks",
    "add_pack",
    "commit_snapshot",
    "end_session",
    "set_tag",
)
SOURCE_INDEX_CALLS = ("mark_pushed",)


class Arm:
    """Counts events; kills the process at event ``kill_at`` (``when``: before or after it)."""

    def __init__(self, kill_at: int | None, when: str = "after") -> None:
        self.kill_at, self.when = kill_at, when
        self.events: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, event: str, call: Any) -> Any:
        with self._lock:
            self.events.append(event)
            n = len(self.events)
        if n == self.kill_at and self.when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        result = call()
        if n == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return result


class _Backend(WrappingBackend):
    def __init__(self, inner: Any, arm: Arm) -> None:
        super().__init__(inner)
        self.arm = arm

    def put(self, name: str, data: Any) -> bool:
        return self.arm(f"put {name.split('/', 1)[0]}", lambda: self.inner.put(name, data))

    def writer(self, direct: bool = False) -> Any:
        return _Writer(self.inner.writer(direct), self.arm)


class _Writer:
    def __init__(self, inner: Any, arm: Arm) -> None:
        self.inner, self.arm = inner, arm
        self.holds_data = inner.holds_data

    def write(self, data: Any) -> Any:
        return self.arm("pack write", lambda: self.inner.write(data))

    def patch(self, offset: int, data: Any) -> Any:
        return self.inner.patch(offset, data)

    def commit(self, name: str) -> Any:
        return self.arm("put packs", lambda: self.inner.commit(name))

    def abort(self) -> Any:
        return self.inner.abort()


def instrument(repo: Any, arm: Arm, calls: tuple[str, ...]) -> None:
    """Route ``repo``'s backend and the index methods ``calls`` through ``arm``."""
    repo.objects._backend = _Backend(repo.objects.backend, arm)
    for name in calls:
        real = getattr(repo.index, name)
        setattr(
            repo.index,
            name,
            lambda *a, _n=name, _r=real, **k: arm(f"index.{_n}", lambda: _r(*a, **k)),
        )


def instrument_remotes(arm: Arm) -> None:
    """Route every remote this process opens (``config.open_or_create``) through ``arm``: its
    backend and the index methods a push calls there."""
    from ckstore.remote import config

    real_open = config.open_or_create

    def open_or_create(index: Any, record: Any, like: Any) -> Any:
        repo, created = real_open(index, record, like)
        instrument(repo, arm, DEST_INDEX_CALLS)
        return repo, created

    config.open_or_create = open_or_create  # type: ignore[assignment]


def _child(src: str, kill_at: int | None, when: str, trace: str | None, refs: list[str]) -> None:
    import ckstore

    arm = Arm(kill_at, when)
    store = ckstore.open(src)
    instrument_remotes(arm)
    for name in SOURCE_INDEX_CALLS:
        real = getattr(store.repository.index, name)
        setattr(
            store.repository.index,
            name,
            lambda *a, _n=name, _r=real, **k: arm(f"src.{_n}", lambda: _r(*a, **k)),
        )
    store.push("origin", refs)
    if trace is not None:
        Path(trace).write_text(json.dumps(arm.events))
    os._exit(0 if kill_at is None else 3)  # 3: the armed point was never reached


def push_in_child(
    src: Path,
    *,
    kill_at: int | None = None,
    when: str = "after",
    trace: Path | None = None,
    refs: tuple[str, ...] = (),
    timeout: float = 120,
) -> int | None:
    """Push ``src`` to its remote ``origin`` in a forked child (module docstring); its exit code
    (``-SIGKILL`` when killed)."""
    ctx = multiprocessing.get_context("fork")
    proc = ctx.Process(
        target=_child,
        args=(str(src), kill_at, when, None if trace is None else str(trace), list(refs)),
    )
    proc.start()
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()
        raise AssertionError(f"the push of {src} hung (kill point {kill_at} {when})")
    return proc.exitcode
