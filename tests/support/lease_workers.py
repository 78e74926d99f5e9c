"""Child processes for the lease tests (tests/history/test_lease_pauses.py).

``stall WHERE URL INDEX GO``: one take that stalls inside an index transaction of its own, after
that transaction's lease check: it waits (its lease still beating) until the file GO exists,
then enters the transaction and stops itself (SIGSTOP) there, as a suspended laptop or a job
stopped by its scheduler would. WHERE is ``commit`` (the commit of the snapshot),
``add-pack`` (the recording of its first pack) or ``compaction`` (three takes, then a
compaction that stalls in the switch of their chunks to its dense pack). Prints ``committed <id>`` or ``failed <error>``.

``behind URL INDEX SECONDS GO``: see :func:`behind`.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import ckstore
from ckstore.index import _commit, compaction
from tests.support.gc_workers import open_store, state_for


def stall(where: str, url: str, index: str, go: str) -> int:
    store = open_store(url, index)
    if where == "compaction":  # committed snapshots in loose packs, then their compaction
        for step in (1, 2, 3):
            store.take({"s": ckstore.StateDict(state_for(step))}, run="stalled", step=step)
    method, module, hooked = {
        "commit": ("commit_snapshot", _commit, "require_chunks"),
        "add-pack": ("add_pack", _commit, "add_pack"),
        "compaction": ("rewrite_chunks", compaction, "_lock_rows"),
    }[where]
    real_call = getattr(store.repository.index, method)
    real_inner = getattr(module, hooked)
    stopped = []

    def call_when_told(*args: Any, **kwargs: Any) -> Any:
        open(go + ".waiting", "w").close()
        while not os.path.exists(go):
            time.sleep(0.02)
        return real_call(*args, **kwargs)

    def inner_then_stop(*args: Any, **kwargs: Any) -> Any:
        if not stopped:  # inside the transaction, its lease checked
            stopped.append(True)
            os.kill(os.getpid(), signal.SIGSTOP)
        return real_inner(*args, **kwargs)

    setattr(store.repository.index, method, call_when_told)
    setattr(module, hooked, inner_then_stop)
    try:
        if where == "compaction":
            report = store.compact(keep_loose=0)
            print(f"compacted {report.chunks}")
            return 0
        snap = store.take({"s": ckstore.StateDict(state_for(1))}, run="stalled", step=1)
    except ckstore.CkstoreError as exc:
        print(f"failed {type(exc).__name__}: {exc}")
        return 3
    print(f"committed {snap.id}")
    return 0


def behind(url: str, index: str, seconds_behind: float, go: str) -> int:
    """``behind URL INDEX SECONDS GO``: a take on a host whose clock runs SECONDS behind (this
    process only); its first pack, durable, is recorded only once the file GO exists (its
    lease beating meanwhile), and ``GO.waiting`` says it is there."""
    real_time = time.time
    time.time = lambda: real_time() - seconds_behind  # type: ignore[assignment]
    store = open_store(url, index)
    real_add = store.repository.index.add_pack

    def add_when_told(*args: Any, **kwargs: Any) -> Any:
        open(go + ".waiting", "w").close()
        while not os.path.exists(go):
            time.sleep(0.02)
        return real_add(*args, **kwargs)

    store.repository.index.add_pack = add_when_told  # type: ignore[method-assign]
    try:
        snap = store.take({"s": ckstore.StateDict(state_for(1))}, run="behind", step=1)
    except ckstore.CkstoreError as exc:
        print(f"failed {type(exc).__name__}: {exc}")
        return 3
    print(f"committed {snap.id}")
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "behind":
        sys.exit(behind(sys.argv[2], sys.argv[3], float(sys.argv[4]), sys.argv[5]))
    sys.exit(stall(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]))
