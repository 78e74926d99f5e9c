"""The interleaved rounds: first take, take after 10% changed, restore in place (atomic and, for
ckstore, not), read one tensor, and ckstore's async_take. Within a round every system runs each
scenario before the next scenario starts; the order of the systems rotates every round."""

from __future__ import annotations

import gc
import shutil
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ..harness import Bench
from ..states import READ_KEY, flat_tensors, mutate, scramble
from ..util import dir_bytes, evict, sequential_read, storage_reads

Roots = dict[str, Path]
Handles = dict[str, Any]


def run_rounds(b: Bench) -> None:
    for r in range(b.args.rounds):
        one_round(b, r)
    if "ckstore" in b.systems:
        b.extra["compactions"] = b.ckstore().compactions


def one_round(b: Bench, r: int) -> None:
    order = b.order(r)
    b.log(f"round {r + 1}/{b.args.rounds}: order {', '.join(order)}")
    roots = {n: b.fresh(f"round{r}", n.replace("+", "_")) for n in order}
    handles: Handles = {}
    prepare(b, order, roots)
    first_take(b, order, roots, handles)
    mutate(b.state, b.trainable, seed=1000 + r)
    incremental_take(b, order, roots, handles)
    check_pass_first(b, handles)
    restore_in_place(b, order, handles, verify_it=r == 0)
    restore_nonatomic(b, handles)
    restore_unchecked(b, handles)
    restore_floor(b, handles)
    if r == 0:
        restore_reads(b, handles)
    # the weights alone before the cold phase, in the page cache the takes left, as the
    # restore in place above: a cold read leaves other pages behind (``restore_after_cold``).
    # One tensor is read after it: before it, ckstore's first two reads took 107-117 ms (its
    # new tensor's huge pages faulting in, no I/O) and the third 28 ms, this VM handing free
    # huge pages to its host (objects/memory.huge_memory), not a cost of ckstore's read
    restore_model_only(b, handles)
    restore_cold(b, order, roots, handles)
    restore_after_cold(b, order, handles)
    read_one_tensor(b, order, handles, check=r == 0)
    restore_compacted(b, handles, check=r == 0)
    if b.ok("ckstore"):
        async_take(b, r)
    for n in order:
        try:
            b.systems[n].close(roots[n])
        except Exception:  # noqa: BLE001
            pass
    shutil.rmtree(b.work / f"round{r}", ignore_errors=True)


def prepare(b: Bench, order: list[str], roots: Roots) -> None:
    """Untimed per-system setup; ckstore's store creation is recorded as store_open."""
    for n in order:
        try:
            b.systems[n].prepare(roots[n])
        except Exception as exc:  # noqa: BLE001
            b.fail(n, "prepare", exc)
    if b.ok("ckstore"):
        b.record("store_open", "ckstore", b.ckstore().open_seconds)


def first_take(b: Bench, order: list[str], roots: Roots, handles: Handles) -> None:
    for n in order:
        h = b.timed("first_save", n, partial(b.systems[n].save, b.state, roots[n], 0))
        b.systems[n].settle(roots[n])
        if h is not None:
            handles[n] = h
            b.sizes.setdefault(f"first_save_bytes/{n}", []).append(dir_bytes(roots[n]))
            if n == "ckstore":
                b.extra.setdefault("ckstore_first_stats", []).append(b.ckstore().last_stats)


def incremental_take(b: Bench, order: list[str], roots: Roots, handles: Handles) -> None:
    """A take after one training step on the trainable head (about 10% of the bytes)."""
    for n in order:
        h = b.timed("incremental_save", n, partial(b.systems[n].save, b.state, roots[n], 1))
        b.systems[n].settle(roots[n])
        if h is not None:
            handles[n] = h
            if n == "ckstore":
                b.extra.setdefault("ckstore_incr_stats", []).append(b.ckstore().last_stats)


def restore_in_place(b: Bench, order: list[str], handles: Handles, verify_it: bool) -> None:
    for n in order:
        if not b.ok(n):
            continue
        ptrs = scramble(b.dest)
        b.timed("restore", n, partial(b.systems[n].restore, handles[n], b.dest))
        if b.ok(n) and verify_it:
            verify(b, n, ptrs)


