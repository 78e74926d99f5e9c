"""A manifest read back is validated whole: its trees, its entries, and how chunks tile tensors."""

from __future__ import annotations

import hashlib
import json
import random
import statistics
import time
from itertools import pairwise
from typing import Any

import pytest

from ckstore.errors import CorruptionError
from ckstore.format.boxes import pieces
from ckstore.format.grid import make_grid
from ckstore.format.manifest import (
    ChunkRef,
    Manifest,
    PerRankEntry,
    TensorEntry,
    ValueEntry,
    tiling_problem,
)

Box = tuple[tuple[int, ...], tuple[int, ...]]


def _id(*parts: Any) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def _tensor(shape: tuple[int, ...], boxes: list[Box]) -> TensorEntry:
    return TensorEntry("float32", shape, tuple(ChunkRef(o, s, _id(o, s)) for o, s in boxes), shape)


def _doc(apps: dict[str, Any], entries: dict[str, Any]) -> bytes:
    return Manifest(apps, entries).to_json()


def _parse(raw: bytes) -> Manifest:
    return Manifest.from_json(raw, "test manifest")


def _edit(raw: bytes, fn: Any) -> bytes:
    doc = json.loads(raw)
    fn(doc)
    return json.dumps(doc).encode()


# --- the app trees and the entries must match (finding 1) ------------------------------------
APPS = {"m": {"$dict": [["w", {"$ref": "m/w"}], ["lr", {"$ref": "m/lr"}]], "$cls": "dict"}}
ENTRIES = {"m/w": _tensor((4, 4), [((0, 0), (4, 4))]), "m/lr": ValueEntry(0.1)}


def test_a_well_formed_manifest_parses() -> None:
    m = _parse(_doc(APPS, ENTRIES))
    assert set(m.entries) == {"m/w", "m/lr"}


def test_a_ref_to_a_missing_entry_is_corruption_naming_the_key() -> None:
    raw = _edit(
        _doc(APPS, ENTRIES), lambda d: d["apps"]["m"]["$dict"][0][1].update({"$ref": "m/ghost"})
    )
    with pytest.raises(CorruptionError, match="'m/ghost', which has no entry"):
        _parse(raw)


def test_an_entry_no_tree_references_is_corruption_naming_it() -> None:
    raw = _edit(_doc(APPS, ENTRIES), lambda d: d["apps"]["m"]["$dict"].pop())
    with pytest.raises(CorruptionError, match="'m/lr' is referenced by no app tree"):
        _parse(raw)


def test_a_key_referenced_twice_is_corruption() -> None:
    raw = _edit(
        _doc(APPS, ENTRIES), lambda d: d["apps"]["m"]["$dict"][1][1].update({"$ref": "m/w"})
    )
    with pytest.raises(CorruptionError, match="'m/w' is referenced twice"):
        _parse(raw)


@pytest.mark.parametrize(
    "tree", [{"$what": 1}, 7, {"$dict": [["k"]]}, {"$dict": 5}, {"$tuple": None}]
)
def test_a_malformed_tree_is_corruption(tree: Any) -> None:
    raw = _edit(_doc(APPS, ENTRIES), lambda d: d["apps"].update({"other": tree}))
    with pytest.raises(CorruptionError, match="tree of app 'other' is malformed"):
        _parse(raw)


# --- chunks must tile each tensor: no overlaps (finding 2) -----------------------------------
def test_overlapping_chunks_with_the_right_element_count_are_refused() -> None:
    # rows 0-1 and 1-2: 16 elements like the tensor, but row 1 twice and row 3 never
    e = _tensor((4, 4), [((0, 0), (2, 4)), ((1, 0), (2, 4))])
    with pytest.raises(
        CorruptionError, match=r"'m/w': chunks \[0, 0\]\+\[2, 4\] and \[1, 0\]\+\[2, 4\] overlap"
    ):
        _parse(_doc(APPS, {**ENTRIES, "m/w": e}))


def test_the_same_box_twice_is_refused() -> None:
    e = _tensor((2, 4), [((0, 0), (1, 4)), ((0, 0), (1, 4))])
    assert tiling_problem(e.shape, e.chunks) == "chunks [0, 0]+[1, 4] and [0, 0]+[1, 4] overlap"


