"""Every input at the trust boundary is checked against a limit and refused with a typed error.

Each case names what it replaces: before these checks, the same call leaked a raw Python error
(``OverflowError`` from SQLite, ``RecursionError``, ``AttributeError``, an allocator failure) or
was silently accepted. Every refusal happens before anything is written: the store stays empty.
"""

from __future__ import annotations

import math
import uuid

import pytest
import torch

import ckstore
from ckstore.errors import InvalidInputError, MetadataWarning, UnsupportedValueError
from ckstore.format.limits import MAX_DEPTH
from ckstore.torchsnapshot import Snapshot

BIG_REF = "r@" + "9" * 40


@pytest.fixture
def mem():
    s = ckstore.open(
        f"memory://validation-{uuid.uuid4().hex}",
        chunk_bytes=1024,
        pack_bytes=8192,
        inline_bytes=64,
        create=True,
    )
    s.take({"m": ckstore.StateDict(w=torch.arange(600.0))}, run="r", step=1)
    yield s
    s.close()


def _state(**kw):
    return {"m": ckstore.StateDict(**kw)}


def _nothing_new(store, before=1):
    assert len(store.log()) == before


# --- tensors: resolved or refused before any allocation ------------------------------------------
def test_meta_tensor_is_refused_with_its_key_before_anything_is_allocated(mem):
    huge = torch.empty(1 << 40, device="meta")  # 4 TiB declared: taking it used to allocate that
    with pytest.raises(UnsupportedValueError, match=r"'m/w'.*meta tensor"):
        mem.take(_state(w=huge), run="r", step=2)
    with pytest.raises(UnsupportedValueError, match=r"'m/w'.*meta tensor"):
        mem.async_take(_state(w=huge), run="r", step=2)
    with pytest.raises(UnsupportedValueError, match=r"'m/small'.*meta tensor"):  # within budget
        mem.async_take(
            _state(small=torch.empty(4, device="meta")), run="r", step=2, staging_budget=1 << 20
        )
    _nothing_new(mem)


def test_conjugate_and_negative_views_are_stored_resolved(mem):
    z = torch.complex(torch.arange(300.0), torch.arange(300.0) + 0.5)
    state = _state(conj=z.conj(), neg=z.conj().imag, small=z[:3].conj())  # chunked, strided, inline
    assert state["m"]["conj"].is_conj() and state["m"]["neg"].is_neg()
    snap = mem.take(state, run="r", step=2)
    assert torch.equal(snap.read_object("m/conj"), z.conj().resolve_conj())
    assert torch.equal(snap.read_object("m/neg"), -(z.imag))
    assert torch.equal(snap.read_object("m/small"), z[:3].conj().resolve_conj())
    out = _state(
        conj=torch.zeros_like(z), neg=torch.zeros(300), small=torch.zeros(3, dtype=z.dtype)
    )
    snap.restore(out)
    assert torch.equal(out["m"]["conj"], z.conj().resolve_conj())
    assert mem.async_take(state, run="r", step=3).wait().read_object("m/neg").equal(-(z.imag))


def test_nested_and_storageless_tensors_are_refused_with_the_key(mem):
    nested = torch.nested.nested_tensor([torch.randn(2), torch.randn(3)])
    with pytest.raises(UnsupportedValueError, match=r"'m/n'.*nested"):
        mem.take(_state(n=nested), run="r", step=2)
    jagged = torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(3, 4)], layout=torch.jagged)
    with pytest.raises(UnsupportedValueError, match=r"'m/j'"):
        mem.take(_state(j=jagged), run="r", step=2)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.empty(8)
    with pytest.raises(UnsupportedValueError, match=r"'m/f'.*no data"):
        mem.take(_state(f=fake), run="r", step=2)
    _nothing_new(mem)


# --- integers limited to the 64 bits the index and the format store -----------------------------
@pytest.mark.parametrize("step", [2**63, -1, 1.5, True, "3"])
def test_step_outside_int64_is_refused_before_anything_is_written(mem, step):
    with pytest.raises(InvalidInputError, match="step"):
        mem.take(_state(x=1), run="r", step=step)
    assert mem.repository.objects.list_blobs("manifests") == [mem.log()[0].record.manifest_id]
    _nothing_new(mem)


@pytest.mark.parametrize("verb", ["get", "diff", "delete", "read"])
def test_ref_with_a_step_past_int64_is_a_typed_error(mem, verb):
    calls = {
        "get": lambda: mem.get(BIG_REF),
        "diff": lambda: mem.diff(BIG_REF, "r"),
        "delete": lambda: mem.delete(BIG_REF),
        "read": lambda: mem.repository.index.resolve(BIG_REF),
    }
    with pytest.raises(InvalidInputError, match="2\\*\\*63-1"):
        calls[verb]()
    with pytest.raises(ckstore.SnapshotNotFoundError):  # the largest step is a plain miss
        mem.get("r@9223372036854775807")


