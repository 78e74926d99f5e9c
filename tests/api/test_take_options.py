"""The take's options are written once (``engine/take/spec.py``): the public takes unpack a bundle
of them (``**options: Unpack[...]``), show them as keyword arguments with ``TakeSpec.of``'s
defaults, and refuse what their bundle lacks."""

from __future__ import annotations

import inspect
import pydoc
import typing
import uuid

import pytest
import torch

import ckstore
from ckstore import _takes
from ckstore.engine import knobs
from ckstore.engine.take import spec as spec_module
from ckstore.engine.take.spec import (
    AsyncTakeOptions,
    LiveTakeOptions,
    PathTakeOptions,
    TakeOptions,
    TakeSpec,
)
from ckstore.errors import InvalidInputError

D = ckstore.STORE_DEFAULT
GUARD = {"on_nonfinite": "warn", "on_stale": "warn"}
STORE_TAKE = {
    "name": None,
    "delta_base": D,
    "move_tags": False,
    **GUARD,
    "health": True,
    "trainable": (),
    "forked_from": None,
}
RANKS = {"dist_timeout": None, "on_divergence": "warn"}
LIVE = {**STORE_TAKE, "replicated": (), "pg": None, **RANKS, "no_dist": False}

# the signatures users saw before the options were written once: positional (name, default),
# then the keyword-only arguments and their defaults
SIGNATURES = {
    ckstore.Store.take: (
        [("self", None), ("app_state", None), ("run", "default"), ("step", None), ("tags", ()), ("metadata", None)],
        {**LIVE, "progress": None},
    ),
    ckstore.Store.async_take: (
        [("self", None), ("app_state", None), ("run", "default"), ("step", None), ("tags", ()), ("metadata", None)],
        {**LIVE, "staging_budget": None, "progress": None},
    ),
    ckstore.Store.import_checkpoint: (
        [("self", None), ("path", None), ("run", "default"), ("step", None), ("tags", ()), ("metadata", None)],
        {**STORE_TAKE, "format": None, "verify": True, "progress": None},
    ),
    ckstore.Snapshot.take: (
        [("path", None), ("app_state", None), ("pg", None), ("replicated", None), ("storage_options", None)],
        {"index": None, "metadata": None, **RANKS, **GUARD},
    ),
    ckstore.Snapshot.async_take: (
        [("path", None), ("app_state", None), ("pg", None), ("replicated", None), ("storage_options", None)],
        {"index": None, "metadata": None, **RANKS, **GUARD},
    ),
}  # fmt: skip


def _bare(default):
    return None if default is inspect.Parameter.empty else default


@pytest.mark.parametrize("fn", list(SIGNATURES), ids=lambda f: f.__qualname__)
def test_the_public_signatures_show_every_option_with_its_default(fn):
    params = list(inspect.signature(fn).parameters.values())
    positional = [p for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    keyword = {p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY}
    want_positional, want_keyword = SIGNATURES[fn]
    assert [(p.name, _bare(p.default)) for p in positional] == want_positional
    assert keyword == want_keyword
    assert len(params) == len(positional) + len(keyword)  # no **options left to guess at


@pytest.mark.parametrize("fn", list(SIGNATURES), ids=lambda f: f.__qualname__)
def test_help_names_every_option(fn):
    text = pydoc.render_doc(fn, renderer=pydoc.plaintext)
    for name in SIGNATURES[fn][1]:
        assert f"{name}:" in text or f"{name}=" in text, name
    assert "**options" not in text


BUNDLES = [TakeOptions, LiveTakeOptions, AsyncTakeOptions, PathTakeOptions]


@pytest.mark.parametrize("bundle", BUNDLES, ids=lambda b: b.__name__)
def test_each_option_of_a_bundle_is_an_argument_of_takespec_of(bundle):
    """One source: a bundle's keys, and their types, are ``TakeSpec.of``'s (``delta_base`` may
    also be the public sentinel)."""
    of = inspect.signature(TakeSpec.of).parameters
    hints = typing.get_type_hints(bundle)
    of_hints = typing.get_type_hints(TakeSpec.of, vars(spec_module))
    for name, hint in hints.items():
        assert name in of, name
        want = of_hints[name] | ckstore.StoreDefault if name == "delta_base" else of_hints[name]
        assert hint == want, name


def test_every_option_of_takespec_reaches_a_public_take():
    """A new option added to TakeSpec alone fails here until a bundle carries it."""
    of = set(inspect.signature(TakeSpec.of).parameters) - {"cls", "trainable_keys"}
    explicit = {"run", "step", "tags", "metadata"}
    assert of == set(typing.get_type_hints(AsyncTakeOptions)) | explicit
    fields = {f for f in TakeSpec.__dataclass_fields__}
    assert fields == of | {"trainable_keys", "asynchronous"}  # the last: which take, no option


def test_every_option_is_documented_in_takespec():
    for name in typing.get_type_hints(AsyncTakeOptions) | typing.get_type_hints(PathTakeOptions):
        assert f"\n        {name}: " in (TakeSpec.__doc__ or ""), name


@pytest.fixture
def mem():
    with ckstore.open(f"memory://take-options-{uuid.uuid4().hex}", create=True) as store:
        yield store


def _state():
    return {"m": torch.nn.Linear(2, 2)}


@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.take(_state(), nmae="x"),
        lambda s: s.take(_state(), staging_budget=1),  # an async take's option
        lambda s: s.import_checkpoint("x.safetensors", replicated=["*"]),  # a live take's
        lambda s: s.import_checkpoint("x.safetensors", no_dist=False),
    ],
)
def test_an_option_the_take_lacks_is_a_type_error(mem, call):
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        call(mem)
    assert mem.log() == []


def test_a_snapshot_path_take_refuses_a_bad_option_before_making_a_store(tmp_path):
    with pytest.raises(InvalidInputError, match="on_stale"):
        ckstore.Snapshot.take(str(tmp_path / "s"), _state(), on_stale="maybe")
    assert not (tmp_path / "s").exists()
    with pytest.raises(TypeError, match="unexpected keyword argument 'tags'"):
        ckstore.Snapshot.take(str(tmp_path / "s"), _state(), tags=["t"])


def test_the_store_default_is_the_delta_base_knob(mem):
    mem.delta_base = "parent"
    repo = mem.repository

    def spec(accepts, **options):
        return _takes.spec_of(repo, accepts, options, run="r")

    assert spec(LiveTakeOptions).delta_base == "parent"
    assert spec(LiveTakeOptions, delta_base=ckstore.STORE_DEFAULT).delta_base == "parent"
    assert spec(LiveTakeOptions, delta_base=None).delta_base is None
    assert spec(LiveTakeOptions, delta_base="base").delta_base == "base"
    assert _takes.spec_of(repo, TakeOptions, {}, no_dist=True).delta_base == "parent"
    assert _takes.spec_of(None, PathTakeOptions, {}).delta_base is None  # no store yet
    with pytest.raises(InvalidInputError, match="delta_base must be None"):
        spec(LiveTakeOptions, delta_base=3)


def test_the_sentinel_is_one_public_value():
    assert ckstore.STORE_DEFAULT is knobs.STORE_DEFAULT is knobs.StoreDefault.STORE_DEFAULT
    assert ckstore.StoreDefault is knobs.StoreDefault and list(knobs.StoreDefault) == [D]
    assert repr(D) == str(D) == "ckstore.STORE_DEFAULT"
