"""Contents of the frozen revision-0001 index in ``data/`` and how it was made.

Generated once with the code of that revision by running this file as a script (with ckstore
importable); it writes ``data/index-<revision>.sqlite``. Never regenerate an existing revision's
file: it stands for databases already out there. Add a new file for a new revision instead.
"""

from __future__ import annotations

import sqlite3
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
REVISION = "0001"
FILE = DATA / f"index-{REVISION}.sqlite"

META = {"format": "1", "store_id": "0f0e0d0c"}
CHUNKS = {f"{i:02x}" * 32: (f"pack{i % 2}", i * 100, 50 + i, 128, "zstd") for i in range(4)}
SNAPSHOTS = [  # id, run, step, created_at, name, chunk indexes, tags
    ("a1" * 32, "sft", 100, 1000.0, None, (0, 1), ()),
    ("b2" * 32, "sft", 200, 2000.0, "sft-final", (1, 2), ("best",)),
    ("c3" * 32, "lora/x", None, 3000.0, None, (3,), ("v1.0",)),
]
ENTRY = ("model/w", "tensor", "float32", (8, 4), 128, "e" * 64)


def generate(path: Path = FILE) -> None:
    """Builds the frozen database with the index code of revision ``REVISION``."""
    from ckstore.index import ChunkRecord, EntryRecord, Index, PackRecord, SnapshotRecord

    path.unlink(missing_ok=True)
    ix = Index.open(f"sqlite:///{path}")
    for key, value in META.items():
        ix.set_meta(key, value)
    for snap_id, run, step, created, name, chunk_idx, tags in SNAPSHOTS:
        session = ix.begin_session("fixture", 3600)
        ids = [list(CHUNKS)[i] for i in chunk_idx]
        for pack in sorted({CHUNKS[c][0] for c in ids}):
            recs = [ChunkRecord(c, *CHUNKS[c]) for c in ids if CHUNKS[c][0] == pack]
            ix.add_pack(session.id, PackRecord(pack, 1000, len(recs), 500.0), recs)
        record = SnapshotRecord(
            snap_id,
            run,
            step,
            None,
            f"m-{snap_id[:8]}",
            created,
            {"step": step},
            256,
            100,
            1,
            1,
            name,
            1,
        )
        ix.commit_snapshot(session.id, record, [EntryRecord(*ENTRY)], ids, 999, tags)
    ix.close()
    conn = sqlite3.connect(path)  # one small self-contained file: no WAL, 1 KiB pages
    conn.execute("PRAGMA journal_mode=DELETE")
    conn.execute("PRAGMA page_size=1024")
    conn.execute("VACUUM")
    conn.close()


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else FILE)