def verify(b: Bench, n: str, ptrs: dict[str, int]) -> None:
    """Record whether ``n`` restored the saved bytes, into the destination's own tensors."""
    flat_src = flat_tensors(b.state)
    flat_dst = flat_tensors(b.dest)
    equal = all(torch.equal(flat_src[k], flat_dst[k]) for k in flat_src)
    in_place = all(flat_dst[k].data_ptr() == p for k, p in ptrs.items() if k in flat_dst)
    b.extra.setdefault("restore_correct", {})[n] = equal
    b.extra.setdefault("restore_in_place", {})[n] = in_place
    if not equal:
        b.log(f"  !! {n}: restored state differs from the saved one")


def restore_nonatomic(b: Bench, handles: Handles) -> None:
    """ckstore only: one pass straight into place, not atomic (untargeted)."""
    if not b.ok("ckstore"):
        return
    ck = b.ckstore()
    scramble(b.dest)
    b.timed(
        "restore_nonatomic", "ckstore", lambda: ck.restore(handles["ckstore"], b.dest, atomic=False)
    )


def restore_unchecked(b: Bench, handles: Handles) -> None:
    """ckstore only: the same restores, atomic and not, with the check of each chunk's decoded
    bytes skipped (a benchmark's switch, never ckstore's), to report the checks' share of each."""
    if not b.ok("ckstore"):
        return
    from ckstore.engine.restore.fetch import unchecked

    ck = b.ckstore()
    scramble(b.dest)
    with unchecked():
        b.timed("restore_unchecked", "ckstore", lambda: ck.restore(handles["ckstore"], b.dest))
    scramble(b.dest)
    with unchecked():
        b.timed(
            "restore_nonatomic_unchecked",
            "ckstore",
            lambda: ck.restore(handles["ckstore"], b.dest, atomic=False),
        )


def check_pass_first(b: Bench, handles: Handles) -> None:
    """ckstore only: the floor's check pass (``floor.py``) once before any restore, in the page
    cache the takes left; :func:`restore_floor` measures it again after the restores."""
    if not b.ok("ckstore"):
        return
    from ..floor import check_pass, snapshot_payloads

    root, ref = handles["ckstore"]
    store = b.ckstore().store(root)
    payloads, _ = snapshot_payloads(store, ref)
    gc.collect()
    b.record("restore_check_pass_first", "ckstore", check_pass(payloads, store.threads))


def restore_floor(b: Bench, handles: Handles) -> None:
    """ckstore only: the floor of its restores here (``floor.py``), measured after them on the
    same snapshot: one check pass and one copy pass over its stored payloads, on its threads."""
    if not b.ok("ckstore"):
        return
    from ..floor import check_pass, copy_pass, snapshot_payloads

    ck = b.ckstore()
    root, ref = handles["ckstore"]
    store = ck.store(root)
    payloads, encoded = snapshot_payloads(store, ref)
    b.sizes.setdefault("floor_encoded_bytes/ckstore", []).append(encoded)
    gc.collect()
    b.record("restore_check_pass", "ckstore", check_pass(payloads, store.threads))
    gc.collect()
    b.record("restore_copy_pass", "ckstore", copy_pass(payloads, store.threads))
    weights, _ = snapshot_payloads(store, ref, prefix="model/")
    gc.collect()
    b.record("restore_model_check_pass", "ckstore", check_pass(weights, store.threads))
    gc.collect()
    b.record("restore_model_copy_pass", "ckstore", copy_pass(weights, store.threads))


def restore_reads(b: Bench, handles: Handles) -> None:
    """ckstore only, untimed: the pack bytes one atomic restore and one restore(atomic=False)
    read from the store (counted at the storage boundary), and the stored bytes they need."""
    if not b.ok("ckstore"):
        return
    from ckstore import objects

    ck = b.ckstore()
    root, ref = handles["ckstore"]
    store = ck.store(root)
    snap = store.get(ref)
    ids = snap.manifest.chunk_ids()
    rows = store.repository.index.chunk_locations(ids)
    stored = sum(rows[c].length for c in ids if c in rows)
    real = store.repository.objects
    counting = objects.CountingBackend(real.backend)
    store.repository.objects = objects.ObjectStore(counting)
    try:
        for atomic in (True, False):
            counting.reset()
            scramble(b.dest)
            ck.restore(handles["ckstore"], b.dest, atomic=atomic)
            read = sum(g.nbytes for g in counting.gets if g.name.startswith("packs/"))
            key = "restore_read_bytes" if atomic else "restore_read_bytes_nonatomic"
            b.sizes.setdefault(f"{key}/ckstore", []).append(read)
        b.sizes.setdefault("restore_stored_bytes/ckstore", []).append(stored)
    finally:
        store.repository.objects = real


