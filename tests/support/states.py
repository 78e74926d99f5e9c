"""Deterministic states for tests (importable from subprocesses too)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

import ckstore
from ckstore import objects
from ckstore.format.dtypes import DTYPES

SHAPES = [(), (0,), (7,), (5, 3), (3, 0, 2), (64, 33)]


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random bit patterns (NaN/Inf payloads included) of any dtype, bit-exact reproducible."""
    n = 1
    for s in shape:
        n *= s
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def dtype_matrix(seed: int = 0) -> dict[str, torch.Tensor]:
    """One tensor per (dtype, shape), plus strided, transposed and storage-sharing views."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, dtype in DTYPES.items():
        for shape in SHAPES:
            out[f"{name}_{'x'.join(map(str, shape)) or 'scalar'}"] = random_tensor(
                dtype, shape, gen
            )
    base = random_tensor(torch.float32, (40, 30), gen)
    out["transposed"] = base.t()
    out["strided"] = base[::3, 1::2]
    out["shares_a"] = base[:10]
    out["shares_b"] = base[5:20]
    out["expanded"] = torch.arange(5.0).expand(4, 5)
    return out


def bits(t: torch.Tensor) -> bytes:
    """The exact element bytes of a tensor, for bit-exact comparison (NaN == NaN here)."""
    c = t.detach().cpu().contiguous()
    return c.reshape(-1).view(torch.uint8).numpy().tobytes() if c.numel() else b""


class DrawsRandomNumbers:
    """A stateful whose state_dict() and load_state_dict() draw from every generator (torch,
    ``random``, NumPy): what RNGState's capture-first, load-last order must undo."""

    def state_dict(self) -> dict[str, int]:
        torch.rand(2)
        random.random()
        np.random.rand(2)
        return {"n": 1}

    def load_state_dict(self, state: dict[str, int]) -> None:
        torch.rand(3)
        random.random()
        np.random.rand(3)


def forget_payload_digests(store: object) -> None:
    """Make every chunk of ``store`` look written before index revision 0003 (no payload
    digest recorded), as in a migrated or reindexed store: readers then verify by decoding."""
    from sqlalchemy import text

    with store.repository.index._engine.begin() as conn:  # type: ignore[attr-defined]
        conn.execute(text("UPDATE chunks SET payload_digest = NULL"))


def flip_byte_of(store: ckstore.Store, snap: ckstore.StoredSnapshot, key: str) -> None:
    """Damage ``key``'s last chunk in its pack on disk: flip one bit in the middle of its payload."""
    entry = snap.manifest.entries[key]
    chunk = entry.chunks[-1].id  # type: ignore[union-attr]
    rec = store.repository.index.chunk_locations([chunk])[chunk]
    path = Path(store.url) / objects.pack_name(rec.pack_id)
    data = bytearray(path.read_bytes())
    data[rec.offset + rec.length // 2] ^= 0x40
    path.chmod(0o644)
    path.write_bytes(bytes(data))
