"""The floor of a verified restore on this machine, measured beside it.

An atomic restore must check every stored byte before it changes anything of the caller's, so
it reads each payload twice: once to check it, once to copy it into place. Its floor is one
check pass plus one copy pass over the snapshot's stored payloads, on the restore's threads:
what no implementation of that design can go under, whatever its Python around the passes
costs. ``restore(atomic=False)`` checks each block in cache right after it lands, so its
floor is about the copy pass alone, which is what the peers that check nothing do
(``torch.load(mmap=True)`` + ``copy_``).

The check pass hashes (XXH3-64, the hash of each chunk's check) through new read-only mappings
of the packs, their teardown included, as ckstore's first pass does; reading into a small
buffer and hashing it there measured the same. The copy pass reads each payload straight into
memory touched beforehand (the destination of a restore in place).
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

Payload = tuple[str, int, int]  # pack file, offset, length


def snapshot_payloads(store: Any, ref: str, prefix: str = "") -> tuple[list[Payload], int]:
    """The stored payloads a restore of ``ref`` from the local ``store`` reads, in pack order
    (each chunk and the bases of its deltas once), and the stored bytes among them that are not
    raw (those need decoding besides, which this floor leaves out). With ``prefix``, those of
    the tensors whose keys start with it (``"model/"``: the weights alone)."""
    from ckstore.objects.packs import pack_name

    repo = store.repository
    snap = store.get(ref)
    ids = repo.index.snapshot_chunk_ids(snap.id)
    if prefix:
        ids = {
            c.id
            for key, entry in snap.manifest.entries.items()
            if key.startswith(prefix)
            for e in (entry.tensors() if hasattr(entry, "tensors") else [entry])
            for c in getattr(e, "chunks", ())
        }
    rows = repo.index.chunk_locations(ids)
    root = Path(store.url)
    out, encoded = [], 0
    for r in sorted(rows.values(), key=lambda r: (r.pack_id, r.offset)):
        out.append((str(root / pack_name(r.pack_id)), r.offset, r.length))
        if r.codec not in ("none", "raw") or r.base_id is not None:
            encoded += r.length
    return out, encoded


@contextmanager
def _mapped(payloads: list[Payload]) -> Iterator[dict[str, np.ndarray]]:
    """New read-only mappings of the packs, as byte arrays (closed after)."""
    maps: dict[str, mmap.mmap] = {}
    arrays: dict[str, np.ndarray] = {}
    try:
        for path in {p for p, _, _ in payloads}:
            fd = os.open(path, os.O_RDONLY)
            try:
                maps[path] = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
        arrays.update((p, np.frombuffer(m, dtype=np.uint8)) for p, m in maps.items())
        yield arrays
    finally:
        arrays.clear()  # the views go before their mappings close
        for m in maps.values():
            m.close()


def check_pass(payloads: list[Payload], threads: int) -> float:
    """Seconds to hash every payload (XXH3-64) through new mappings on ``threads`` threads,
    their teardown included (a reader gives the pages back: ckstore bounds what stays mapped)."""
    import xxhash

    with ThreadPoolExecutor(threads) as pool:
        t0 = time.perf_counter()
        with _mapped(payloads) as arrays:

            def one(p: Payload) -> int:
                path, off, n = p
                return int(xxhash.xxh3_64_intdigest(memoryview(arrays[path][off : off + n])))

            list(pool.map(one, payloads))
        return time.perf_counter() - t0


def copy_pass(payloads: list[Payload], threads: int, out: np.ndarray | None = None) -> float:
    """Seconds to read every payload into ``out`` (touched before; made by torch and touched
    here when None: 4 KiB pages, as the tensors of a model are, where numpy would ask for huge
    pages) with ``preadv`` on ``threads`` threads: the cheapest copy out of the page cache
    measured here (through new mappings, their teardown included, it took 33 ms against 23 ms
    for 270 MiB on 2 cores)."""
    import torch  # the destination's memory as a restore's is: torch's allocator

    total = sum(n for _, _, n in payloads)
    dest = memoryview(torch.ones(total, dtype=torch.uint8).numpy() if out is None else out)
    starts = np.cumsum([0] + [n for _, _, n in payloads[:-1]]).tolist()
    with ThreadPoolExecutor(threads) as pool:
        t0 = time.perf_counter()
        fds = {path: os.open(path, os.O_RDONLY) for path in {p for p, _, _ in payloads}}
        try:

            def one(i: int) -> None:
                path, off, n = payloads[i]
                got = 0
                while got < n:
                    k = os.preadv(fds[path], [dest[starts[i] + got : starts[i] + n]], off + got)
                    if k <= 0:
                        raise OSError(f"{path} ends before {off + n} bytes")
                    got += k

            list(pool.map(one, range(len(payloads))))
        finally:
            for fd in fds.values():
                os.close(fd)
        return time.perf_counter() - t0