def test_integers_in_values_must_fit_64_bits(mem):
    with pytest.raises(InvalidInputError, match=r"'m/x'.*64 bits"):
        mem.take(_state(x=2**64), run="r", step=2)
    with pytest.raises(InvalidInputError, match="64 bits"):
        mem.take(_state(x=[10**5000]), run="r", step=2)  # json.dumps used to raise ValueError
    snap = mem.take(_state(x=2**64 - 1, y=-(2**63)), run="r", step=2)
    assert snap.read_object("m/x") == 2**64 - 1 and snap.read_object("m/y") == -(2**63)


def test_log_limit_is_range_checked(mem):
    for bad in (-1, 2**63, 1.0):
        with pytest.raises(InvalidInputError, match="limit"):
            mem.log(limit=bad)


# --- nesting depth ---------------------------------------------------------------------------------
def _nested(depth, leaf, kind="list"):
    v = leaf
    for _ in range(depth):
        v = [v] if kind == "list" else {"a": v}
    return v


@pytest.mark.parametrize("kind", ["list", "dict"])
def test_values_nested_5000_deep_are_a_typed_error_not_recursion(mem, kind):
    deep = _nested(5000, 1, kind)
    with pytest.raises(InvalidInputError, match=f"deeper than {MAX_DEPTH}"):
        mem.take(_state(v=deep), run="r", step=2)
    with pytest.raises(InvalidInputError, match=f"deeper than {MAX_DEPTH}"):
        mem.async_take(_state(v=deep), run="r", step=2)
    with pytest.raises(InvalidInputError, match="deeper"):
        mem.take(_state(v=1), run="r", step=2, metadata={"m": _nested(5000, 1, kind)})
    _nothing_new(mem)


def test_nesting_up_to_the_limit_round_trips(mem):
    # the state dict itself is one level: MAX_DEPTH - 1 more fit
    state = _state(v=_nested(MAX_DEPTH - 2, torch.ones(2), "dict"))
    snap = mem.take(state, run="r", step=2)
    out = _state(v=_nested(MAX_DEPTH - 2, torch.zeros(2), "dict"))
    snap.restore(out)
    assert torch.equal(_nested_leaf(out["m"]["v"]), torch.ones(2))
    with pytest.raises(InvalidInputError):
        mem.take(_state(v=_nested(MAX_DEPTH, torch.ones(2), "dict")), run="r", step=3)


def _nested_leaf(v):
    while isinstance(v, dict):
        v = v["a"]
    return v


# --- restore, metadata, names ----------------------------------------------------------------------
@pytest.mark.parametrize("app_state", [[1], "model", None, {1: ckstore.StateDict()}])
def test_restore_refuses_an_app_state_that_is_not_a_mapping_of_names(mem, app_state):
    with pytest.raises(InvalidInputError, match="app_state"):
        mem.get("r").restore(app_state)


@pytest.mark.parametrize("app_state", [None, [1, 2], "model", {1: ckstore.StateDict()}])
def test_take_refuses_an_app_state_that_is_not_a_mapping_of_names(mem, app_state, tmp_path):
    # before: take(None) and take([1, 2]) ended in a raw AttributeError from deep in the take
    with pytest.raises(InvalidInputError, match="app_state"):
        mem.take(app_state, run="r", step=2)
    with pytest.raises(InvalidInputError, match="app_state"):
        mem.async_take(app_state, run="r", step=2).wait()
    with pytest.raises(InvalidInputError, match="app_state"):
        Snapshot.take(str(tmp_path / "ts"), app_state)
    with pytest.raises(InvalidInputError, match="app_state"):
        Snapshot.async_take(str(tmp_path / "ts"), app_state).wait()
    _nothing_new(mem)


def test_take_refuses_a_value_that_is_not_stateful_naming_its_key(mem):
    with pytest.raises(UnsupportedValueError, match=r"app_state\['m'\].*StateDict"):
        mem.take({"m": [1, 2]}, run="r", step=2)
    _nothing_new(mem)


@pytest.mark.parametrize(
    "metadata",
    [{1: 2}, {"a": {None: 1}}, {"a": 2**63}, {"a": object()}, [("a", 1)]],
)
def test_metadata_must_be_json_with_string_keys(mem, metadata):
    with pytest.raises(InvalidInputError, match="metadata"):
        mem.take(_state(x=1), run="r", step=2, metadata=metadata)
    _nothing_new(mem)