def restore_cold(b: Bench, order: list[str], roots: Roots, handles: Handles) -> None:
    """Each system's restore in place with its files evicted from the page cache first (what a
    resume after a failure reads), the bytes it read from the disk (``/proc/self/io``), and
    the sequential read bandwidth of the disk measured on the same files, evicted again.
    ckstore's cold ``restore(atomic=False)`` runs first, so that every system's last cold read
    is its restore in place (what ``restore_after_cold`` follows)."""
    if b.ok("ckstore"):
        ck = b.ckstore()
        scramble(b.dest)
        evict(roots["ckstore"])
        before = storage_reads()
        b.timed(
            "restore_cold_nonatomic",
            "ckstore",
            lambda: ck.restore(handles["ckstore"], b.dest, atomic=False),
        )
        if before >= 0:
            b.sizes.setdefault("cold_read_bytes_nonatomic/ckstore", []).append(
                storage_reads() - before
            )
    for n in order:
        if not b.ok(n):
            continue
        seq_bytes, seq_s = (evict(roots[n]), sequential_read(roots[n]))[1]
        b.extra.setdefault("sequential_read", {}).setdefault(n, []).append(
            seq_bytes / seq_s if seq_s else 0.0
        )
        scramble(b.dest)
        evict(roots[n])
        before = storage_reads()
        b.timed("restore_cold", n, partial(b.systems[n].restore, handles[n], b.dest))
        if before >= 0:
            b.sizes.setdefault(f"cold_read_bytes/{n}", []).append(storage_reads() - before)


def restore_after_cold(b: Bench, order: list[str], handles: Handles) -> None:
    """Each system's warm restore in place right after its own cold restore in place: the
    files are in the page cache again, in the pages that cold read brought in. Linux reads
    ahead into large folios on a plain read or a fault (on file systems that support them),
    but into 4 KiB pages on a ``posix_fadvise(WILLNEED)`` hint, and every later mapping of or
    copy from 4 KiB pages costs more (docs/BENCHMARKS.md; ckstore's atomic restore sends no
    such hints where the disk reads far enough ahead itself)."""
    for n in order:
        if not b.ok(n):
            continue
        scramble(b.dest)
        b.timed("restore_after_cold", n, partial(b.systems[n].restore, handles[n], b.dest))


def restore_model_only(b: Bench, handles: Handles) -> None:
    """The weights alone (``model/**``) restored in place from a snapshot of weights and Adam
    state: ckstore's restore of the ``model`` entry, against reading the same tensors from the
    safetensors file (``safe_open``, each ``model/`` tensor copied in)."""
    model = b.dest["model"]
    if b.ok("ckstore"):
        ck = b.ckstore()
        root, ref = handles["ckstore"]
        scramble(b.dest)
        b.timed(
            "restore_model",
            "ckstore",
            lambda: ck.store(root).get(ref).restore({"model": ck.ck.StateDict(model)}),
        )
    if b.ok("safetensors"):
        st = b.systems["safetensors"]
        path = handles["safetensors"]

        def read_weights() -> None:
            with st.safe_open(str(path), framework="pt") as f:  # type: ignore[attr-defined]
                for k, t in model.items():
                    t.copy_(f.get_tensor(f"model/{k}"))

        scramble(b.dest)
        b.timed("restore_model", "safetensors", read_weights)


def read_one_tensor(b: Bench, order: list[str], handles: Handles, check: bool) -> None:
    shape = tuple(b.state["model"][READ_KEY].shape)
    for n in order:
        if not b.ok(n):
            continue
        t = b.timed("read_one_tensor", n, partial(b.systems[n].read, handles[n], shape))
        if t is not None and check:
            good = torch.equal(t, b.state["model"][READ_KEY])
            b.extra.setdefault("read_correct", {})[n] = good
        del t


