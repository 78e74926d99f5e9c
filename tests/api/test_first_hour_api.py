"""What a new user's first hour expects of the Python API (issue 35): resume if present, a
re-saved step said out loud, warnings at the user's own line, where a fine-tune came from,
and a restore that helps (a dtype cast on request, the fix for a ``torch.compile``'d model)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import ckstore
from tests.support.paths import REPO

TINY = {"chunk_bytes": 1024, "pack_bytes": 8192, "inline_bytes": 64}
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


@pytest.fixture
def store(tmp_path: Path) -> Any:
    with ckstore.open(tmp_path / "s", create=True, **TINY) as s:
        yield s


def _caught(fn: Any) -> tuple[Any, list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = fn()
    return out, list(seen)


# --- item 12: resume if present ------------------------------------------------------------
def test_get_with_a_default_and_latest_are_resume_if_present(store: Any) -> None:
    assert store.get("sft", None) is None and store.latest("sft") is None
    assert store.latest() is None
    sentinel = object()
    assert store.get("sft@3", sentinel) is sentinel
    with pytest.raises(ckstore.SnapshotNotFoundError):
        store.get("sft")
    with pytest.raises(ckstore.InvalidInputError):
        store.get("sft@", None)  # a malformed ref is an error whatever the default
    m = _model()
    first = store.take({"model": m}, run="sft", step=1)
    with torch.no_grad():  # a training step: nothing stale, so step 2 is healthy
        for p in m.parameters():
            p.add_(0.5)
    second = store.take({"model": m}, run="sft", step=2)
    assert store.get("sft", None).id == second.id and store.latest("sft").id == second.id
    assert store.latest().id == second.id
    with torch.no_grad():
        m[0].weight[0, 0] = float("nan")
    store.take({"model": m}, run="sft", step=3, on_nonfinite="ignore")
    assert store.latest("sft", healthy=True).id == second.id
    assert store.get("sft@1", None).id == first.id


# --- item 16: a re-saved step --------------------------------------------------------------
def test_resaving_a_step_another_process_took_warns_and_log_marks_it(
    store: Any, tmp_path: Path
) -> None:
    first = (
        "import ckstore, torch\n"
        "torch.manual_seed(0)\n"
        f"s = ckstore.open({str(store.url)!r})\n"
        "s.take({'model': torch.nn.Linear(4, 4)}, run='sft', step=500)\n"
    )  # the run before a crash
    subprocess.run([sys.executable, "-c", first], check=True, cwd=REPO, env=ENV)
    old = store.get("sft@500")
    snap, seen = _caught(lambda: store.take({"model": _model()}, run="sft", step=500))
    resaves = [w for w in seen if w.category is ckstore.ResaveWarning]
    assert len(resaves) == 1 and resaves[0].filename == __file__  # the user's line
    assert "sft@500 exists already" in str(resaves[0].message)
    assert old.id[:12] in str(resaves[0].message)
    assert store.get("sft@500").id == snap.id and len(store.log("sft")) == 2  # both kept
    # the same training saving one step under two names (a top-k file and `last`): no warning
    _, seen = _caught(lambda: store.take({"model": _model()}, run="sft", step=500))
    assert not [w for w in seen if w.category is ckstore.ResaveWarning]
    from ckstore import cli

    out = subprocess.run(
        [sys.executable, "-m", "ckstore.cli", "--store", store.url, "log", "--run", "sft"],
        capture_output=True, text=True, cwd=REPO, env=ENV, check=True,
    )  # fmt: skip
    assert out.stdout.count("sft@500 (re-save)") == 2 and cli.main is not None


# --- item 7: warnings at the user's line ---------------------------------------------------
def test_guard_and_metadata_warnings_point_at_the_take_line(store: Any) -> None:
    m = _model()
    with torch.no_grad():
        m[0].weight[0, 0] = float("nan")
    _, seen = _caught(
        lambda: store.take({"model": m}, run="g", step=1, metadata={"loss": float("nan")})
    )
    kinds = {w.category for w in seen}
    assert {ckstore.NonFiniteWarning, ckstore.MetadataWarning} <= kinds
    assert all(w.filename == __file__ for w in seen), [(w.filename, w.lineno) for w in seen]
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    _, seen = _caught(lambda: store.take({"model": m, "optim": opt}, run="g", step=2))
    stale = [w for w in seen if w.category is ckstore.StaleStateWarning]
    assert stale and all(w.filename == __file__ for w in stale)


# --- item 3: where a fine-tune came from ---------------------------------------------------
def test_a_take_records_the_snapshot_a_restore_loaded_or_the_one_named(store: Any) -> None:
    base = store.take({"model": _model()}, run="pretrain", step=30, tags=["base"])
    assert base.forked_from is None
    m = _model(1)
    store.get("base").restore({"model": m})
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)  # a full fine-tune: no chunk in common with the base
    ft = store.take({"model": m}, run="ft", step=0)
    assert ft.forked_from == base.id
    assert ft.manifest.snapshot["forked_from"] == base.id
    nxt = store.take({"model": m}, run="ft", step=1, on_stale="ignore")
    assert nxt.forked_from is None  # the restore is the parent of the next take only
    store.get("ft").restore({"model": m})  # a resume: the parent already says it
    assert store.take({"model": m}, run="ft", step=2, on_stale="ignore").forked_from is None
    store.get("ft@0").restore({"model": m})  # a rollback to an older step is recorded
    assert store.take({"model": m}, run="ft", step=3, on_stale="ignore").forked_from == ft.id
    named = store.take({"model": _model(2)}, run="other", step=0, forked_from="base")
    assert named.forked_from == base.id
    with pytest.raises(ckstore.SnapshotNotFoundError):
        store.take({"model": _model(2)}, run="other", step=1, forked_from="bsae")
    with pytest.raises(ckstore.InvalidInputError):
        store.take({"model": _model(2)}, run="other", step=1, forked_from="")


def test_the_recorded_fork_survives_reindex(store: Any, tmp_path: Path) -> None:
    base = store.take({"model": _model()}, run="pretrain", step=1)
    ft = store.take({"model": _model(1)}, run="ft", step=0, forked_from=base.id)
    store.close()
    for f in Path(store.url).iterdir():
        if f.name.startswith("index.sqlite"):
            f.unlink()
    with ckstore.open(store.url, create=True) as fresh:
        fresh.reindex()
        assert fresh.get(ft.id).forked_from == base.id


# --- item 13: restore help -----------------------------------------------------------------
def test_restore_casts_floating_dtypes_on_request(store: Any) -> None:
    m = _model()
    store.take({"model": m}, run="fp32", step=1)
    bf16 = _model(5).to(torch.bfloat16)
    with pytest.raises(ckstore.MismatchError, match="pass cast=True"):
        store.get("fp32").restore({"model": bf16})
    before = bf16[0].weight.clone()
    assert torch.equal(bf16[0].weight, before)  # refused: untouched
    store.get("fp32").restore({"model": bf16}, cast=True)
    for key, value in bf16.state_dict().items():
        assert value.dtype == torch.bfloat16
        assert torch.equal(value, m.state_dict()[key].to(torch.bfloat16)), key
    with pytest.raises(ckstore.InvalidInputError, match="verify"):
        store.get("fp32").restore({"model": bf16}, cast=True, verify=True)


def test_restore_never_casts_integers(store: Any) -> None:
    store.take({"s": ckstore.StateDict(step=torch.tensor([3], dtype=torch.int64))}, run="i")
    dest = ckstore.StateDict(step=torch.tensor([0], dtype=torch.int32))
    with pytest.raises(ckstore.MismatchError, match="int64"):
        store.get("i").restore({"s": dest}, cast=True)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.compile imports torch.jit
def test_a_compiled_model_gets_the_fix_in_the_message(store: Any) -> None:
    m = _model()
    store.take({"model": m}, run="plain", step=1)
    compiled = torch.compile(_model(3))
    with pytest.raises(ckstore.MismatchError, match=r"restore into model\._orig_mod"):
        store.get("plain").restore({"model": compiled})
    store.get("plain").restore({"model": compiled._orig_mod})  # the fix works
    assert torch.equal(compiled._orig_mod[0].weight, m[0].weight)
    store.take({"model": compiled}, run="compiled", step=1)
    with pytest.raises(ckstore.MismatchError, match=r"torch\.compile'd module"):
        store.get("compiled").restore({"model": _model()})
