"""What users look at, of a snapshot whose manifest is stored in parts (docs/FORMAT.md 7.7):
``ckstore show`` and ``ls`` give its global shapes, and the web view's health (read from the
root alone) and comparison agree with the manifest assembled whole."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch.distributed.tensor  # noqa: F401  (imported once here: forked ranks inherit it)

import ckstore
from ckstore import cli
from ckstore.format.manifest import PerRankEntry, TensorEntry
from ckstore.ui import changes, health, timeline
from tests.distributed import scenarios as sc
from tests.support.ranks import run_ranks, values

pytestmark = pytest.mark.timeout(300)


def _take(rank: int, world: int, path: str) -> str:
    with ckstore.open(path) as store:
        app = {"g": ckstore.StateDict(sc.dtensors(world, True, False)), "l": sc.local_app(rank)}
        return store.take(app, run="dist", step=1).id


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    code = cli.main(list(argv))
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out)


def test_show_ls_and_the_web_view_of_a_snapshot_in_parts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "s"
    ckstore.open(path, **sc.TINY, create=True).close()
    (sid, _) = values(run_ranks(_take, 2, tmp_path, str(path)))
    with ckstore.open(path) as store:
        snap = store.get(sid)
        whole = snap.manifest
        assert len(whole.parts) == 2
        tensors = {k: e for k, e in whole.entries.items() if isinstance(e, TensorEntry)}
        shown = _cli(capsys, "show", sid, "--json", "--store", str(path))
        assert shown["id"] == sid and shown["entries"]["tensors"] == len(tensors)
        listed = {r["key"]: r for r in _cli(capsys, "ls", sid, "--json", "--store", str(path))}
        assert set(listed) == set(whole.entries)
        global_shapes = {k: list(v.shape) for k, v in sc.global_state().items()}
        for key, e in tensors.items():
            assert listed[key]["shape"] == list(e.shape), key
            if key.startswith("g/"):  # a sharded tensor is listed whole, not one rank's shard
                assert list(e.shape) == global_shapes[key[2:]], key
        assert any(isinstance(e, PerRankEntry) for e in whole.entries.values())

        record = store.get(sid).record  # a fresh view: the page reads the root alone
        cache = health.HealthCache()
        series = health.run_health(store, timeline.load_history(store), cache, "dist", 10)
        assert series["recorded"] and [p["id"] for p in series["points"]] == [sid]
        assert cache.get(store, record) == health.health_of(record, whole)
        page = changes.compare(store, sid, sid, False)
        assert page["counts"]["unchanged"] == len(whole.entries)
        assert sum(page["counts"].values()) == len(whole.entries)
