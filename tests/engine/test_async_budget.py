"""async_take under a staging budget: the snapshot is the state at the call, memory bounded."""

from __future__ import annotations

import warnings

import pytest
import torch

import ckstore
from ckstore.engine.take import filling, single


def _pack_bytes(store) -> int:
    return sum(store.repository.objects.pack_size(p) for p in store.repository.objects.list_packs())


def _state():
    return ckstore.StateDict(
        a=torch.randn(128, 64), b=torch.randn(128, 64), c=torch.randn(64, 64), step=1
    )


def _reserved(store) -> int:
    from ckstore.engine.take.packing import TakeOptions

    store.background_threads = 1
    return single.reserved_bytes(TakeOptions.of(store.repository), 1, 1 << 40)


def _mutate(state):
    for k in ("a", "b", "c"):
        state[k].mul_(-1).add_(3.0)
    state["step"] = 2


def test_past_the_budget_tensors_are_stored_before_returning(store):
    state = _state()
    want = {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
    pending = store.async_take({"s": state}, run="r", staging_budget=0)
    assert pending.staged_bytes == 0 and pending.sync_bytes == (2 * 128 + 64) * 64 * 4
    assert _pack_bytes(store) > 0  # the uncopied tensors were written before the call returned
    _mutate(state)
    snap = pending.wait(timeout=60)
    got = snap.read_object("s")
    assert all(torch.equal(got[k], v) for k, v in want.items()) and got["step"] == 1


def test_a_partial_budget_copies_what_fits_and_stores_the_rest_now(store):
    state = _state()
    want = {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
    budget = _reserved(store) + 128 * 64 * 4  # one big tensor, once the take's work is kept
    pending = store.async_take({"s": state}, run="r", staging_budget=budget)
    assert 0 < pending.staged_bytes <= budget and pending.sync_bytes > 0
    _mutate(state)
    got = pending.wait(timeout=60).read_object("s")
    assert all(torch.equal(got[k], v) for k, v in want.items()) and got["step"] == 1


def test_an_ample_budget_copies_everything(store):
    state = _state()
    pending = store.async_take({"s": state}, run="r", staging_budget=1 << 30)
    assert pending.sync_bytes == 0 and pending.staged_bytes == (2 * 128 + 64) * 64 * 4
    _mutate(state)
    assert pending.wait(timeout=60).read_object("s/step") == 1


def test_budget_from_the_environment(store_path, monkeypatch):
    monkeypatch.setenv("CKSTORE_STAGING_BUDGET", "777")
    assert ckstore.open(store_path, create=True).staging_budget == 777


def test_a_loop_of_async_takes_reuses_its_staging_memory_and_each_snapshot_stays_right(
    store, monkeypatch
):
    """The second take copies into the first one's staging arena (memory already touched), only
    once the first is done with it; a take still running keeps its own."""
    state = _state()
    wants, snaps, arenas = [], [], []
    real = single.arena_for

    def spy(repo, nbytes: int, pinned: bool = False, shared: bool = False):
        arena = real(repo, nbytes, pinned, shared)
        arenas.append(arena)
        return arena

    monkeypatch.setattr(single, "arena_for", spy)
    for step in range(3):
        wants.append({k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)})
        snaps.append(store.async_take({"s": state}, run="r", step=step).wait(timeout=60))
        _mutate(state)
    assert arenas[0] is arenas[1] is arenas[2]  # reused, take after take
    running = store.async_take(
        {"s": state}, run="r", step=3
    )  # not waited for: its arena is in use...
    other = store.async_take({"s": state}, run="r2", step=3)
    assert arenas[3] is not arenas[4]  # ...so the next take gets another one
    running.wait(timeout=60)
    other.wait(timeout=60)
    for snap, want in zip(
        snaps, wants
    ):  # the copies were overwritten since: the snapshots were not
        got = snap.read_object("s")
        assert all(torch.equal(got[k], v) for k, v in want.items())


def test_the_budget_covers_the_copies_and_the_take_buffers(store):
    """What an async take may add to memory: its copies and its encode buffers, within the
    budget; the report says how the budget was split and what was stored before returning."""
    state = _state()
    reserved = _reserved(store)
    budget = reserved + 128 * 64 * 4  # room for one big tensor once the buffers are kept out
    pending = store.async_take({"s": state}, run="r", staging_budget=budget)
    b = pending.blocking
    assert b.budget == budget and b.reserved_bytes == reserved
    assert pending.staged_bytes == b.staged_bytes == 128 * 64 * 4
    assert pending.sync_bytes == b.sync_bytes == (128 + 64) * 64 * 4
    assert b.staged_bytes + b.reserved_bytes <= budget
    assert 0 < b.copy_seconds <= b.seconds and 0 < b.sync_seconds <= b.seconds
    assert pending.wait(timeout=60).step is None
    tiny = store.async_take({"s": state}, run="r", staging_budget=reserved - 1)
    assert tiny.staged_bytes == 0 and tiny.blocking.reserved_bytes == reserved - 1
    tiny.wait(timeout=60)


def test_the_blocking_report_predicts_from_size_budget_and_rates():
    from ckstore.engine.take.blocking import BlockingReport

    b = BlockingReport(
        staged_bytes=100,
        sync_bytes=50,
        budget=110,
        reserved_bytes=10,
        copy_seconds=1.0,
        sync_seconds=5.0,
        seconds=6.0,
        persist_rate=10.0,
    )
    assert b.copy_rate == 100.0
    assert b.predict(150) == 1.0 + 5.0  # the call's own split: 100 copied, 50 stored
    assert b.predict(300, budget=210) == 2.0 + 10.0  # 200 copied, 100 stored
    assert b.predict(80) == 0.8  # fits: a copy only
    assert b.predict(80, budget=0) == 8.0  # nothing fits: stored at the persist rate
    unknown = BlockingReport(0, 50, 0, 0, 0.0, 5.0, 5.0, None)
    assert unknown.predict(50) is None and unknown.copy_rate is None
    assert b.to_dict()["copy_rate"] == 100.0 and b.to_dict()["persist_rate"] == 10.0


def test_a_store_measures_the_persist_rate_a_take_past_its_budget_blocks_at(store_path):
    s = ckstore.open(store_path, create=True)  # default chunks: a take of 16 MiB measures it
    try:
        assert s.repository.persist_rate is None
        big = ckstore.StateDict(w=torch.randn(5 << 20))  # 20 MiB
        s.take({"m": big}, run="r", step=1)
        rate = s.repository.persist_rate
        assert rate is not None and rate > 0
        pending = s.async_take({"m": big}, run="r", step=2, staging_budget=0)
        assert pending.blocking.persist_rate is not None
        pending.wait(timeout=60)
    finally:
        s.close()


def test_prepare_staging_readies_the_arena_the_first_async_take_copies_into(store, monkeypatch):
    state = _state()
    arenas = []
    real = single.arena_for

    def spy(repo, nbytes: int, pinned: bool = False, shared: bool = False):
        arena = real(repo, nbytes, pinned, shared)
        arenas.append(arena)
        return arena

    monkeypatch.setattr(single, "arena_for", spy)
    prepared = store.prepare_staging({"s": state}).result(timeout=60)
    assert prepared == arenas[0].size >= (2 * 128 + 64) * 64 * 4
    want = {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
    pending = store.async_take({"s": state}, run="r", step=1)
    assert arenas[1] is arenas[0]  # the prepared memory, not a new block
    _mutate(state)
    got = pending.wait(timeout=60).read_object("s")
    assert all(torch.equal(got[k], v) for k, v in want.items())


def test_prepare_staging_refuses_what_async_take_refuses(store):
    import pytest

    with pytest.raises(ckstore.InvalidInputError, match="staging_budget"):
        store.prepare_staging({"s": _state()}, staging_budget=-1)
    with pytest.raises(ckstore.InvalidInputError, match="app_state"):
        store.prepare_staging({"s": {"a": torch.zeros(3)}})


def _record_fills(monkeypatch) -> list[tuple[str, int, int]]:
    """(thread name, thread id, pairs) of each non-empty batch of copies made from now on."""
    import threading

    seen: list[tuple[str, int, int]] = []
    real = filling.fill

    def fill(pairs):
        if pairs:
            me = threading.current_thread()
            seen.append((me.name, me.ident or 0, len(pairs)))
        real(pairs)

    monkeypatch.setattr(filling, "fill", fill)
    return seen


def test_copies_split_between_threads_all_land_before_the_call_returns(store_path, monkeypatch):
    """A state past twice ``FILL_SHARE`` is copied by two filler threads at once (the training
    thread waits for them): each tensor, big or small, is the value it had at the call."""
    seen = _record_fills(monkeypatch)
    store = ckstore.open(store_path, create=True)
    store.threads = 2
    gen = torch.Generator().manual_seed(0)
    n = filling.FILL_SHARE // 4  # float32 elements in one share
    state = ckstore.StateDict(
        {f"big{i}": torch.randn(n // 2 + i, generator=gen) for i in range(6)}
        | {f"small{i}": torch.randn(50 + i, generator=gen) for i in range(20)}
    )
    want = {k: v.clone() for k, v in state.items()}
    pending = store.async_take({"s": state}, run="r", step=1, staging_budget=1 << 30)
    for v in state.values():
        v.fill_(float("nan"))  # the copies were all made before the call returned
    got = pending.wait(120).read_object("s")
    assert all(torch.equal(got[k], v) for k, v in want.items())
    assert sorted((name, n) for name, _, n in seen if n > 1) == [("ckstore-stage", 3)] * 2
    store.close()


def test_a_refused_name_is_refused_before_any_copy_and_leaves_nothing(store_path):
    """The index's refusals (a tag that would hide a run) come before the state is read or
    copied: the call raises them, nothing is stored, and the next take goes on."""
    store = ckstore.open(store_path, create=True)
    n = filling.FILL_SHARE // 2  # float32 elements: two shares in all
    state = ckstore.StateDict(big=torch.randn(n), other=torch.randn(n), small=torch.randn(9))
    store.async_take({"s": state}, run="sft", step=1).wait(120)
    packs = _pack_bytes(store)
    with pytest.raises(ckstore.ConflictError, match="would hide run 'sft'"):
        store.async_take({"s": state}, run="sft", step=2, tags=["sft"])
    assert _pack_bytes(store) == packs and [s.step for s in store.log("sft")] == [1]
    want = {k: v.clone() for k, v in state.items()}
    pending = store.async_take({"s": state}, run="sft", step=3)
    state["big"].zero_()
    got = pending.wait(120).read_object("s")
    assert all(torch.equal(got[k], v) for k, v in want.items())
    store.close()


def test_a_resaved_step_warns_at_the_async_take_line(store_path):
    """The re-save warning, raised while the copies are made, still points at the line of the
    caller's own ``async_take``."""
    from ckstore import _takes

    store = ckstore.open(store_path, create=True)
    state = ckstore.StateDict(w=torch.randn(64, 64))
    store.take({"s": state}, run="sft", step=7)
    _takes._SAVED.clear()  # as if another process (a run before a crash) had taken sft@7
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        store.async_take({"s": state}, run="sft", step=7).wait(120)
    resaves = [w for w in seen if w.category is ckstore.ResaveWarning]
    assert len(resaves) == 1 and resaves[0].filename == __file__
    store.close()


def _fillers_alive(within: float = 5.0) -> list[str]:
    """The filler threads still alive after ``within`` seconds (a filler that has made its
    copies leaves the thread list a moment later)."""
    import threading
    import time

    deadline = time.monotonic() + within
    while True:
        alive = [t.name for t in threading.enumerate() if t.name == "ckstore-stage"]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.01)


def _big_state() -> ckstore.StateDict:
    n = filling.FILL_SHARE // 4  # float32 elements: one share
    gen = torch.Generator().manual_seed(1)
    return ckstore.StateDict({f"big{i}": torch.randn(n // 2 + i, generator=gen) for i in range(6)})


def test_a_failure_after_the_copies_started_waits_for_them(store_path, monkeypatch):
    """What raises once the filler threads copy (the take's index fails to open) is raised
    after they stopped: none writes into staging memory the next take may reuse."""
    store = ckstore.open(store_path, create=True)
    store.threads = 2

    def broken(*args, **kwargs):
        raise OSError("the index is gone")

    monkeypatch.setattr(single, "LocalTake", broken)
    with pytest.raises(OSError, match="the index is gone"):
        store.async_take({"s": _big_state()}, run="r", step=1, staging_budget=1 << 30)
    assert not _fillers_alive()
    store.close()


def test_the_calls_own_error_wins_over_a_copys(store_path, monkeypatch):
    """A re-save warning made an error is what the call raises, not the error of a copy that
    failed meanwhile."""
    import threading

    from ckstore import _takes

    real = filling.fill

    def fill(pairs):
        if pairs and threading.current_thread().name == "ckstore-stage":
            raise RuntimeError("a copy failed")
        real(pairs)

    monkeypatch.setattr(filling, "fill", fill)
    store = ckstore.open(store_path, create=True)
    store.threads = 2
    store.take({"s": ckstore.StateDict(w=torch.zeros(4))}, run="r", step=1)
    _takes._SAVED.clear()  # as if another process had taken r@1
    with warnings.catch_warnings():
        warnings.simplefilter("error", ckstore.ResaveWarning)
        with pytest.raises(ckstore.ResaveWarning):
            store.async_take({"s": _big_state()}, run="r", step=1, staging_budget=1 << 30)
    assert not _fillers_alive()
    with pytest.raises(RuntimeError, match="a copy failed"):  # alone, the copy's error is raised
        store.async_take({"s": _big_state()}, run="r", step=2, staging_budget=1 << 30)
    assert [s.step for s in store.log("r")] == [1]
    store.close()


def test_a_numpy_array_of_objects_is_refused_naming_its_key(store_path):
    """An array of Python objects has no bytes to stage: the call refuses it as a take does,
    naming the key, and the next take goes on."""
    import numpy as np

    store = ckstore.open(store_path, create=True)
    state = ckstore.StateDict(w=torch.randn(64, 64), names=np.array(["a", None], dtype=object))
    with pytest.raises(ckstore.UnsupportedValueError, match="'s/names'.*dtype object"):
        store.async_take({"s": state}, run="r", step=1, staging_budget=1 << 30)
    del state["names"]
    got = store.async_take({"s": state}, run="r", step=2).wait(120).read_object("s")
    assert torch.equal(got["w"], state["w"])
    store.close()


@pytest.mark.parametrize("interrupts", [1, 2])
def test_an_interrupt_while_the_copies_are_awaited_never_frees_memory_still_written(
    store_path, monkeypatch, interrupts
):
    """Ctrl-C while the call waits for its filler threads: the call raises it. Once, the call
    waits for them on its way out and keeps the staging memory for the next take; twice (the
    second while it waits on its way out), that memory, still written, is not kept, and the
    next take gets its own (else its copies could be overwritten by this one's). Either way
    the next take holds its own state."""
    import threading

    real_fill, real_join = filling.fill, filling.Copies.join
    release = threading.Event()
    left = [None] * interrupts

    def slow(pairs):
        if pairs and threading.current_thread().name == "ckstore-stage":
            release.wait(30)
        real_fill(pairs)

    def join(self, quiet=False):
        if not left:
            return real_join(self, quiet)
        left.pop()
        if not left and interrupts == 1:
            threading.Timer(0.3, release.set).start()  # the copies end while it waits again
        raise KeyboardInterrupt

    monkeypatch.setattr(filling, "fill", slow)
    monkeypatch.setattr(filling.Copies, "join", join)
    store = ckstore.open(store_path, create=True)
    store.threads = 2
    with pytest.raises(KeyboardInterrupt):
        store.async_take({"s": _big_state()}, run="r", step=1, staging_budget=1 << 30)
    assert store.repository.spare_staging.held() == (interrupts == 1)
    monkeypatch.undo()
    release.set()
    assert not _fillers_alive()
    state = ckstore.StateDict({k: v.neg() for k, v in _big_state().items()})
    got = store.async_take({"s": state}, run="r", step=2).wait(120).read_object("s")
    assert all(torch.equal(got[k], v) for k, v in state.items())
    store.close()


def test_a_reused_arena_gives_each_placement_its_room_again_and_forgets_the_others():
    """A training loop's takes place the same tensors at the same offsets: the arena hands
    back the room it made last time (no new tensor to build); a placement of another dtype or
    shape at the same offset gets a room of its own, and a reset keeps only the rooms the last
    take placed."""
    from ckstore.engine.take.staging import StagingArena

    arena = StagingArena(1 << 16)
    a, b = torch.randn(16, 8), torch.randn(32)
    first = [arena.place(a), arena.place(b)]
    arena.reset()
    again = [arena.place(a), arena.place(b)]
    assert again[0] is first[0] and again[1] is first[1]
    arena.reset()
    other = arena.place(torch.randn(8, 16))  # same offset, other shape
    assert other is not first[0] and other.shape == (8, 16)
    halves = arena.place(torch.randn(32, dtype=torch.float16))  # other dtype
    assert halves.dtype == torch.float16 and halves.shape == (32,)
    arena.reset()
    assert arena.place(a) is not first[0]  # forgotten: the last take did not place it


def test_async_takes_of_states_whose_shapes_change_each_store_their_own_bytes(store):
    """The arena's rooms are reused by placement: a state reshaped or retyped between takes
    (same sizes, same offsets) is stored with its own shapes, dtypes and bytes."""
    states = [
        {"w": torch.arange(96.0).reshape(12, 8), "v": torch.arange(40, dtype=torch.int32)},
        {"w": torch.arange(96.0).reshape(8, 12) + 1, "v": torch.arange(40, dtype=torch.float32)},
        {"w": (torch.arange(192) % 7).to(torch.int16).reshape(4, 48), "v": torch.ones(40)},
    ]
    snaps = [
        store.async_take({"s": ckstore.StateDict(s)}, run="shapes", step=i).wait(timeout=60)
        for i, s in enumerate(states)
    ]
    for snap, want in zip(snaps, states):
        got = snap.read_object("s")
        for k, v in want.items():
            assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v)


@pytest.mark.parametrize("big", [False, True], ids=["small", "past one filler share"])
def test_an_async_take_under_inference_mode_leaves_the_arena_usable_outside_it(store, big):
    """An evaluation's take under ``torch.inference_mode()`` places its copies in rooms the
    next takes reuse; those rooms must be normal tensors, or every take after it outside
    inference mode fails to copy into them (the filler threads never run in inference mode)."""
    n = (12 << 20) if big else 4096  # 48 MiB of fp32: copied on filler threads
    state = {"w": torch.randn(n), "b": torch.randn(64)}
    with torch.inference_mode():
        first = store.async_take({"s": ckstore.StateDict(state)}, run="eval", step=0)
        first.wait(timeout=120)
    for step in (1, 2):
        state["w"].add_(1.0)
        snap = store.async_take({"s": ckstore.StateDict(state)}, run="eval", step=step)
        got = snap.wait(timeout=120).read_object("s")
        assert torch.equal(got["w"], state["w"]) and torch.equal(got["b"], state["b"])


def test_a_reset_with_nothing_placed_keeps_the_rooms_for_the_next_take():
    """``prepare_staging`` resets the arena it readies without placing anything: the rooms of
    the take before stay for the take after."""
    from ckstore.engine.take.staging import StagingArena

    arena = StagingArena(1 << 16)
    a = torch.randn(16, 8)
    room = arena.place(a)
    arena.reset()
    arena.reset()  # nothing placed since
    assert arena.place(a) is room
