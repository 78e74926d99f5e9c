"""The take's guard on one process: NaN/Inf counts and norms measured while hashing, stale
tensors against the run's previous snapshot, and the policies (warn / raise / ignore)."""

from __future__ import annotations

import copy
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import ckstore
from ckstore.errors import (
    InvalidInputError,
    NonFiniteError,
    NonFiniteWarning,
    StaleStateError,
    StaleStateWarning,
)
from tests.support.training import Trainer

TINY = {"chunk_bytes": 1024, "pack_bytes": 8192, "inline_bytes": 64}


def _store(tmp_path: Path) -> ckstore.Store:
    return ckstore.open(tmp_path / "s", create=True, **TINY)


def _take(
    store: ckstore.Store, app: dict[str, Any], step: int, **kw: Any
) -> tuple[ckstore.StoredSnapshot, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        snap = store.take(app, run=kw.pop("run", "r"), step=step, **kw)
    return snap, [
        str(w.message)
        for w in caught
        if issubclass(w.category, (StaleStateWarning, NonFiniteWarning))
    ]


# --- health: NaN, Inf, norms ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_every_injected_nan_and_inf_is_counted(tmp_path: Path, dtype: torch.dtype) -> None:
    """Each value at each place (first, middle chunk, last element; chunked and inline)."""
    store = _store(tmp_path)
    cases = 0
    for bad in (float("nan"), float("inf"), float("-inf")):
        for size, where in ((2000, 0), (2000, 1234), (2000, 1999), (8, 3)):  # 8 elements: inline
            t = torch.randn(size, generator=torch.Generator().manual_seed(size + where)).to(dtype)
            t[where] = bad
            t2 = torch.randn(300).to(dtype)
            snap, _ = _take(
                store, {"m": ckstore.StateDict(t=t, ok=t2)}, cases, on_nonfinite="ignore"
            )
            h = snap.health
            assert h is not None and h.tensors is not None
            want = (1, 0) if math.isnan(bad) else (0, 1)
            assert (h.tensors["m/t"].nan, h.tensors["m/t"].inf) == want, (bad, size, where)
            assert (h.tensors["m/ok"].nan, h.tensors["m/ok"].inf) == (0, 0)
            assert snap.record.nonfinite == 1 and snap.healthy is False
            cases += 1
    assert cases == 12
    store.close()


def test_norms_match_torch_and_integers_have_no_record(tmp_path: Path) -> None:
    store = _store(tmp_path)
    gen = torch.Generator().manual_seed(3)
    state = {
        "f32": torch.randn(37, 29, generator=gen),
        "bf16": torch.randn(1000, generator=gen).bfloat16(),
        "f16": (
            torch.randn(500, generator=gen) * 300
        ).half(),  # a norm past float16's range: still right
        "c64": torch.randn(200, dtype=torch.complex64, generator=gen),
        "small": torch.ones(3),
        "i64": torch.arange(1000),
        "mask": torch.ones(100, dtype=torch.bool),
        "empty": torch.empty(0, 4),
    }
    snap, found = _take(store, {"m": ckstore.StateDict(state)}, 1)
    assert found == []
    h = snap.health
    assert h is not None and h.tensors is not None
    assert set(h.tensors) == {"m/f32", "m/bf16", "m/f16", "m/c64", "m/small", "m/empty"}
    for name in ("f32", "bf16", "f16", "c64", "small"):
        want = float(
            torch.linalg.vector_norm(
                state[name].to(torch.complex128 if name == "c64" else torch.float64)
            )
        )
        got = h.tensors[f"m/{name}"].norm
        assert got is not None and math.isclose(
            got, want, rel_tol=1e-2 if name in ("bf16", "f16") else 1e-5
        ), name
    assert h.tensors["m/empty"].norm == 0.0
    assert (
        snap.record.nonfinite == 0 and snap.healthy is True and snap.record.stale is None
    )  # first of its run
    store.close()


def test_nonfinite_policies(tmp_path: Path) -> None:
    store = _store(tmp_path)
    bad = {
        "m": ckstore.StateDict(
            w=torch.tensor([1.0] * 500 + [float("nan")]), b=torch.full((600,), float("inf"))
        )
    }
    with pytest.raises(NonFiniteError, match=r"NaN or Inf in 2 tensor\(s\): m/b, m/w") as err:
        store.take(bad, run="r", step=1, on_nonfinite="raise")
    assert err.value.keys == ["m/b", "m/w"] and store.log("r") == []  # nothing committed
    snap, found = _take(store, bad, 1)  # default: warn, commit, record
    assert len(found) == 2 and all("recorded unhealthy" in f and "r@healthy" in f for f in found)
    assert snap.record.nonfinite == 601
    snap, found = _take(store, bad, 2, on_nonfinite="ignore")
    assert found == [] and snap.record.nonfinite == 601
    snap, found = _take(store, bad, 3, health=False)  # not measured: unknown, not healthy
    assert found == [] and snap.record.nonfinite is None and snap.healthy is None
    assert snap.health is not None and snap.health.tensors is None
    with pytest.raises(InvalidInputError, match="on_nonfinite must be one of"):
        store.take(bad, run="r", on_nonfinite="error")
    with pytest.raises(InvalidInputError, match="health must be True or False"):
        store.take(bad, run="r", health="no")  # type: ignore[arg-type]
    store.close()


def test_one_warning_per_key_pattern(tmp_path: Path) -> None:
    store = _store(tmp_path)
    layers = {f"layers.{i}.weight": torch.full((300,), float("nan")) for i in range(12)}
    _, found = _take(store, {"m": ckstore.StateDict(layers)}, 1)
    assert found == [
        "ckstore: take of r@1: NaN/Inf in m/layers.*.weight (12 tensors); committed, recorded "
        "unhealthy (roll back with store.get('r@healthy'))"
    ]
    store.close()


def test_async_take_and_import_are_guarded(tmp_path: Path) -> None:
    store = _store(tmp_path)
    state = {"m": ckstore.StateDict(w=torch.tensor([0.0] * 400 + [float("inf")]))}
    with pytest.raises(NonFiniteError):
        store.async_take(state, run="a", step=1, on_nonfinite="raise").wait()
    assert store.log("a") == []
    snap = store.async_take(state, run="a", step=1, on_nonfinite="ignore").wait()
    assert snap.record.nonfinite == 1
    path = tmp_path / "w.pt"
    torch.save({"w": torch.tensor([float("nan")] * 300)}, path)
    with pytest.raises(NonFiniteError):
        store.import_checkpoint(path, run="i", on_nonfinite="raise")
    assert store.import_checkpoint(path, run="i", on_nonfinite="ignore").record.nonfinite == 300
    store.close()


# --- staleness -----------------------------------------------------------------------------------
def test_no_false_alarm_on_50_normal_training_saves(tmp_path: Path) -> None:
    store = _store(tmp_path)
    alarms: list[str] = []
    teacher = torch.nn.Linear(64, 64)  # requires_grad, but no optimizer of the app_state updates it
    for optim, frozen in (("adam", True), ("sgd", False)):
        t = Trainer.make(optim=optim, frozen_first=frozen)
        app = {**t.app_state(), "teacher": teacher} if optim == "adam" else t.app_state()
        for save in range(25):
            t.train(2)
            snap, found = _take(store, app, save + 1, run=f"{optim}")
            alarms += found
            assert snap.record.stale == (None if save == 0 else 0)
            assert snap.record.nonfinite == 0
    assert alarms == []
    store.close()


def test_every_injected_stale_save_is_flagged(tmp_path: Path) -> None:
    """No optimizer step (params and moments), a stale copy saved instead of the trained
    model (params), an optimizer that does not step (moments).

    With optimizers in the app_state, a parameter counts only if one of them updates it (a
    distillation teacher or a backbone left out of the optimizer is frozen in effect); the
    stale copy is therefore saved without them, as an evaluation hook would.
    """
    store = _store(tmp_path)
    flagged = injected = 0

    t = Trainer.make()
    t.train()
    _take(store, t.app_state(), 1, run="nostep")
    t.forward_backward_only()
    snap, found = _take(store, t.app_state(), 2, run="nostep")
    injected += 1
    stale = set(snap.health.stale or ())  # type: ignore[union-attr]
    trainable = {f"model/{n}" for n, _ in t.model.named_parameters()}
    moments = {
        k
        for k in snap.get_manifest()
        if k.startswith("optim/state/") and k.endswith(("exp_avg", "exp_avg_sq"))
    }
    assert stale == trainable | moments and len(moments) == 2 * len(trainable)
    assert any("model/" in f and "did not change since step 1" in f for f in found)
    flagged += bool(stale)

    t = Trainer.make(seed=1)
    frozen_copy = copy.deepcopy(t.model)  # the model saved is a copy made before training
    t.train()
    _take(store, {"model": frozen_copy}, 1, run="copy")
    t.train()
    snap, _ = _take(store, {"model": frozen_copy}, 2, run="copy")
    injected += 1
    assert set(snap.health.stale or ()) == {f"model/{n}" for n, _ in frozen_copy.named_parameters()}  # type: ignore[union-attr]
    flagged += bool(snap.health.stale)  # type: ignore[union-attr]

    t = Trainer.make(seed=2)
    idle = torch.optim.Adam(Trainer.make(seed=3).model.parameters())
    Trainer(t.model, idle, t.gen, t.dim)  # never steps
    t.train()
    for p in idle.param_groups[0]["params"]:
        idle.state[p] = {
            "step": torch.tensor(1.0),
            "exp_avg": torch.randn(p.shape),
            "exp_avg_sq": torch.rand(p.shape),
        }
    _take(store, {"model": t.model, "optim": idle}, 1, run="idle")
    t.train()
    snap, _ = _take(store, {"model": t.model, "optim": idle}, 2, run="idle")
    injected += 1
    stale = set(snap.health.stale or ())  # type: ignore[union-attr]
    assert stale and all(k.startswith("optim/state/") for k in stale)
    flagged += bool(stale)
    assert flagged == injected == 3
    store.close()


def test_staleness_needs_an_advancing_step_and_respects_frozen_parameters(tmp_path: Path) -> None:
    store = _store(tmp_path)
    t = Trainer.make(frozen_first=True)
    t.train()
    _take(store, t.app_state(), 10)
    snap, found = _take(store, t.app_state(), 10)  # the same step again: nothing compared
    assert found == [] and snap.health.stale is None and snap.record.stale is None  # type: ignore[union-attr]
    snap, found = _take(store, t.app_state(), 5)  # back in time (a rollback): nothing compared
    assert found == [] and snap.record.stale is None
    t.train()
    snap, found = _take(store, t.app_state(), 20)  # frozen layer 0 unchanged: fine
    assert found == [] and snap.record.stale == 0
    assert snap.health.stale_base == {"id": store.get("r@5").id, "step": 5}  # type: ignore[union-attr]
    store.close()


def test_stale_policies_and_trainable_globs(tmp_path: Path) -> None:
    store = _store(tmp_path)
    state = {"ema": ckstore.StateDict(w=torch.randn(500)), "model": torch.nn.Linear(30, 20)}
    _take(store, state, 1)
    snap, found = _take(store, state, 2)
    assert [k for k in snap.health.stale or ()] == ["model/bias", "model/weight"]  # type: ignore[union-attr]
    snap, found = _take(
        store, state, 3, trainable=["ema/*"]
    )  # a tensor the caller says should change
    assert "ema/w" in (snap.health.stale or ())  # type: ignore[union-attr]
    with pytest.raises(StaleStateError, match="should train did not change since step 3") as err:
        store.take(state, run="r", step=4, on_stale="raise")
    assert err.value.keys == ["model/bias", "model/weight"] and store.get("r").step == 3
    snap, found = _take(store, state, 4, on_stale="ignore")
    assert found == [] and snap.record.stale == 2
    store.close()


def test_imported_optimizer_moments_are_checked(tmp_path: Path) -> None:
    """An import has no live modules: optimizer moments are recognised by their keys."""
    store = _store(tmp_path)
    t = Trainer.make()
    t.train()
    path = tmp_path / "ckpt.pt"
    torch.save({"model": t.model.state_dict(), "optim": t.optim.state_dict()}, path)
    store.import_checkpoint(path, run="imp", step=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        snap = store.import_checkpoint(path, run="imp", step=2)
    stale = snap.health.stale  # type: ignore[union-attr]
    assert stale and all(k.startswith("optim/state/") for k in stale)  # moments, not the params
    assert any(issubclass(w.category, StaleStateWarning) for w in caught)
    store.close()


def test_chunks_of_a_clean_parent_tensor_are_not_measured_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckstore.engine.take import guard as guard_module

    measured: list[int] = []
    real = guard_module.chunk_stats
    monkeypatch.setattr(
        guard_module, "chunk_stats", lambda v, d: measured.append(len(v)) or real(v, d)
    )
    store = _store(tmp_path)
    frozen, partly, dirty = torch.randn(2000), torch.randn(2000), torch.randn(2000)
    dirty[5] = float("nan")
    app = {"m": ckstore.StateDict(frozen=frozen, partly=partly, dirty=dirty)}
    first, _ = _take(store, app, 1, on_nonfinite="ignore")
    assert len(measured) == 3 * 8  # 8 chunks of 1 KiB each
    measured.clear()
    partly[-1] = float("inf")  # one chunk of it changes, with an Inf
    second, _ = _take(store, app, 2, on_nonfinite="ignore")
    assert len(measured) == 1 + 8  # the changed chunk, and the tensor whose parent held a NaN
    h1, h2 = first.health.tensors, second.health.tensors  # type: ignore[union-attr]
    assert h2["m/frozen"] == h1["m/frozen"]  # all its chunks: the parent's figures, norm included
    assert (h2["m/partly"].nan, h2["m/partly"].inf, h2["m/partly"].norm) == (
        0,
        1,
        None,
    )  # exact counts, no norm
    assert h2["m/dirty"] == h1["m/dirty"] and h2["m/dirty"].nan == 1
    assert second.record.nonfinite == 2
    store.close()


def test_device_chunks_are_measured_once_their_copy_landed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Device tensors reach the guard as host buffers filled by asynchronous copies; routed
    through those paths (late copies), the figures equal a plain take's."""
    from ckstore.engine import devices
    from ckstore.engine.take import device_staging as device_stage
    from tests.engine.test_devices import LateCopier

    gen = torch.Generator().manual_seed(4)
    state = {
        "w": torch.randn(64, 48, generator=gen),
        "h": torch.randn(400, generator=gen).bfloat16(),
    }
    state["w"][10, 3] = float("nan")
    state["h"][-1] = float("inf")
    store = _store(tmp_path)
    plain, _ = _take(store, {"m": ckstore.StateDict(state)}, 1, run="plain", on_nonfinite="ignore")
    copier = LateCopier(delay=0.01)
    monkeypatch.setattr(devices, "DEVICE_TYPES", frozenset({"cpu"}))
    monkeypatch.setattr(devices, "copier_for", lambda t: copier)
    monkeypatch.setattr(device_stage, "DEVICE_STAGING_BYTES", 4 * store.config.chunk_bytes)
    staged, _ = _take(
        store, {"m": ckstore.StateDict(state)}, 1, run="staged", on_nonfinite="ignore"
    )
    assert copier.max_in_flight > 1
    assert staged.health.tensors == plain.health.tensors and staged.record.nonfinite == 2  # type: ignore[union-attr]
    copier.finish()
    store.close()


def test_inf_in_a_trainers_callback_state_is_a_sentinel_not_a_divergence(tmp_path: Path) -> None:
    """Lightning's ModelCheckpoint keeps ``kth_value = inf`` (and EarlyStopping ``best_score``)
    until it has a score: the snapshot stays healthy. A NaN there, and an Inf in the model or
    the optimizer, are still counted."""
    store = _store(tmp_path)
    callbacks = ckstore.StateDict(
        checkpoint={"kth_value": torch.tensor(float("inf")), "best": torch.tensor(-float("inf"))},
        stopping={"best_score": torch.full((4,), float("inf"))},
    )
    model = ckstore.StateDict(w=torch.randn(300))
    snap, warned = _take(store, {"model": model, "callbacks": callbacks}, 1)
    assert snap.healthy is True and snap.record.nonfinite == 0 and not warned
    assert store.get("r@healthy").id == snap.id
    health = snap.health
    assert health is not None and health.tensors is not None
    assert health.tensors["callbacks/checkpoint/kth_value"].inf == 0

    w = torch.randn(300)
    w[7] = float("inf")
    broken = ckstore.StateDict(w=w)
    snap2, warned = _take(store, {"model": broken, "callbacks": callbacks}, 2)
    assert snap2.healthy is False and snap2.health is not None
    assert snap2.health.bad_keys == ["model/w"]
    assert warned and "model/w" in warned[0]

    nan = ckstore.StateDict(checkpoint={"kth_value": torch.tensor(float("nan"))})
    snap3, _ = _take(store, {"model": model, "callbacks": nan}, 3)
    assert snap3.healthy is False and snap3.health is not None
    assert snap3.health.bad_keys == ["callbacks/checkpoint/kth_value"]
    store.close()