def test_a_tiling_that_is_not_a_product_grid_is_accepted() -> None:
    # a brick wall: row 0 split at column 1, row 1 split at column 3 (the sweep path)
    ok = [((0, 0), (1, 1)), ((0, 1), (1, 3)), ((1, 0), (1, 3)), ((1, 3), (1, 1))]
    assert tiling_problem((2, 4), [ChunkRef(o, s, _id(o, s)) for o, s in ok]) is None
    bad = [((0, 0), (2, 2)), ((0, 2), (1, 2)), ((1, 1), (1, 2))]  # 4+2+2 elements; [1,1] twice
    problem = tiling_problem((2, 4), [ChunkRef(o, s, _id(o, s)) for o, s in bad])
    assert problem is not None and "overlap" in problem


def _shard_boxes(shape: tuple[int, ...], dim: int, world: int) -> list[Box]:
    step = -(-shape[dim] // world)
    out = []
    for r in range(world):
        lo = min(r * step, shape[dim])
        size = max(0, min(step, shape[dim] - lo))
        out.append(
            (
                tuple(lo if d == dim else 0 for d in range(len(shape))),
                tuple(size if d == dim else n for d, n in enumerate(shape)),
            )
        )
    return out


@pytest.mark.parametrize(
    ("shape", "chunk_bytes", "dim", "world"),
    [
        ((37, 24), 1024, 0, 3),
        ((20, 33), 256, 1, 2),
        ((10, 16), 128, 0, 4),
        ((6, 50, 7), 300, 2, 3),
        ((9, 70), 64, 1, 3),
    ],
)
def test_grid_blocks_cut_by_shard_boxes_are_accepted(
    shape: tuple[int, ...], chunk_bytes: int, dim: int, world: int
) -> None:
    grid = make_grid(shape, 4, chunk_bytes)
    boxes = [p for box in _shard_boxes(shape, dim, world) for p in pieces(grid, box)]
    assert len(boxes) > world
    assert (
        _parse(_doc({"m": {"$ref": "m/t"}}, {"m/t": _tensor(shape, boxes)})).entries["m/t"].chunks
    )


def test_random_tilings_and_one_moved_box() -> None:
    rng = random.Random(7)
    for _ in range(200):
        shape = tuple(rng.randint(1, 12) for _ in range(rng.randint(1, 3)))
        cuts = [
            sorted({0, n, *rng.sample(range(1, n), min(n - 1, rng.randint(0, 3)))})
            if n > 1
            else [0, n]
            for n in shape
        ]
        boxes: list[Box] = [((), ())]
        for c in cuts:
            boxes = [(o + (a,), s + (b - a,)) for o, s in boxes for a, b in pairwise(c)]
        chunks = [ChunkRef(o, s, _id(o, s)) for o, s in boxes]
        assert tiling_problem(shape, chunks) is None
        i = rng.randrange(len(chunks))
        c = chunks[i]
        d = rng.randrange(len(shape))
        if c.offsets[d] > 0:  # move one box back by one along d: it overlaps its neighbour
            moved = ChunkRef(tuple(o - (k == d) for k, o in enumerate(c.offsets)), c.sizes, c.id)
            assert tiling_problem(shape, chunks[:i] + [moved] + chunks[i + 1 :]) is not None


def test_per_rank_entries_are_validated_rank_by_rank() -> None:
    good = _tensor((4, 4), [((0, 0), (2, 4)), ((2, 0), (2, 4))])
    bad = _tensor((4, 4), [((0, 0), (2, 4)), ((1, 0), (2, 4))])
    apps = {"m": {"$ref": "m/x"}}
    assert (
        _parse(_doc(apps, {"m/x": PerRankEntry((good, ValueEntry(3)))})).entries["m/x"].kind
        == "per_rank"
    )
    with pytest.raises(CorruptionError, match=r"'m/x\[rank 1\]'.*overlap"):
        _parse(_doc(apps, {"m/x": PerRankEntry((good, bad))}))


@pytest.mark.parametrize(
    ("chunk", "why"),
    [
        ([[0, 0], [4, 4], "a" * 64 + "\n"], "64 lowercase hex"),
        ([[0, 0], [4, 4], "A" * 64], "64 lowercase hex"),
        ([[0, False], [4, 4], "a" * 64], "of 2 ints"),
        ([[0, 0], [4, 4.0], "a" * 64], "of 2 ints"),
        ([[0], [4], "a" * 64], "of 2 ints"),
        ([[0, 0], [4, 4]], "is not \\[offsets, sizes, id"),
        ([[0, 0], [4, 4], "a" * 64, "b" * 16, "c"], "is not \\[offsets, sizes, id"),
        ([[0, 0], [4, 4], "a" * 64, "B" * 16], "16 lowercase hex"),
        ([[0, 0], [4, 4], "a" * 64, "b" * 15], "16 lowercase hex"),
        ([[0, 0], [4, 4], "a" * 64, 7], "16 lowercase hex"),
        ([[0, 1], [4, 4], "a" * 64], "outside shape"),
    ],
)
def test_malformed_chunks_are_corruption(chunk: list[Any], why: str) -> None:
    raw = _edit(_doc(APPS, ENTRIES), lambda d: d["entries"]["m/w"].update({"chunks": [chunk]}))
    with pytest.raises(CorruptionError, match=why):
        _parse(raw)


def test_malformed_chunks_in_a_long_list_are_named() -> None:
    boxes = [((r, 0), (1, 4)) for r in range(40)]
    raw = _doc({"m": {"$ref": "m/t"}}, {"m/t": _tensor((40, 4), boxes)})
    with pytest.raises(CorruptionError, match=r"\[\[7, 0\], \[1, True\]"):
        _parse(_edit(raw, lambda d: d["entries"]["m/t"]["chunks"][7].__setitem__(1, [1, True])))


def test_checks_in_a_long_list_are_checked_in_bulk_and_named() -> None:
    boxes = [((r, 0), (1, 4)) for r in range(40)]
    raw = _doc({"m": {"$ref": "m/t"}}, {"m/t": _tensor((40, 4), boxes)})

    def with_checks(d: dict[str, Any], bad: int | None = None) -> None:
        for i, c in enumerate(d["entries"]["m/t"]["chunks"]):
            c.append("0123456789abcdef" if i != bad else "0123456789abcdeF")

    parsed = _parse(_edit(raw, with_checks)).entries["m/t"]
    assert {c.check for c in parsed.chunks} == {"0123456789abcdef"}  # type: ignore[union-attr]
    with pytest.raises(CorruptionError, match=r"\[\[9, 0\], \[1, 4\].*16 lowercase hex"):
        _parse(_edit(raw, lambda d: with_checks(d, 9)))


def test_a_version_1_manifest_reads_and_has_no_checks() -> None:
    raw = _edit(_doc(APPS, ENTRIES), lambda d: d.update(version=1))
    entry = _parse(raw).entries["m/w"]
    assert all(c.check is None for c in entry.chunks)  # type: ignore[union-attr]
    with pytest.raises(CorruptionError, match="reads 1, 2"):
        _parse(_edit(raw, lambda d: d.update(version=3)))


def test_ten_thousand_chunks_parse_fast() -> None:
    """A 100 x 100 product of pieces (the case a plain sweep would make quadratic) parses fast."""
    shape = (100, 3200, 64)
    grid = make_grid(shape, 4, 32 * 64 * 4)  # blocks of (1, 32, 64): 100 x 100 of them
    boxes = list(grid.boxes())
    assert len(boxes) == 10_000
    raw = _doc({"m": {"$ref": "m/t"}}, {"m/t": _tensor(shape, boxes)})
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        _parse(raw)
        times.append(time.perf_counter() - t0)
    print(
        f"10,000-chunk manifest ({len(raw) >> 10} KiB) parsed in {statistics.median(times) * 1000:.1f} ms"
    )
    assert statistics.median(times) < 0.5  # about 30 ms here; a quadratic check takes seconds
