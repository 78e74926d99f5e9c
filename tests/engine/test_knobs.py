"""The knobs table (``engine/knobs.py``): every knob's environment variable, default, check and
message, shared by a store and its repository, and the descriptor that ``inspect``, autodoc
and editors read on the class."""

from __future__ import annotations

import inspect
import os
import pydoc
import uuid

import pytest

import ckstore
from ckstore.engine.knobs import Knob, Knobs, table
from ckstore.engine.repository import Repository
from ckstore.errors import InvalidInputError

# name -> (environment variable, default with the variable unset)
KNOBS = {
    "threads": ("CKSTORE_THREADS", max(2, os.cpu_count() or 2)),
    "io_threads": ("CKSTORE_IO_THREADS", 4),
    "background_threads": ("CKSTORE_BACKGROUND_THREADS", "measured"),
    "background_process": ("CKSTORE_BACKGROUND_PROCESS", False),
    "stage_after_restore": ("CKSTORE_STAGE_AFTER_RESTORE", True),
    "memory_budget": ("CKSTORE_MEMORY_BUDGET", None),
    "staging_budget": ("CKSTORE_STAGING_BUDGET", "measured"),
    "lease_seconds": ("CKSTORE_LEASE_SECONDS", 600.0),
    "delta_base": (None, None),
    "delta_depth": ("CKSTORE_DELTA_DEPTH", 1),
    "take_codec": ("CKSTORE_TAKE_CODEC", "raw"),
    "direct_writes": ("CKSTORE_DIRECT_WRITES", "background"),
    "auto_compact": ("CKSTORE_AUTO_COMPACT", True),
}


def _open() -> ckstore.Store:
    return ckstore.open(f"memory://knobs-{uuid.uuid4().hex}", create=True)


@pytest.fixture
def clean_env(monkeypatch):
    for var, _ in KNOBS.values():
        if var:
            monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_the_table_holds_every_knob_with_its_variable():
    assert {k.name: k.env for k in table()} == {name: env for name, (env, _) in KNOBS.items()}
    assert all(k.__doc__ and k.__doc__.strip() for k in table())


def test_defaults_with_the_environment_unset(clean_env):
    with _open() as store:
        for name, (_, default) in KNOBS.items():
            value = getattr(store, name)
            if default == "measured":
                assert isinstance(value, int) and value > 0
            else:
                assert value == default and type(value) is type(default), name


@pytest.mark.parametrize(
    "var, text, knob, value",
    [
        ("CKSTORE_THREADS", "3", "threads", 3),
        ("CKSTORE_IO_THREADS", "16", "io_threads", 16),
        ("CKSTORE_MEMORY_BUDGET", "0", "memory_budget", 0),
        ("CKSTORE_STAGING_BUDGET", "777", "staging_budget", 777),
        ("CKSTORE_BACKGROUND_THREADS", "3", "background_threads", 3),
        ("CKSTORE_LEASE_SECONDS", "1.5", "lease_seconds", 1.5),
        ("CKSTORE_DELTA_DEPTH", "0", "delta_depth", 0),
        ("CKSTORE_TAKE_CODEC", "fast", "take_codec", "fast"),
        ("CKSTORE_AUTO_COMPACT", " Off ", "auto_compact", False),
        ("CKSTORE_AUTO_COMPACT", "yes", "auto_compact", True),
        ("CKSTORE_AUTO_COMPACT", "  ", "auto_compact", True),  # blank: unset
        ("CKSTORE_THREADS", "", "threads", max(2, os.cpu_count() or 2)),  # empty: unset
    ],
)
def test_the_environment_sets_a_knob(clean_env, var, text, knob, value):
    clean_env.setenv(var, text)
    with _open() as store:
        assert getattr(store, knob) == value


@pytest.mark.parametrize(
    "var, text, message",
    [
        ("CKSTORE_THREADS", "many", "$CKSTORE_THREADS must be an integer, got 'many'"),
        ("CKSTORE_IO_THREADS", "0", "$CKSTORE_IO_THREADS must be from 1 to 1024, got 0"),
        ("CKSTORE_MEMORY_BUDGET", "-1", "$CKSTORE_MEMORY_BUDGET must be from 0 to"),
        (
            "CKSTORE_LEASE_SECONDS",
            "soon",
            "$CKSTORE_LEASE_SECONDS must be a number of seconds, got 'soon'",
        ),
        (
            "CKSTORE_LEASE_SECONDS",
            "0",
            "$CKSTORE_LEASE_SECONDS must be a finite number > 0 and <= 604800, got 0.0",
        ),
        ("CKSTORE_DELTA_DEPTH", "33", "$CKSTORE_DELTA_DEPTH must be from 0 to 32, got 33"),
        (
            "CKSTORE_TAKE_CODEC",
            "zip",
            "take_codec must be one of ['fast', 'raw', 'dense'], got 'zip'",
        ),
        (
            "CKSTORE_AUTO_COMPACT",
            "Maybe",
            "$CKSTORE_AUTO_COMPACT must be 1 or 0 (true/false), got 'maybe'",
        ),
    ],
)
def test_a_bad_variable_refuses_the_open_with_its_name(clean_env, var, text, message):
    clean_env.setenv(var, text)
    with pytest.raises(InvalidInputError) as info:
        _open().close()
    assert str(info.value).startswith(message)


