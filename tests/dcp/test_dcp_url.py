"""``ckstore://`` checkpoint ids: ``dcp.save`` / ``async_save`` / ``load`` pick ckstore from the
id alone, and a torchtitan-style checkpointer (step-N every interval, ``keep_latest_k`` purge,
resume from the newest) needs nothing but the id and the store's verbs; its purge frees the
disk within the job.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp  # noqa: E402  (ships with the torch we pin)

import ckstore
from ckstore.dcp import StorageReader, StorageWriter
from ckstore.dcp.url import CheckpointId, is_ckstore_id, parse
from ckstore.errors import InvalidInputError
from tests.dcp import folder_scenarios as fs
from tests.support.paths import REPO

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _app(seed: int = 0) -> fs.TitanApp:
    """torchtitan's training state, its first step 1."""
    return fs.TitanApp(seed, first_step=1)


def _loaded(store_url: str, ref: str) -> fs.TitanApp:
    other = _app(seed=7)
    state = other.state()
    dcp.load(state, checkpoint_id=f"ckstore://{store_url}/{ref}")
    other.put(state)
    return other


def test_the_forms_of_a_ckstore_id(tmp_path: Path) -> None:
    ckstore.open(tmp_path / "s", create=True).close()
    s = str(tmp_path / "s")
    assert parse(f"ckstore://{s}/titan@100") == CheckpointId(s, "titan@100")
    assert parse(f"ckstore://{s}/titan/step-100") == CheckpointId(s, "titan@100")
    assert parse(f"ckstore://{s}/lit/best").ref == "lit/best"  # an existing store: the rest
    assert parse(f"ckstore://{tmp_path}/new/titan/step_5") == CheckpointId(
        str(tmp_path / "new"), "titan@5"
    )
    assert parse("ckstore+s3://bucket/prefix/run@3") == CheckpointId("s3://bucket/prefix", "run@3")
    assert parse(f"ckstore://{s}/titan@100").run_step == ("titan", 100)
    assert parse(f"ckstore://{s}/titan").run_step == ("titan", None)
    for bad in ("ckstore:///", "ckstore://x", "s3://bucket/x@1", "/plain/path"):
        with pytest.raises(InvalidInputError):
            parse(bad)
    assert (
        is_ckstore_id(Path("x")) is False and StorageWriter.validate_checkpoint_id("run@1") is False
    )
    assert StorageReader.validate_checkpoint_id(f"ckstore://{s}/titan@1") is True


def test_save_async_save_and_load_by_id_alone(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpts")  # created by the first save, as DCP makes its folder
    app = _app()
    dcp.save(app.state(), checkpoint_id=f"ckstore://{url}/titan@1")
    assert _loaded(url, "titan@1").same_as(app)
    app.train()
    before = {k: v.clone() for k, v in app.model.state_dict().items()}
    future = dcp.async_save(app.state(), checkpoint_id=f"ckstore://{url}/titan/step-2")
    app.train()  # the save holds the state as it was at the call
    future.result()
    store = ckstore.open(url)
    assert [s.step for s in store.log("titan")] == [2, 1]
    saved = store.get("titan@2").read_object("dcp/model.0.weight")
    assert torch.equal(saved, before["0.weight"])
    assert _loaded(url, "titan/step-2").step == 2
    # a writer given for one store and an id naming another follows the id, as DCP's own
    other = str(tmp_path / "other")
    dcp.save(
        app.state(),
        storage_writer=StorageWriter(store, run="x"),
        checkpoint_id=f"ckstore://{other}/titan@3",
    )
    assert [s.step for s in ckstore.open(other).log("titan")] == [3]
    store.close()


def test_importing_ckstore_alone_is_enough(tmp_path: Path) -> None:
    """A script that imports ckstore (before or after DCP) and calls dcp.save with an id: no
    storage object, no import of ckstore.dcp."""
    orders = (
        "import ckstore\nimport torch.distributed.checkpoint as dcp\n",
        "import torch.distributed.checkpoint as dcp\nimport ckstore\n",
    )
    for i, imports in enumerate(orders):
        store = tmp_path / f"s{i}"
        code = (
            "import warnings\n"
            "warnings.simplefilter('ignore')\n"
            f"{imports}"
            "import torch\n"
            f"dcp.save({{'w': torch.ones(4)}}, checkpoint_id='ckstore://{store}/titan@1')\n"
            "out = {'w': torch.zeros(4)}\n"
            f"dcp.load(out, checkpoint_id='ckstore://{store}/titan@1')\n"
            "assert torch.equal(out['w'], torch.ones(4))\n"
            f"print(ckstore.open('{store}').get('titan@1').step)\n"
        )
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip() == "1"


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def test_a_torchtitan_style_checkpointer_saves_lists_purges_and_resumes(tmp_path: Path) -> None:
    """Every interval a step-N save by id; keep_latest_k=1 purges the older ones with the
    store's own verbs (delete + gc with its defaults) and the disk comes back at once."""
    url = tmp_path / "ckpts"
    app = _app()
    for _ in range(4):
        app.train()
        dcp.save(app.state(), checkpoint_id=f"ckstore://{url}/titan/step-{app.step}")
    store = ckstore.open(url)
    assert sorted(s.step for s in store.log("titan")) == [2, 3, 4, 5]
    before = _du(url)
    for snap in store.log("titan")[1:]:  # keep_latest_k=1
        store.delete(snap.id)
    report = store.gc()
    assert report.purged_now > 0 and report.grace_kept_bytes == 0
    assert _du(url) < 0.5 * before
    assert _loaded(str(url), "titan").same_as(app)  # resume from the newest
    assert store.check(read_data=True).ok
    store.close()
