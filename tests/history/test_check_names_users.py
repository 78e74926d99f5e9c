"""``check`` names what damaged data breaks: the snapshots and keys using it (issue 27, item 15).

A flipped bit in a chunk, a missing pack, and a damaged base that a delta of another snapshot
is stored against: each problem lists the snapshots and keys that can no longer be restored.
"""

from __future__ import annotations

from pathlib import Path

import torch

import ckstore
from ckstore import cli, objects

TINY = {"chunk_bytes": 1024, "pack_bytes": 8192, "inline_bytes": 64}


def _flip_chunk(store: ckstore.Store, chunk_id: str) -> str:
    loc = store.repository.index.chunk_locations([chunk_id])[chunk_id]
    path = Path(store.url) / objects.pack_name(loc.pack_id)
    data = bytearray(path.read_bytes())
    data[loc.offset + loc.length // 2] ^= 0x01
    path.chmod(0o644)
    path.write_bytes(bytes(data))
    return loc.pack_id


def _build(path: Path) -> ckstore.Store:
    store = ckstore.open(path, create=True, **TINY)
    torch.manual_seed(0)
    frozen, head = torch.randn(4, 256), torch.randn(2, 256)
    store.take({"m": ckstore.StateDict(frozen=frozen, head=head)}, run="r", step=1)
    store.take({"m": ckstore.StateDict(frozen=frozen, head=head + 1)}, run="r", step=2)
    store.take({"m": ckstore.StateDict(other=torch.randn(2, 256))}, run="q", step=1)
    return store


def test_a_corrupt_chunk_names_its_snapshots_and_keys(tmp_path, capsys) -> None:
    store = _build(tmp_path / "s")
    frozen_chunk = store.get("r@1").manifest.entries["m/frozen"].chunks[0].id
    _flip_chunk(store, frozen_chunk)
    report = store.check(read_data=True)
    assert not report.ok
    (problem,) = [p for p in report.problems if p.object == frozen_chunk]
    r1, r2 = store.get("r@1"), store.get("r@2")
    assert problem.snapshots == (f"r@1 ({r1.id[:12]})", f"r@2 ({r2.id[:12]})")
    assert problem.keys == ("m/frozen",)
    assert "used by snapshot(s) r@1" in problem.message and "key(s) m/frozen" in problem.message
    store.close()
    assert cli.main(["--store", str(tmp_path / "s"), "check", "--read-data"]) == 1
    out = capsys.readouterr().out
    assert "r@2" in out and "m/frozen" in out and "q@1" not in out


def test_a_missing_pack_names_everything_in_it(tmp_path) -> None:
    store = _build(tmp_path / "s")
    other = store.get("q@1").manifest.entries["m/other"].chunks[0].id
    pack = store.repository.index.chunk_locations([other])[other].pack_id
    (Path(store.url) / objects.pack_name(pack)).unlink()
    report = store.check()
    (problem,) = [p for p in report.problems if p.kind == "missing-pack"]
    assert any(s.startswith("q@1 ") for s in problem.snapshots) and "m/other" in problem.keys
    d = report.to_dict()["problems"][0]
    assert d["snapshots"] and d["keys"]  # in --json too
    store.close()


def test_a_damaged_delta_base_names_the_snapshots_of_its_deltas(tmp_path) -> None:
    store = ckstore.open(tmp_path / "s", create=True, **TINY)
    torch.manual_seed(0)
    w = torch.randn(8, 256)
    store.take({"m": ckstore.StateDict(w=w)}, run="base", step=0)
    tuned = w.clone()
    tuned[:, :4] += 1e-3
    fine = store.take({"m": ckstore.StateDict(w=tuned)}, run="ft", step=1, delta_base="base")
    deltas = [
        c
        for c in store.repository.index.chunk_locations(fine.manifest.chunk_ids()).values()
        if c.base_id
    ]
    assert deltas, "the fine-tune stored deltas"
    _flip_chunk(store, deltas[0].base_id)
    report = store.check(read_data=True)
    named = {s.split(" ")[0] for p in report.problems for s in p.snapshots}
    assert {"base@0", "ft@1"} <= named
    store.close()
