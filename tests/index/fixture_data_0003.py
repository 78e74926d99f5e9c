"""Contents of the frozen revision-0003 index in ``data/`` and how it was made.

Generated once with the code of revision 0003 (before 0004 and 0005 added loose packs and the snapshots' health
summary) by running this file as a script; it writes ``data/index-0003.sqlite``. Never
regenerate it: it stands for databases already out there (deltas and payload digests
included). Add a new file for a new revision instead.
"""

from __future__ import annotations

import sqlite3
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
REVISION = "0003"
FILE = DATA / f"index-{REVISION}.sqlite"

META = {"format": "1", "store_id": "0a0b0c0d"}
# id -> (pack, offset, length, raw_length, codec, base_id, depth, payload_digest)
CHUNKS: dict[str, tuple[str, int, int, int, str, str | None, int, str | None]] = {
    "11" * 32: ("pack-a", 32, 40, 128, "zstd", None, 0, "aa" * 16),
    "22" * 32: ("pack-a", 72, 50, 128, "bytegroup-zstd", None, 0, "bb" * 16),
    "33" * 32: ("pack-b", 32, 9, 128, "xor-zstd", "11" * 32, 1, "cc" * 16),
}
SNAPSHOTS = [  # id, run, step, created_at, name, chunk ids, tags
    ("d4" * 32, "sft", 100, 1000.0, None, ("11" * 32, "22" * 32), ()),
    ("e5" * 32, "sft", 200, 2000.0, None, ("33" * 32, "22" * 32), ("best",)),
]


def generate(path: Path = FILE) -> None:
    """Builds the frozen database with the index code of revision ``REVISION``."""
    from ckstore.index import ChunkRecord, EntryRecord, Index, PackRecord, SnapshotRecord

    path.unlink(missing_ok=True)
    ix = Index.open(f"sqlite:///{path}")
    for key, value in META.items():
        ix.set_meta(key, value)
    for snap_id, run, step, created, name, ids, tags in SNAPSHOTS:
        session = ix.begin_session("fixture", 3600)
        known = {c.chunk_id for c in ix.all_chunks()}
        for pack in sorted({CHUNKS[c][0] for c in ids if c not in known}):
            recs = [
                ChunkRecord(c, *CHUNKS[c]) for c in ids if CHUNKS[c][0] == pack and c not in known
            ]
            ix.add_pack(session.id, PackRecord(pack, 1000, len(recs), 500.0), recs)
        ix.lookup_chunks(session.id, [c for c in ids if c in known])
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
        entry = EntryRecord("model/w", "tensor", "float32", (8, 4), 128, "e" * 64)
        ix.commit_snapshot(session.id, record, [entry], list(ids), 999, tags)
    ix.close()
    conn = sqlite3.connect(path)  # one small self-contained file: no WAL, 1 KiB pages
    conn.execute("PRAGMA journal_mode=DELETE")
    conn.execute("PRAGMA page_size=1024")
    conn.execute("VACUUM")
    conn.close()


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else FILE)
