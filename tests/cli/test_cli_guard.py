"""The guard on the command line: ``log --healthy`` and the health column, ``show``'s health
lines, the ``run@healthy`` ref, ``gc --no-keep-healthy``, ``verify`` (without torch) and
``import --no-verify``."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

import ckstore
from tests.cli.test_cli import ck, ok_json
from tests.cli.test_cli_torch_free import no_torch
from tests.support.training import Trainer

TINY = {"chunk_bytes": 1024, "pack_bytes": 8192, "inline_bytes": 64}


@pytest.fixture(scope="module")
def diverged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Run r: steps 1-2 healthy, step 3 stale (no optimizer step), step 4 with a NaN; and an
    export of r@2 beside the store."""
    root = tmp_path_factory.mktemp("guardcli")
    t = Trainer.make()
    with warnings.catch_warnings(), ckstore.open(root / "store", create=True, **TINY) as store:
        warnings.simplefilter("ignore")
        for step in (1, 2):
            t.train()
            store.take(t.app_state(), run="r", step=step)
        t.forward_backward_only()
        store.take(t.app_state(), run="r", step=3)
        with torch.no_grad():
            t.model[0].weight[0, 0] = float("nan")
        t.train()
        store.take(t.app_state(), run="r", step=4)
        store.get("r@2").export(root / "export", keys="**")  # the optimizer too
    return root


def test_log_show_and_the_healthy_ref(diverged: Path) -> None:
    store = str(diverged / "store")
    rows = ok_json(ck("--store", store, "log", "--json"))
    assert [(r["step"], r["healthy"], r["nonfinite"], r["stale"]) for r in rows] == [
        (4, False, rows[0]["nonfinite"], 0),
        (3, False, 0, rows[1]["stale"]),  # finite, but the optimizer did not step
        (2, True, 0, 0),
        (1, True, 0, None),
    ]
    assert (
        rows[0]["nonfinite"] >= 1 and rows[1]["stale"] >= 12
    )  # 6 parameters and their 2 moments each
    table = ck("--store", store, "log")
    assert table.returncode == 0 and "NaN/Inf:" in table.stdout and "stale:" in table.stdout
    healthy = ok_json(ck("--store", store, "log", "--healthy", "--json"))
    assert [r["step"] for r in healthy] == [2, 1]  # neither the NaN nor the stale snapshot
    shown = ck("--store", store, "show", "r@healthy")
    assert shown.returncode == 0 and "step:       2" in shown.stdout
    shown = ck("--store", store, "show", "r@3")
    assert "stale:      18 tensors unchanged since step 2: model/*.bias (3 tensors)" in shown.stdout
    bad = ok_json(ck("--store", store, "show", "r", "--json"))
    assert (
        bad["health"]["nonfinite"] == bad["nonfinite"]
        and "model/0.weight" in bad["health"]["tensors"]
    )
    assert "UNHEALTHY" in ck("--store", store, "show", "r").stdout


def test_diff_shows_where_the_run_went_bad(diverged: Path) -> None:
    """diff carries each side's recorded health (issue 25, item 2): the NaN that appeared
    between r@2 and r@4 is named on its key, with the norms of the changed tensors."""
    store = str(diverged / "store")
    with ckstore.open(diverged / "store") as s:
        d = s.diff("r@2", "r@4")
    assert d.a.health is not None and d.a.health["nonfinite"] == 0
    assert d.b.health is not None and d.b.health["nonfinite"] >= 1
    w = d["model/0.weight"]
    assert w.health_a is not None and w.health_a["nan"] == 0
    assert w.health_b is not None and w.health_b["nan"] >= 1  # the step spread it over the tensor
    assert all(k.health_a is not None and k.health_a["nan"] == 0 for k in d.keys if k.health_a)
    js = ok_json(ck("--store", store, "diff", "r@2", "r@4", "--json"))
    assert js["b"]["health"]["nonfinite"] >= 1
    assert (
        next(k for k in js["keys"] if k["key"] == "model/0.weight")["health_b"]["nan"]
        == w.health_b["nan"]
    )
    out = ck("--store", store, "diff", "r@2", "r@4")
    assert out.returncode == 0, out.stderr
    assert "health a: ok" in out.stdout and "health b: UNHEALTHY" in out.stdout
    row = next(line for line in out.stdout.splitlines() if "model/0.weight" in line)
    assert f"NaN {w.health_b['nan']} Inf 0" in row and "norm " in row
    stale = ck("--store", store, "diff", "r@2", "r@3").stdout
    assert "health b: ok; stale: model/*.bias (3 tensors)" in stale


def test_gc_keeps_the_newest_healthy_unless_told(diverged: Path) -> None:
    store = str(diverged / "store")
    kept = ok_json(ck("--store", store, "gc", "--keep-last", "1", "--dry-run", "--json"))
    assert sorted(kept["snapshots_dropped"]) == ["r@1", "r@3"]  # r@2, the newest healthy, stays
    told = ok_json(
        ck("--store", store, "gc", "--keep-last", "1", "--no-keep-healthy", "--dry-run", "--json")
    )
    assert sorted(told["snapshots_dropped"]) == ["r@1", "r@2", "r@3"]


def test_verify_without_torch_and_its_exit_codes(diverged: Path, tmp_path: Path) -> None:
    out = diverged / "export"
    good = no_torch("verify", str(out))
    assert good.returncode == 0, good.stderr
    assert good.stdout.strip().endswith(
        "tensors checked against their BLAKE3 digests"
    ) and good.stdout.startswith("ok")
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in out.iterdir():
        copy.joinpath(f.name).write_bytes(f.read_bytes())
    f = copy / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-3] ^= 0x10
    f.write_bytes(raw)
    damaged = no_torch("verify", str(copy), "--json")
    assert damaged.returncode == 5, damaged.stderr
    report = json.loads(damaged.stdout)
    assert (
        not report["ok"]
        and {
            "file": "model.safetensors",
            "tensor": "optim.state.5.step",
            "problem": "bytes differ from the recorded digest",
        }
        in report["problems"]
    )
    plain = tmp_path / "plain.pt"
    torch.save({"w": torch.ones(2)}, plain)
    assert ck("verify", str(plain)).returncode == 1  # nothing to check against
    assert ck("verify", str(tmp_path / "missing")).returncode == 3
    store = ck("--store", str(tmp_path / "s"), "init")
    assert store.returncode == 0
    refused = ck("--store", str(tmp_path / "s"), "import", str(copy), "--run", "x")
    assert refused.returncode == 5 and "tensor 'optim.state.5.step'" in refused.stderr
    forced = ck(
        "--store", str(tmp_path / "s"), "import", str(copy), "--run", "x", "--no-verify", "--json"
    )
    assert forced.returncode == 0, forced.stderr
