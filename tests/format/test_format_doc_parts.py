"""docs/FORMAT.md section 7.7 (manifests in parts): its worked examples, rebuilt with the code
and compared byte for byte, then read back as a reader must."""

from __future__ import annotations

import json

import pytest
import torch

from ckstore import objects
from ckstore.errors import CorruptionError
from ckstore.format.grid import make_grid
from ckstore.format.layout import Layout
from ckstore.format.manifest import (
    ChunkRef,
    Manifest,
    PerRankEntry,
    TensorEntry,
    ValueEntry,
    entry_digest,
)
from ckstore.format.parts import Part, Root, Shell, assemble, build_tree, parse_any, parse_node

from .test_format_doc import VECTORS, _fields

HEADER = {
    "run": "r",
    "step": 1,
    "created_at": 0.0,
    "metadata": {},
    "name": None,
    "session": "s",
    "world_size": 2,
}
APPS = {
    "model": {
        "$cls": "dict",
        "$dict": [["w", {"$ref": "model/w"}], ["step", {"$ref": "model/step"}]],
    }
}


def _doc(name: str) -> bytes:
    return VECTORS[name].rstrip("\n").encode()


def _parts() -> list[Part]:
    w = torch.arange(8, dtype=torch.float32).numpy().tobytes()
    ids = [objects.chunk_id(w[:16]), objects.chunk_id(w[16:])]
    return [
        Part(
            r,
            {"model/w": (ChunkRef((4 * r,), (4,), ids[r]),)},
            {"model/step": ValueEntry(3 + r)},
            {},
        )
        for r in range(2)
    ]


def _root(parts: list[Part]) -> Root:
    level, nodes = build_tree([(objects.chunk_id(p.to_json()), len(p.to_json())) for p in parts])
    assert not nodes  # two parts fit the root
    shells = {
        "model/w": Shell(TensorEntry("float32", (8,), (), (4,)), 0),
        "model/step": Shell(None),
    }
    return Root(APPS, {}, shells, (Layout((2,), (0,)),), level, HEADER)


def test_the_vectors_are_present() -> None:
    assert {
        "parts-part",
        "parts-ids",
        "parts-root",
        "parts-root-id",
        "parts-node",
        "layout",
    } <= set(VECTORS)


def test_part_bytes_and_ids() -> None:
    parts = _parts()
    assert parts[0].to_json() == _doc("parts-part")
    f = _fields("parts-ids")
    for r, p in enumerate(parts):
        pid, size = f[("part zero", "part one")[r]].split()
        assert (objects.chunk_id(p.to_json()), len(p.to_json())) == (pid, int(size))
    assert parts[0].pieces["model/w"][0].id == _fields("chunk-id")["id"]


def test_root_bytes_and_snapshot_id() -> None:
    raw = _root(_parts()).to_json()
    assert raw == _doc("parts-root")
    assert len(raw) == 656
    assert objects.chunk_id(raw) == _fields("parts-root-id")["snapshot id"]
    root = parse_any(raw, "the example")
    assert isinstance(root, Root) and root.to_json() == raw  # parse and re-encode: the identity


def test_assembled_is_the_version_1_manifest_with_per_rank_step() -> None:
    parts = _parts()
    root = Root.from_json(_doc("parts-root"))
    read = [Part.from_json(p.to_json(), f"part {r}", r, root) for r, p in enumerate(parts)]
    m = assemble(root, read, ["a" * 64, "b" * 64], "the example")
    v1 = Manifest.from_json(_doc("manifest-json"))
    # the same boxes and ids (the section's parts were written without the chunks' checks,
    # which the digest leaves out: a ref without its check is verified by its id)
    assert entry_digest(m.entries["model/w"]) == entry_digest(v1.entries["model/w"])
    assert m.entries["model/step"] == PerRankEntry((ValueEntry(3), ValueEntry(4)))
    assert m.parted == {"model/w", "model/step"} and m.parts == ("a" * 64, "b" * 64)
    assert m.referenced_ids() == v1.chunk_ids() | {"a" * 64, "b" * 64}


