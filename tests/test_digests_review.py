"""Review of payload digests (index revision 0003): paths that could record a digest of
bytes nobody verified, or let an atomic restore touch the destination before it refuses a
chunk (docs/RELIABILITY.md, I3)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import ckstore
from ckstore import objects

KNOBS: dict[str, Any] = {"chunk_bytes": 4096, "inline_bytes": 64}


def _app(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    return {"m": ckstore.StateDict(dict(state))}


class _FlipOnce(objects.WrappingBackend):
    """Returns one ranged get of ``name`` at ``(offset, length)`` with a byte flipped, once: a
    read that went wrong in transit (the stored object is intact)."""

    def __init__(self, inner: objects.Backend, name: str, offset: int, length: int) -> None:
        super().__init__(inner)
        self.target: tuple[str, int, int | None] | None = (name, offset, length)

    def get(self, name: str, offset: int = 0, length: int | None = None) -> bytes:
        data = self.inner.get(name, offset, length)
        if (name, offset, length) == self.target:
            self.target = None
            buf = bytearray(data)
            buf[len(buf) // 2] ^= 0x10
            data = bytes(buf)
        return data


def test_gc_never_copies_a_delta_payload_it_did_not_verify(tmp_path: Path) -> None:
    """gc verified a delta by reading it a second time and copied the bytes of its first read,
    recording their digest: one bad read made a damaged payload with a matching digest, which
    an atomic restore only refuses after decoding it into the caller's tensors."""
    g = torch.Generator().manual_seed(3)
    w0 = torch.randn(64, 64, generator=g)
    w1 = w0 + 1e-3 * torch.randn(w0.shape, generator=g)
    with ckstore.open(tmp_path / "s", **KNOBS, create=True) as store:
        store.take(_app({"w": w0}), run="r", step=0)
        store.take(_app({"w": w1, "drop": torch.randn(64, 64, generator=g)}), run="r", step=1, delta_base="parent")
        store.take(_app({"w": w1}), run="keep")  # the deltas stay live, "drop" does not
        store.delete("r@1")
        delta = next(c for c in store.index.all_chunks() if c.base_id is not None)
        inner = store.objects.backend
        store.objects = objects.ObjectStore(_FlipOnce(inner, objects.pack_name(delta.pack_id), delta.offset, delta.length))
        try:
            store.gc(grace_seconds=0, repack_below=1.0)
        except ckstore.CorruptionError:
            pass  # refusing to copy is right too; copying the bad read is not
        store.objects = objects.ObjectStore(inner)
        dest = {"w": torch.zeros_like(w1)}
        store.get("keep").restore(_app(dest), memory_budget=0)
        assert torch.equal(dest["w"], w1)
        assert store.check(read_data=True).ok