def test_a_bad_staging_variable_is_refused_when_read(clean_env):
    """The staging budget is measured at each read, its variable included."""
    with _open() as store:
        clean_env.setenv("CKSTORE_STAGING_BUDGET", "1e9")
        with pytest.raises(InvalidInputError, match=r"\$CKSTORE_STAGING_BUDGET must be an integer"):
            store.staging_budget  # noqa: B018 - read at use
        clean_env.setenv("CKSTORE_STAGING_BUDGET", "4096")
        assert store.staging_budget == 4096
        store.staging_budget = 10
        assert store.staging_budget == 10
        store.staging_budget = None  # back to measured
        assert store.staging_budget == 4096


@pytest.mark.parametrize(
    "knob, value, message",
    [
        ("threads", 0, "threads must be from 1 to 1024, got 0"),
        ("threads", 2.0, "threads must be an integer from 1 to 1024, got 2.0"),
        ("io_threads", True, "io_threads must be an integer from 1 to 1024, got True"),
        ("memory_budget", -1, "memory_budget must be from 0 to"),
        ("staging_budget", "1G", "staging_budget must be an integer from 0 to"),
        ("lease_seconds", 0, "lease_seconds must be a finite number > 0 and <= 604800, got 0"),
        ("delta_base", "", "delta_base must be None, 'parent' or a snapshot ref"),
        ("delta_depth", 33, "delta_depth must be from 0 to 32, got 33"),
        ("take_codec", "zip", "take_codec must be one of ['fast', 'raw', 'dense'], got 'zip'"),
        ("auto_compact", 1, "auto_compact must be True or False, got 1"),
    ],
)
def test_a_bad_value_is_refused_naming_the_knob(knob, value, message):
    with _open() as store:
        before = getattr(store, knob)
        with pytest.raises(InvalidInputError) as info:
            setattr(store, knob, value)
        assert str(info.value).startswith(message)
        assert getattr(store, knob) == before or knob == "staging_budget"


@pytest.mark.parametrize(
    "knob, value",
    [
        ("threads", 7),
        ("io_threads", 2),
        ("memory_budget", 1 << 20),
        ("staging_budget", 123),
        ("lease_seconds", 30),
        ("delta_base", "parent"),
        ("delta_depth", 4),
        ("take_codec", "dense"),
        ("auto_compact", False),
    ],
)
def test_a_store_and_its_repository_share_each_knob(knob, value):
    with _open() as store:
        setattr(store, knob, value)
        assert getattr(store.repository, knob) == value == getattr(store, knob)
        setattr(store.repository, knob, KNOBS_RESET[knob])
        assert getattr(store, knob) == KNOBS_RESET[knob]


KNOBS_RESET = {
    "threads": 1,
    "io_threads": 1,
    "memory_budget": None,
    "staging_budget": 1,
    "lease_seconds": 1.0,
    "delta_base": None,
    "delta_depth": 0,
    "take_codec": "fast",
    "auto_compact": True,
}


def test_two_handles_have_their_own_knobs():
    with _open() as a, _open() as b:
        a.threads = 3
        b.threads = 5
        assert (a.threads, b.threads) == (3, 5)


def test_a_knob_read_on_the_class_is_its_descriptor():
    """What ``inspect.getmembers``, Sphinx autodoc and editors do to a class."""
    for cls in (ckstore.Store, Repository, Knobs):
        members = dict(inspect.getmembers(cls))
        for knob in table():
            assert members[knob.name] is knob and getattr(cls, knob.name) is knob
            assert isinstance(knob, Knob) and repr(knob) == f"<knob {knob.name!r}>"


def test_help_shows_each_knob_and_its_doc():
    text = pydoc.render_doc(ckstore.Store, renderer=pydoc.plaintext)
    for knob in table():
        assert knob.name in text
        assert " ".join(knob.__doc__.split()[:4]) in " ".join(text.split())
