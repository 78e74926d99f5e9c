"""Refs mean one thing (issue 27, items 6, 9 and 12).

A tag never takes a run's name (refs resolve tags first, so it would hide the run's latest
snapshot, and the README's resume line would resume an old step); a take or import moves an
existing tag only when asked, like ``ckstore tag``; ``store.get(snap.ref)`` works; a missing
run is an error; malformed ``run@step`` refs are usage errors whichever half is missing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from sqlalchemy import insert

import ckstore
from ckstore.errors import ConflictError, InvalidInputError, SnapshotNotFoundError
from tests.support.cli import run

TINY = {"chunk_bytes": 1024, "pack_bytes": 8192, "inline_bytes": 64}


def _state(seed: int) -> dict[str, ckstore.StateDict]:
    torch.manual_seed(seed)
    return {"m": ckstore.StateDict(w=torch.randn(8, 64), step=seed)}


def _packs(path: Path) -> int:
    return len(list((path / "packs").rglob("*.pack")))


@pytest.fixture
def store(tmp_path: Path):
    with ckstore.open(tmp_path / "s", create=True, **TINY) as s:
        s.take(_state(1), run="sft", step=1)
        yield s


# --- item 6 -------------------------------------------------------------------------------------
def test_a_tag_never_takes_a_runs_name(store, capsys) -> None:
    with pytest.raises(ConflictError, match="would hide run 'sft'"):
        store.tag("sft@1", "sft")
    store.take(_state(2), run="sft", step=2)
    assert store.get("sft").step == 2  # the README's resume line resumes the latest step
    with pytest.raises(ConflictError, match="would hide run 'sft'"):
        store.take(_state(3), run="sft", step=3, tags=["sft"])
    with pytest.raises(ConflictError, match="would hide run 'sft'"):
        store.take(_state(3), run="other", step=3, tags=["sft"])
    code, _, err = run(capsys, "--store", store.url, "tag", "sft@1", "sft")
    assert code == 4 and "would hide run" in err and "Traceback" not in err


def test_a_new_run_never_takes_a_tags_name(store) -> None:
    store.tag("sft@1", "best")
    packs = _packs(Path(store.url))
    with pytest.raises(ConflictError, match="run 'best' would be hidden by tag 'best'"):
        store.take(_state(5), run="best", step=1)
    assert _packs(Path(store.url)) == packs  # refused before anything was written
    assert store.runs() == ["sft"]


def test_a_store_made_before_the_rule_reports_the_ambiguity(store, capsys) -> None:
    store.take(_state(2), run="sft", step=2)
    first = store.get("sft@1")
    with store.repository.index._engine.begin() as conn:  # noqa: SLF001 - what an older ckstore allowed
        from ckstore.index import models

        conn.execute(
            insert(models.tags).values(name="sft", snapshot_id=first.id, version=1, updated_at=0.0)
        )
    with pytest.raises(InvalidInputError, match="ambiguous") as exc:
        store.get("sft")
    assert "tag 'sft'" in str(exc.value) and "sft@2" in str(exc.value)
    assert store.get("sft@2").step == 2  # run@step still names one snapshot
    code, _, err = run(capsys, "--store", store.url, "show", "sft")
    assert code == 2 and "ambiguous" in err
    store.take(_state(3), run="sft", step=3)  # the existing run keeps taking snapshots


# --- item 9 -------------------------------------------------------------------------------------
def test_a_take_moves_an_existing_tag_only_when_asked(store, tmp_path, capsys) -> None:
    store.tag("sft@1", "best")
    packs = _packs(Path(store.url))
    with pytest.raises(ConflictError, match="move_tags=True"):
        store.take(_state(2), run="sft", step=2, tags=["best"])
    with pytest.raises(ConflictError, match="move_tags=True"):
        store.async_take(_state(2), run="sft", step=2, tags=["best"])
    assert _packs(Path(store.url)) == packs and [s.step for s in store.log()] == [1]
    moved = store.take(_state(2), run="sft", step=2, tags=["best", "new"], move_tags=True)
    assert store.tags() == {"best": moved.id, "new": moved.id}
    pending = store.async_take(_state(3), run="sft", step=3, tags=["best"], move_tags=True)
    third = pending.wait()
    assert store.tags()["best"] == third.id
    # import: the same rule, and the same way to ask
    ckpt = tmp_path / "w.safetensors"
    from safetensors.torch import save_file

    save_file({"w": torch.ones(4)}, str(ckpt))
    with pytest.raises(ConflictError, match="move_tags"):
        store.import_checkpoint(ckpt, run="imp", tags=["best"])
    s = ("--store", store.url)
    code, _, err = run(capsys, *s, "import", str(ckpt), "--run", "imp", "--tag", "best")
    assert code == 4 and "--move-tags" in err
    code, _, err = run(
        capsys, *s, "import", str(ckpt), "--run", "imp", "--tag", "best", "--move-tags"
    )
    assert code == 0, err
    assert store.get("best").run == "imp"


# --- item 12 ------------------------------------------------------------------------------------
def test_get_accepts_what_snapshot_ref_prints(store) -> None:
    snap = store.get("sft@1")
    assert snap.ref == f"sft@1 ({snap.id[:12]})"
    assert store.get(snap.ref).id == snap.id
    named = store.take(_state(2), run="default", name="ckpt/step_2")
    assert store.get(named.ref).id == named.id
    with pytest.raises(SnapshotNotFoundError):
        store.get("sft@1 (ffffffffffff)")


def test_missing_runs_and_malformed_refs(store, capsys) -> None:
    s = ("--store", store.url)
    code, out, err = run(capsys, *s, "log", "--run", "nope")
    assert code == 3 and out == "" and "no run 'nope'" in err and "sft" in err
    code, out, _ = run(capsys, *s, "log", "--run", "sft", "--json")
    assert code == 0 and len(json.loads(out)) == 1
    for ref in ("@5", "sft@", "@"):
        code, _, err = run(capsys, *s, "show", ref)
        assert code == 2 and "bad ref" in err, (ref, err)
    store.take(_state(2), run="gone", step=1)
    store.delete("gone@1")
    assert store.runs() == ["sft"]  # a run with no snapshot left is not listed
    with pytest.raises(SnapshotNotFoundError) as exc:
        store.get("nothing")
    assert "Runs: sft;" in str(exc.value)
    code, _, err = run(capsys, *s, "log", "--run", "gone")
    assert code == 3 and "no run 'gone'" in err


# --- snapshot names (a TorchSnapshot path's, name=) keep one meaning too -----------------------
def test_a_snapshot_name_never_takes_a_runs_or_a_tags_name(store) -> None:
    """Before, ``take(..., name="sft")`` with run ``sft`` existing was accepted, and
    ``get("sft")`` kept answering that snapshot after newer takes of the run."""
    packs = _packs(Path(store.url))
    with pytest.raises(ConflictError, match="snapshot name 'sft' would hide run 'sft'"):
        store.take(_state(2), run="eval", step=0, name="sft")
    with pytest.raises(ConflictError, match="would hide run 'eval'"):
        store.take(_state(2), run="eval", step=0, name="eval")
    store.tag("sft@1", "final")
    with pytest.raises(ConflictError, match="snapshot name 'final' is a tag's"):
        store.take(_state(2), run="eval", step=0, name="final")
    assert _packs(Path(store.url)) == packs  # refused before anything was written
    store.take(_state(2), run="eval", step=0, name="warmup")
    store.take(_state(3), run="sft", step=3)
    assert store.get("sft").step == 3 and store.get("warmup").run == "eval"
    with pytest.raises(ConflictError, match="would hide the snapshot named 'warmup'"):
        store.tag("sft@1", "warmup")
    with pytest.raises(ConflictError, match="would hide the snapshot named 'warmup'"):
        store.take(_state(4), run="sft", step=4, tags=["warmup"])
    with pytest.raises(ConflictError, match="run 'warmup' would be hidden by the snapshot"):
        store.take(_state(4), run="warmup", step=1)
    assert store.get("warmup").run == "eval"


def test_a_whole_snapshot_id_names_that_snapshot_whatever_is_spelt_like_it(store, capsys) -> None:
    """A tag, a snapshot name or a run spelt like one snapshot's whole id (one pulled from a
    shared remote, say) named another snapshot where tools name them by id: ``rm <id>``
    deleted the other one (refs resolved tags, names and runs before ids)."""
    clicked = store.get("sft@1").id
    precious = store.take(_state(2), run="keep", step=1).id
    store.tag(precious, clicked)  # a tag spelt like the first snapshot's id
    other = store.take(_state(3), run=precious, step=1).id  # a run spelt like another's
    assert store.get(clicked).id == clicked and store.get(precious).id == precious
    assert store.tags()[clicked] == precious
    code, _, err = run(capsys, "--store", store.url, "rm", clicked, "--yes")
    assert code == 0, err
    kept = {s.id for s in store.log(run=None)}
    assert clicked not in kept and {precious, other} <= kept