def restore_compacted(b: Bench, handles: Handles, check: bool) -> None:
    """ckstore only, last of the restores: every snapshot compacted (``keep_loose=0``,
    untimed), as an older checkpoint is once its job's retention age has passed (a rollback, a
    milestone kept), then the restore in place, atomic and not. Its chunks are dense: an
    atomic restore decodes each one past its memory budget twice (checked before anything is
    touched, then into place, checked again)."""
    if not b.ok("ckstore") or not b.ckstore().compact_all(handles["ckstore"][0]):
        return
    ck = b.ckstore()
    for name, atomic in (("restore_compacted", True), ("restore_compacted_nonatomic", False)):
        scramble(b.dest)
        b.timed(name, "ckstore", partial(ck.restore, handles["ckstore"], b.dest, atomic=atomic))
        if check:
            good = all(
                torch.equal(t, flat_tensors(b.dest)[k]) for k, t in flat_tensors(b.state).items()
            )
            b.extra.setdefault("restore_compacted_correct", {})[name] = good


def async_take(b: Bench, r: int) -> None:
    """ckstore's async_take into a fresh store, three times in a row as a training loop does:
    the time the first blocks (its staging memory is new: a page fault per page) and the time
    the next ones block (they reuse it), and the time until the first is done; then into
    another fresh store whose staging memory ``prepare_staging`` made ready first (what a job
    that calls it after building its model blocks for at its first take). Beside them, one
    memcpy of the state into memory already touched (the unit blocking is held against)."""
    ck = b.ckstore()
    b.record("memcpy", "ckstore", memcpy(b.state))
    for prepared in (False, True):
        root = b.fresh(f"round{r}", "ckstore_async" + ("_prepared" if prepared else ""))
        store = ck.ck.open(root / "store", create=True)
        try:
            if prepared:
                store.prepare_staging(ck.app(b.state)).result()
            for i in range(1 if prepared else 3):
                gc.collect()
                t0 = time.perf_counter()
                pending = store.async_take(ck.app(b.state), run="bench", step=i, on_stale="ignore")
                t1 = time.perf_counter()
                pending.wait()
                t2 = time.perf_counter()
                store.wait_compacted()
                name = "async_block_prepared" if prepared else "async_block"
                b.record(name if i == 0 else "async_block_again", "ckstore", t1 - t0)
                if i == 0 and not prepared:
                    b.record("async_total", "ckstore", t2 - t0)
        except Exception as exc:  # noqa: BLE001
            b.log(f"  !! ckstore async_take failed: {type(exc).__name__}: {exc}")
            b.extra["async_error"] = f"{type(exc).__name__}: {exc}"
        finally:
            store.close()
    restarted(b, b.work / f"round{r}" / "ckstore_async")


def restarted(b: Bench, root: Path) -> None:
    """A restarted job: a new handle on the store the first async takes above wrote, a restore
    of the latest (which readies the next async take's staging behind training, knob
    ``stage_after_restore``), then the job's first async take, timed. The wait for the
    preparation stands for the training steps before a job's first checkpoint."""
    ck = b.ckstore()
    store = ck.ck.open(root / "store")
    try:
        store.get("bench").restore(ck.app(b.dest))
        prepared = getattr(store.repository, "staging_prepared", None)
        if prepared is not None:
            prepared.result()
        gc.collect()
        t0 = time.perf_counter()
        pending = store.async_take(ck.app(b.dest), run="bench", step=9, on_stale="ignore")
        b.record("async_block_restored", "ckstore", time.perf_counter() - t0)
        pending.wait()
        store.wait_compacted()
    except Exception as exc:  # noqa: BLE001
        b.log(f"  !! ckstore async_take after a restore failed: {type(exc).__name__}: {exc}")
    finally:
        store.close()


def memcpy(state: dict[str, Any], reps: int = 3) -> float:
    """Median seconds to copy every tensor of ``state`` into memory already touched."""
    src = list(flat_tensors(state).values())
    dst = [t.clone() for t in src]
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for d, t in zip(dst, src):
            d.copy_(t)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]