def test_a_nan_loss_in_metadata_is_recorded_as_null_with_a_warning(mem):
    # before: metadata={"loss": loss.item()} raised InvalidInputError exactly when the loss
    # turned NaN, killing the job the guard means to keep alive
    meta = {"loss": math.nan, "lr": 0.1, "hist": [1.0, math.inf, -math.inf], "n": {"x": math.nan}}
    with pytest.warns(MetadataWarning) as caught:
        snap = mem.take(_state(x=1), run="r", step=2, metadata=meta)
    said = " ".join(str(w.message) for w in caught)
    for path in ("metadata['loss']", "metadata['hist'][1]", "metadata['hist'][2]", "['x']"):
        assert path in said
    want = {"loss": None, "lr": 0.1, "hist": [1.0, None, None], "n": {"x": None}}
    assert snap.metadata == want
    assert mem.get("r@2").metadata == want  # as committed, read back from the index
    assert mem.get("r@2").manifest.snapshot["metadata"] == want  # and in the manifest's header
    with pytest.warns(MetadataWarning, match="loss"):
        mem.async_take(_state(x=1), run="r", step=3, metadata={"loss": math.nan}).wait()
    assert mem.get("r@3").metadata == {"loss": None}


def test_names_and_tags_are_checked_before_anything_is_written(mem):
    packs = mem.repository.objects.list_packs()
    for kwargs in ({"tags": ["bad name"]}, {"tags": "best"}, {"name": "a@b"}, {"run": "x y"}):
        with pytest.raises(InvalidInputError):
            mem.take(_state(w=torch.randn(600)), **{"run": "r", "step": 2, **kwargs})
    assert mem.repository.objects.list_packs() == packs  # refused before any pack was written
    _nothing_new(mem)


# --- numeric options -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs",
    [
        {"grace_seconds": -1},
        {"grace_seconds": math.nan},
        {"grace_seconds": math.inf},
        {"repack_below": 1.5},
        {"repack_below": -0.1},
        {"older_than": -5},
        {"older_than": math.nan},
        {"keep_last": -1},
        {"keep_last": 2.5},
        {"keep_every_steps": 0},
        {"runs": "r"},
    ],
)
def test_gc_options_are_range_checked_before_anything_changes(mem, kwargs):
    with pytest.raises(InvalidInputError, match="gc"):
        mem.gc(**kwargs)
    _nothing_new(mem)


@pytest.mark.parametrize("read_data", [2.0, -0.5, math.nan, "all", 1.0000001])
def test_check_read_data_must_be_a_bool_or_a_fraction(mem, read_data):
    with pytest.raises(InvalidInputError, match="read_data"):
        mem.check(read_data=read_data)


@pytest.mark.parametrize(
    "knob, value",
    [
        ("threads", 0),
        ("threads", 1.5),
        ("io_threads", -1),
        ("memory_budget", -1),
        ("lease_seconds", 0),
        ("lease_seconds", math.inf),
        ("staging_budget", -1),
    ],
)
def test_store_knobs_are_range_checked(mem, knob, value):
    with pytest.raises(InvalidInputError, match=knob):
        setattr(mem, knob, value)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"chunk_bytes": 8},
        {"chunk_bytes": 1.5},
        {"chunk_bytes": 0},
        {"pack_bytes": 2**40},
        {"inline_bytes": -1},
        {"inline_bytes": 1 << 30},
        {"chunk_bytes": "4M"},
    ],
)
def test_new_store_knobs_are_range_checked(kwargs):
    with pytest.raises(InvalidInputError):
        ckstore.open(f"memory://knobs-{uuid.uuid4().hex}", **kwargs, create=True)


@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.take(_state(x=1), run="r", step=2, dist_timeout=0),
        lambda s: s.async_take(_state(x=1), run="r", step=2, staging_budget=-1),
        lambda s: s.get("r").restore(_state(w=torch.zeros(600)), memory_budget=-1),
        lambda s: s.get("r").restore(_state(w=torch.zeros(600)), dist_timeout=math.nan),
    ],
)
def test_call_options_are_range_checked(mem, call):
    with pytest.raises(InvalidInputError):
        call(mem)
    _nothing_new(mem)


@pytest.mark.parametrize(
    "var, value",
    [
        ("CKSTORE_THREADS", "many"),
        ("CKSTORE_IO_THREADS", "0"),
        ("CKSTORE_MEMORY_BUDGET", "-1"),
        ("CKSTORE_LEASE_SECONDS", "soon"),
        ("CKSTORE_STAGING_BUDGET", "1e9"),
    ],
)
def test_environment_knobs_are_typed_errors_naming_the_variable(monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    with pytest.raises(InvalidInputError, match=var):
        s = ckstore.open(f"memory://env-{uuid.uuid4().hex}", create=True)
        s.staging_budget  # noqa: B018 - read at use
