"""A child forked while its parent's background compaction runs (a DataLoader worker, a
launcher forking its ranks) and that goes on with the parent's store handle. Its
``compact()`` (and ``gc()`` after a ``delete()``, ``wait_compacted()``) wait for the handle's
compactor to go idle; the compactor's thread is the parent's and does not exist in the
child, so before they waited forever."""

from __future__ import annotations

import multiprocessing
import threading
from pathlib import Path

import torch

import ckstore


def _child(store: ckstore.Store) -> None:
    report = store.compact()  # the child's own compaction, here and now
    assert store.wait_compacted(timeout=5)
    store.delete("r@1")
    store.gc(grace_seconds=0)
    assert report is not None and store.check(read_data=True).ok


def test_a_forked_child_compacts_and_collects_through_the_inherited_handle(
    tmp_path: Path,
) -> None:
    store = ckstore.open(tmp_path / "store", chunk_bytes=1024, pack_bytes=4096, create=True)
    for step in (1, 2):
        store.take(
            {"s": ckstore.StateDict(w=torch.full((64, 64), float(step)))}, run="r", step=step
        )
    compactor = store._compactor  # noqa: SLF001 - the parent's compaction, held at the fork
    inside, release = threading.Event(), threading.Event()

    def busy() -> None:
        inside.set()
        release.wait(60)

    compactor._compact_pending = busy  # type: ignore[method-assign]  # noqa: SLF001
    compactor.kick()
    assert inside.wait(10)
    proc = multiprocessing.get_context("fork").Process(target=_child, args=(store,))
    proc.start()
    proc.join(30)
    hung = proc.is_alive()
    if hung:
        proc.kill()
        proc.join()
    release.set()
    store.close()
    assert not hung, "the forked child waited forever for its parent's compactor"
    assert proc.exitcode == 0
    with ckstore.open(tmp_path / "store") as again:
        assert [s.step for s in again.log()] == [2]
        assert torch.equal(again.get("r@2").read_object("s/w"), torch.full((64, 64), 2.0))
        assert again.check(read_data=True).ok