def test_node_vector() -> None:
    parts = [(objects.chunk_id(p.to_json()), len(p.to_json())) for p in _parts()]
    level, nodes = build_tree(parts + [("c" * 64, 9), ("d" * 64, 9)], fanout=2)
    assert nodes[0] == _doc("parts-node")
    assert (level.count, level.span, len(level.children)) == (4, 2, 2)
    node = parse_node(nodes[0], "node", 0, 2, level.span)
    assert node.children == tuple(parts)
    with pytest.raises(CorruptionError, match="covers parts from"):
        parse_node(nodes[0], "node", 2, 2, level.span)


def test_layout_vector() -> None:
    layout = Layout((2, 2), (0, None))
    shape = (10, 3)
    f = _fields("layout")
    box = lambda b: f"[{b[0][0]},{b[0][1]}]+[{b[1][0]},{b[1][1]}]"  # noqa: E731
    assert box(layout.box(shape, (0, 0))) == f["box of rank zero"]
    assert box(layout.box(shape, (1, 1))) == f["box of rank three"]
    held = "; ".join(f"{box(b)} {h}" for b, h in layout.holdings(shape, ((0, 0), shape)))
    assert held == f["holders"]
    grid = make_grid(shape, 4, 16)
    assert (
        str(sorted(layout.writers("k", grid, ((0, 0), (4, 3)))))
        == f["parts for the first four rows"]
    )
    assert (
        str(sorted(layout.writers("k", grid, ((4, 0), (2, 3)))))
        == f["parts for rows four and five"]
    )


def test_a_part_must_match_its_place_and_the_root() -> None:
    root = Root.from_json(_doc("parts-root"))
    good = json.loads(_doc("parts-part"))
    raw = _doc("parts-part")
    with pytest.raises(CorruptionError, match="part of rank 0, not 1"):
        Part.from_json(raw, "part 1", 1, root)
    lacking = dict(good, own={})
    with pytest.raises(CorruptionError, match="per-rank values do not match"):
        Part.from_json(json.dumps(lacking).encode(), "part 0", 0, root)
    stray = dict(good, pieces={"model/step": good["pieces"]["model/w"]})
    with pytest.raises(CorruptionError, match="no sharded tensor"):
        Part.from_json(json.dumps(stray).encode(), "part 0", 0, root)


def test_a_root_whose_parts_do_not_match_its_world_is_refused() -> None:
    doc = json.loads(_doc("parts-root"))
    doc["snapshot"]["world_size"] = 3
    with pytest.raises(CorruptionError, match="2 parts for world_size 3"):
        Root.from_json(json.dumps(doc).encode())
    doc = json.loads(_doc("parts-root"))
    doc["parts"]["children"] = doc["parts"]["children"][:1]
    with pytest.raises(CorruptionError, match="malformed list of parts"):
        Root.from_json(json.dumps(doc).encode())
    doc = json.loads(_doc("parts-root"))
    doc["entries"]["model/w"]["parts"] = {"layout": 1}
    with pytest.raises(CorruptionError, match="malformed parts"):
        Root.from_json(json.dumps(doc).encode())


def test_assembly_refuses_pieces_that_do_not_tile() -> None:
    parts = _parts()
    root = Root.from_json(_doc("parts-root"))
    overlapping = Part(1, {"model/w": (parts[0].pieces["model/w"][0],)}, parts[1].own, {})
    with pytest.raises(CorruptionError, match="model/w"):
        assemble(root, [parts[0], overlapping], [], "the example")


def test_an_unknown_later_version_asks_for_an_upgrade() -> None:
    doc = json.loads(_doc("parts-root"))
    doc["version"] = 3
    with pytest.raises(CorruptionError, match="upgrade ckstore"):
        parse_any(json.dumps(doc).encode(), "root")
