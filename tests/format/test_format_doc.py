"""docs/FORMAT.md's worked examples are test vectors: parse them out of the doc, rebuild them
with the code, compare byte for byte. Also runs every Python snippet of docs/USAGE.md."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import ckstore
from ckstore import objects
from ckstore.engine.config import FEATURES, FORMAT_VERSION, StoreConfig
from ckstore.engine.take.packing import TakeOptions
from ckstore.engine.take.plan import finish_entries, plan
from ckstore.format.grid import make_grid
from ckstore.format.manifest import Manifest
from ckstore.objects import packs as packs_mod
from tests.support.paths import REPO

DOCS = REPO / "docs"
_VECTOR = re.compile(r"<!-- vector: ([a-z0-9-]+) -->\s*```[a-z]*\n(.*?)```", re.S)


def _vectors() -> dict[str, str]:
    found: dict[str, str] = {}
    for name, body in _VECTOR.findall((DOCS / "FORMAT.md").read_text()):
        assert name not in found, f"vector {name!r} appears twice"
        found[name] = body
    return found


VECTORS = _vectors()


def _fields(name: str) -> dict[str, str]:
    """A vector written as ``key: value`` lines; a line without ``key:`` continues the last."""
    out: dict[str, str] = {}
    key = None
    for line in VECTORS[name].splitlines():
        m = re.match(r"^([a-z][a-z ]*): ?(.*)$", line)
        if m:
            key = m.group(1)
            out[key] = m.group(2).strip()
        elif line.strip():
            assert key is not None, line
            out[key] += " " + line.strip()
    return out


def _hex(text: str) -> bytes:
    return bytes.fromhex("".join(text.split()))


def _arange4() -> bytes:
    return torch.arange(4, dtype=torch.float32).numpy().tobytes()


def test_every_vector_is_present() -> None:
    want = {
        "empty-id",
        "chunk-id",
        "ckstore-json",
        "grid",
        "pieces",
        "bytegroup",
        "pack-hex",
        "pack-id",
        "manifest-json",
        "manifest-id",
        "delta",
        "payload-digest",
        "chunk-check",
        "health",
        "export-digests",
    }
    assert want <= set(VECTORS), sorted(want - set(VECTORS))


def test_empty_id() -> None:
    assert objects.chunk_id(b"") == _fields("empty-id")["id"]


def test_chunk_id_of_a_small_tensor() -> None:
    f = _fields("chunk-id")
    assert f["tensor"] == "torch.arange(4, dtype=torch.float32)"
    assert _hex(f["raw"]) == _arange4()
    assert objects.chunk_id(_arange4()) == f["id"]
    assert objects.chunk_id(torch.arange(4, dtype=torch.float32).numpy()) == f["id"]


def test_payload_digest_vector() -> None:
    from ckstore.objects.hashing import payload_digest

    f = _fields("payload-digest")
    assert _hex(f["payload"]) == _arange4() and f["id"] == _fields("chunk-id")["id"]
    assert (
        payload_digest(_hex(f["payload"]), f["id"], f["codec"], int(f["raw length"])) == f["digest"]
    )


def test_chunk_check_vector() -> None:
    f = _fields("chunk-check")
    assert _hex(f["raw"]) == _arange4() and f["id"] == _fields("chunk-id")["id"]
    assert int(f["seed"]) == int.from_bytes(bytes.fromhex(f["id"][:16]), "little")
    assert objects.raw_check(_arange4(), f["id"]) == f["check"]
    import xxhash

    assert xxhash.xxh3_64_hexdigest(_arange4(), seed=int(f["seed"])) == f["check"]


def test_the_id_never_depends_on_the_codec() -> None:
    raw = torch.linspace(0, 1, 4096, dtype=torch.float32).numpy().tobytes()
    for codec, payload in (
        objects.encode(raw, 4, True),
        objects.encode(raw, 4, False),
        ("none", raw),
    ):
        assert objects.chunk_id(objects.decode(codec, payload, len(raw))) == objects.chunk_id(raw)
    assert objects.encode(raw, 4, True)[0] == "bytegroup-zstd"
    assert objects.encode(raw, 4, False)[0] == "zstd"


def test_ckstore_json_example() -> None:
    raw = VECTORS["ckstore-json"].encode()
    cfg = StoreConfig.from_json(raw, "doc")
    assert cfg.to_json() == raw
    assert cfg.features == FEATURES and cfg.format_version == FORMAT_VERSION == 1
    fresh = StoreConfig.new(None, None, None)
    assert dataclasses.replace(fresh, store_id=cfg.store_id) == cfg  # the defaults shown


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.strip("[]").split(",") if x.strip())


def test_grid_examples() -> None:
    rows = [ln for ln in VECTORS["grid"].splitlines() if ln.strip() and not ln.startswith("#")]
    assert len(rows) >= 5
    for row in rows:
        m = re.match(r"^(\[[^\]]*\])\s+(\d+)\s+(\d+)\s+(\[[^\]]*\])\s+(.*)$", row)
        assert m, row
        shape, itemsize, chunk_bytes, block = (
            _ints(m.group(1)),
            int(m.group(2)),
            int(m.group(3)),
            _ints(m.group(4)),
        )
        grid = make_grid(shape, itemsize, chunk_bytes)
        assert grid.block == block, row
        boxes = list(grid.boxes())
        rest = m.group(5).strip()
        count = re.fullmatch(r"(\d+) boxes", rest)
        more = re.search(r"(\d+) more$", rest)
        listed = re.findall(r"(\[[^\]]*\])\+(\[[^\]]*\])", rest)
        if count:
            assert len(boxes) == int(count.group(1)), row
            continue
        assert [(_ints(o), _ints(s)) for o, s in listed] == boxes[: len(listed)], row
        assert len(boxes) == len(listed) + (int(more.group(1)) if more else 0), row
        for offsets, sizes in boxes:  # every box is one contiguous byte range
            start, stop = grid.byte_range(offsets, sizes)
            assert 0 <= start < stop <= grid.nbytes


def test_pieces_example() -> None:
    """Section 4.1: grid blocks cut by shard boxes, global offsets, and they tile the tensor."""
    from ckstore.format.boxes import pieces
    from ckstore.format.manifest import ChunkRef, tiling_problem

    f = _fields("pieces")
    shape, itemsize, chunk_bytes = _ints(f["shape"]), int(f["itemsize"]), int(f["chunk bytes"])
    boxes = re.findall(r"(\[[^\]]*\])\+(\[[^\]]*\])", f["shard boxes"])
    shards = [(_ints(o), _ints(s)) for o, s in boxes]
    want = [(_ints(o), _ints(s)) for o, s in re.findall(r"(\[[^\]]*\])\+(\[[^\]]*\])", f["pieces"])]
    grid = make_grid(shape, itemsize, chunk_bytes)
    got = sorted(p for box in shards for p in pieces(grid, box))
    assert got == want
    assert tiling_problem(shape, [ChunkRef(o, s, "0" * 64) for o, s in got]) is None


def test_bytegroup_decoding_vector() -> None:
    f = _fields("bytegroup")
    raw = _hex(f["raw"])
    assert raw == _arange4()
    assert bytes(objects.decode("bytegroup-zstd", _hex(f["payload"]), len(raw))) == raw


def test_exp_zstd_decoding_vector() -> None:
    from ckstore.objects.hashing import new_hasher

    f = _fields("exp-zstd")
    raw, payload = _hex(f["raw"]), _hex(f["payload"])
    assert raw == _arange4()
    assert bytes(objects.decode("exp-zstd", payload, len(raw))) == raw
    hasher = new_hasher()
    objects.codecs.decode_hashed("exp-zstd", payload, len(raw), None, hasher)
    assert hasher.hexdigest() == _fields("chunk-id")["id"]
    codec, encoded = objects.encode(raw, 4, True, fast=True)  # ckstore's encoder: the same layout
    assert codec == "none" or bytes(encoded)[: 8 + 12] == payload[: 8 + 12]


def test_delta_decoding_vector() -> None:
    from ckstore.objects.delta import xor_into

    f = _fields("delta")
    base, raw = _hex(f["base"]), _hex(f["raw"])
    assert (
        base == _arange4() and objects.chunk_id(base) == f["base id"] == _fields("chunk-id")["id"]
    )
    assert objects.chunk_id(raw) == f["id"]
    out = bytearray(objects.decode(objects.XOR_BYTEGROUP_ZSTD, _hex(f["payload"]), len(raw)))
    xor_into(out, base)
    assert bytes(out) == raw
    # and through the object store, as a chain in a version 2 pack
    backend = objects.memory_backend()
    store = objects.ObjectStore(backend)
    w = store.new_pack_writer()
    w.add(f["base id"], "none", base, len(base))
    w.add(f["id"], objects.XOR_BYTEGROUP_ZSTD, _hex(f["payload"]), len(raw), f["base id"])
    _, _, (root, delta) = w.finish()  # type: ignore[misc]
    chained = dataclasses.replace(delta, base=root)
    assert bytes(store.read_chunk(chained)) == raw


def _one_chunk_pack(monkeypatch: pytest.MonkeyPatch) -> tuple[str, int, bytes]:
    monkeypatch.setattr(packs_mod.os, "urandom", lambda n: bytes(n))
    backend = objects.memory_backend()
    writer = objects.PackWriter(backend)
    raw = _arange4()
    codec, payload = objects.encode(raw, 4, True)
    assert codec == "none"
    writer.add(objects.chunk_id(raw), codec, payload, len(raw))
    pack_id, size, _ = writer.finish()  # type: ignore[misc]
    return pack_id, size, backend.get(objects.pack_name(pack_id))


def _hex_dump(text: str) -> bytes:
    """Parse ``OFFSET  hex bytes  | comment`` lines, checking each offset."""
    out = bytearray()
    for line in text.splitlines():
        if not line.strip():
            continue
        left = line.split("|", 1)[0].split()
        assert int(left[0], 16) == len(out), line
        out += bytes(int(b, 16) for b in left[1:])
    return bytes(out)


def test_pack_hex_dump_and_id(monkeypatch: pytest.MonkeyPatch) -> None:
    pack_id, size, data = _one_chunk_pack(monkeypatch)
    assert _hex_dump(VECTORS["pack-hex"]) == data
    f = _fields("pack-id")
    assert int(f["size"]) == size == len(data) == 168
    assert (
        f["pack id"] == pack_id == objects.chunk_id(data[:32] + data[-120:])
    )  # header+trailer+footer
    assert f["name"] == objects.pack_name(pack_id)
    backend = objects.memory_backend()
    backend.put(f["name"], data)  # the trailer alone rebuilds the chunk table
    (loc,) = objects.read_pack_index(backend, pack_id)
    assert (loc.chunk_id, loc.offset, loc.length, loc.raw_length, loc.codec) == (
        _fields("chunk-id")["id"],
        32,
        16,
        16,
        "none",
    )


def _example_manifest() -> Manifest:
    opts = TakeOptions(
        chunk_bytes=16, pack_bytes=1 << 20, inline_bytes=0, threads=1, lease_seconds=60.0
    )
    p = plan({"model": {"w": torch.arange(8.0), "step": 3}}, opts)
    for chunk in p.chunks:
        chunk.id = objects.chunk_id(chunk.view)
        chunk.check = objects.raw_check(chunk.view, chunk.id)
    finish_entries(p)
    header = {
        "run": "r",
        "step": 1,
        "created_at": 0.0,
        "metadata": {},
        "name": None,
        "session": "s",
    }
    return Manifest(p.apps, p.entries, header)


def test_manifest_json_and_id() -> None:
    doc_bytes = VECTORS["manifest-json"].rstrip("\n").encode()
    manifest = _example_manifest()
    assert manifest.to_json() == doc_bytes
    f = _fields("manifest-id")
    assert int(f["length"]) == len(doc_bytes)
    assert f["manifest id"] == f["snapshot id"] == objects.chunk_id(doc_bytes)
    assert f["name"] == objects.blob_name("manifests", f["manifest id"])
    parsed = Manifest.from_json(doc_bytes)
    assert parsed.to_json() == doc_bytes  # parse and re-encode is the identity
    first = parsed.entries["model/w"].chunks[0]  # type: ignore[union-attr]
    assert first.id == _fields("chunk-id")["id"]


def test_a_store_writes_the_example_manifest_id(tmp_path: Path) -> None:
    """The same state through the public take: same entries, so only the header differs."""
    import ckstore

    store = ckstore.open(tmp_path / "s", chunk_bytes=16, inline_bytes=0, create=True)
    snap = store.take({"model": ckstore.StateDict(w=torch.arange(8.0), step=3)}, run="r", step=1)
    doc = json.loads(VECTORS["manifest-json"])
    stored = json.loads(store.repository.objects.get_blob("manifests", snap.id))
    assert stored["entries"] == doc["entries"] and stored["apps"] == doc["apps"]
    assert snap.id == snap.record.manifest_id
    assert (tmp_path / "s" / objects.blob_name("manifests", snap.id)).is_file()
    assert (tmp_path / "s" / "index.sqlite").is_file() and (
        tmp_path / "s" / "ckstore.json"
    ).is_file()
    store.close()


def test_health_vector(tmp_path: Path) -> None:
    import ckstore
    from ckstore.format.manifest import canonical_json

    store = ckstore.open(tmp_path / "s", create=True, chunk_bytes=16, inline_bytes=0)
    state = {
        "m": ckstore.StateDict(
            w=torch.tensor([3.0, 4.0, float("nan"), float("inf")]), i=torch.arange(4)
        )
    }
    snap = store.take(state, run="r", step=1, on_nonfinite="ignore")
    assert canonical_json(snap.manifest.snapshot["health"]).decode() == VECTORS["health"].strip()  # type: ignore[index]
    assert (snap.record.nonfinite, snap.record.stale) == (2, None)
    store.close()


def test_export_digests_vector() -> None:
    import io

    from ckstore.format.digests import METADATA_KEY, self_digest
    from ckstore.format.tensors import byte_view
    from ckstore.interop._safetensors import Planned, write_stream

    f = _fields("export-digests")
    out = io.BytesIO()
    a = torch.arange(4, dtype=torch.float32)
    write_stream(
        out, [Planned("a", "m/a", "float32", (4,))], {"format": "pt"}, iter([("m/a", byte_view(a))])
    )
    raw = out.getvalue()
    n = int.from_bytes(raw[:8], "little")
    assert (n, len(raw)) == (int(f["header length"]), int(f["file size"]))
    rec = json.loads(json.loads(raw[8 : 8 + n])["__metadata__"][METADATA_KEY])
    assert rec["tensors"] == {"a": f["tensor digest"]} == {"a": _fields("chunk-id")["id"]}
    assert rec["header"] == f["header digest"] == self_digest(raw[: 8 + n], f["header digest"])


# --- docs/USAGE.md ---------------------------------------------------------------------------
_SNIPPET = re.compile(r"(<!-- not run[^>]*-->\s*)?```python\n(.*?)```", re.S)


def test_usage_snippets_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ```python block of USAGE.md not marked ``<!-- not run -->`` runs, in order."""
    monkeypatch.chdir(tmp_path)
    text = (DOCS / "USAGE.md").read_text()
    blocks = [body for skip, body in _SNIPPET.findall(text) if not skip]
    assert len(blocks) >= 5
    namespace: dict[str, object] = {"__name__": "usage"}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for i, code in enumerate(blocks):
            try:
                exec(compile(code, f"USAGE.md block {i}", "exec"), namespace)  # noqa: S102
            except Exception as exc:  # pragma: no cover - the message shows the block
                raise AssertionError(f"USAGE.md python block {i} failed: {exc!r}\n{code}") from exc
    assert os.path.isdir(tmp_path / "ckpts")
    # the guard's section records its warnings on purpose; no example prints one unasked
    unasked = [
        f"{w.filename}:{w.lineno}: {w.message}"
        for w in seen
        if issubclass(w.category, (ckstore.GuardWarning, ckstore.ResaveWarning))
    ]
    assert unasked == []


def test_readme_snippets_run_as_pasted(tmp_path: Path) -> None:
    """The README's ```python blocks, in order, in a fresh interpreter (so ``import ckstore``
    alone must make ``ckstore.dcp`` work) started in an empty directory."""
    text = (DOCS.parent / "README.md").read_text()
    blocks = [body for skip, body in _SNIPPET.findall(text) if not skip]
    assert len(blocks) >= 2
    script = tmp_path / "readme.py"
    script.write_text("\n".join(blocks))
    env = {**os.environ, "PYTHONPATH": str(DOCS.parent)}
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "ckpts" / "ckstore.json").is_file() and (
        tmp_path / "ts" / "ckstore.json"
    ).is_file()
