"""The commit transaction: one snapshot, its manifest, chunk references and tag moves.

Each function is one phase of :func:`commit`; all run inside the caller's single transaction, so
any error leaves nothing behind.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from sqlalchemy import delete, exists, func, literal, select, update
from sqlalchemy.engine import Connection

from ckstore.errors import ConflictError, InvalidInputError, NotFoundError
from ckstore.index import _convert, _refnames, _sql
from ckstore.index._batches import batches
from ckstore.index._resolve import MAX_STEP
from ckstore.index._sql import check_lease, insert, insert_ignore
from ckstore.index.names import parse_spec, validate_name
from ckstore.index.records import ChunkRecord, EntryRecord, PackRecord, SnapshotRecord


def commit(
    conn: Connection,
    session_id: str,
    snapshot: SnapshotRecord,
    entries: Sequence[EntryRecord],
    chunk_ids: list[str],
    manifest_size: int,
    tags: Sequence[str],
    packs: Sequence[tuple[PackRecord, Sequence[ChunkRecord]]] = (),
    staged: str | None = None,
) -> SnapshotRecord:
    """Commits one snapshot; see :meth:`ckstore.index.Index.commit_snapshot` for the contract."""
    validate(snapshot, tags)
    now = check_lease(conn, session_id, lock=True)
    if staged is not None:
        check_lease(conn, staged, lock=True)
    for pack, chunks in packs:
        add_pack(conn, pack, chunks, now)
    require_chunks(conn, chunk_ids)
    lock_run(conn, snapshot.run, now)  # no delete of the run's snapshots is half done now
    parent_id, seq = run_head(conn, snapshot.run)
    if tags or snapshot.name is not None or parent_id is None:
        _sql.names_lock(conn)  # this commit gives a name a meaning: one at a time
    _refnames.check_take(conn, snapshot.run, tags, snapshot.id, snapshot.name)
    require_free(conn, snapshot)
    stored = dataclasses.replace(snapshot, parent_id=parent_id)
    add_manifest(conn, snapshot.manifest_id, manifest_size, entries, now)
    conn.execute(insert(conn, _sql.snapshots), _convert.snapshot_row(stored, seq + 1))
    for batch in batches(chunk_ids):
        conn.execute(
            insert(conn, _sql.snapshot_chunks),
            [{"snapshot_id": snapshot.id, "chunk_id": cid} for cid in batch],
        )
    if staged is not None:
        reference_staged(conn, snapshot.id, staged)
        finish_session(conn, staged, "committed", now)
    for spec in tags:
        move_tag(conn, parse_spec(spec)[0], snapshot.id, now)
    finish_session(conn, session_id, "committed", now)
    return stored


def reference_staged(conn: Connection, snapshot_id: str, staged: str) -> None:
    """Makes every chunk session ``staged`` pins a chunk reference of the snapshot (those not
    referenced yet), in the database: the caller never holds the ids."""
    sc, p = _sql.snapshot_chunks, _sql.pins
    already = select(sc.c.chunk_id).where(
        (sc.c.snapshot_id == snapshot_id) & (sc.c.chunk_id == p.c.chunk_id)
    )
    rows = select(literal(snapshot_id), p.c.chunk_id).where(
        (p.c.session_id == staged) & ~exists(already)
    )
    conn.execute(insert(conn, sc).from_select(["snapshot_id", "chunk_id"], rows))


def check_pack(pack: PackRecord, chunks: Sequence[ChunkRecord]) -> None:
    """Raises InvalidInputError if a chunk claims to live in another pack."""
    strays = [ch.chunk_id for ch in chunks if ch.pack_id != pack.pack_id]
    if strays:
        raise InvalidInputError(f"chunk {strays[0]} is not in pack {pack.pack_id}")


def add_pack(
    conn: Connection,
    pack: PackRecord,
    chunks: Sequence[ChunkRecord],
    now: float,
    pin_for: str | None = None,
) -> None:
    """Inserts a durable pack and its chunks unless present (the first location recorded for a
    chunk stays its location), pinning them to session ``pin_for`` when given.

    A delta's depth is its base's as the index holds it now, plus one: the writer chose the base
    earlier, and a compaction may have re-encoded it as a delta since (a read refuses a chain
    whose depths do not fall towards its end, so a stale depth would make the chunk
    unreadable)."""
    chunks = _current_depths(conn, chunks)
    created = pack.created_at or now
    row = {
        "id": pack.pack_id,
        "size": pack.size,
        "chunk_count": pack.chunk_count,
        "created_at": created,
        "loose": pack.loose,
    }
    insert_ignore(conn, _sql.packs, [row])
    for batch in batches(chunks):
        insert_ignore(conn, _sql.chunks, [_convert.chunk_row(ch, created) for ch in batch])
        if pin_for is not None:
            insert_ignore(
                conn, _sql.pins, [{"session_id": pin_for, "chunk_id": ch.chunk_id} for ch in batch]
            )


def _current_depths(conn: Connection, chunks: Sequence[ChunkRecord]) -> Sequence[ChunkRecord]:
    """``chunks`` with each delta's depth recomputed from its base's row (locked until the
    transaction ends, in id order, as a compaction locks the rows it re-encodes); a delta
    whose base is not indexed yet (written in the same take) keeps the depth it was given."""
    bases = sorted({ch.base_id for ch in chunks if ch.base_id is not None})
    if not bases:
        return chunks
    c = _sql.chunks
    depth: dict[str, int] = {}
    for batch in batches(bases):
        rows = conn.execute(
            select(c.c.id, c.c.depth)
            .where(c.c.id.in_(batch))
            .order_by(c.c.id)
            .with_for_update(read=True)
        )
        depth.update((str(i), int(d)) for i, d in rows)
    return [
        dataclasses.replace(ch, depth=depth[ch.base_id] + 1)
        if ch.base_id is not None and ch.base_id in depth and ch.depth != depth[ch.base_id] + 1
        else ch
        for ch in chunks
    ]


def validate(snapshot: SnapshotRecord, tags: Sequence[str]) -> None:
    """Checks names and numbers before anything touches the database."""
    validate_name(snapshot.run, "run")
    if snapshot.name is not None:
        validate_name(snapshot.name, "snapshot")
    for spec in tags:
        validate_name(parse_spec(spec)[0], "tag")
    if not snapshot.id or len(snapshot.id) > 128:
        raise InvalidInputError(f"snapshot id must be 1 to 128 characters, got {snapshot.id!r}")
    if snapshot.world_size < 1:
        raise InvalidInputError(f"world_size must be >= 1, got {snapshot.world_size}")
    if snapshot.step is not None and not 0 <= snapshot.step <= MAX_STEP:
        raise InvalidInputError(f"step must be an integer from 0 to 2**63-1, got {snapshot.step}")


def require_chunks(conn: Connection, chunk_ids: list[str]) -> None:
    """Raises NotFoundError if any referenced chunk has no row in ``chunks``."""
    found = _sql.existing_chunk_ids(conn, chunk_ids)
    missing = [cid for cid in chunk_ids if cid not in found]
    if missing:
        raise NotFoundError(
            f"cannot commit: chunk {missing[0]} is not in the index ({len(missing)} of "
            f"{len(chunk_ids)} chunks missing); add its pack with add_pack first"
        )


def lock_run(conn: Connection, run: str, now: float) -> None:
    """Creates the run if missing and locks its row, so commits to one run go one at a time."""
    insert_ignore(conn, _sql.runs, [{"name": run, "created_at": now}])
    _sql.lock_run_row(conn, run)


def run_head(conn: Connection, run: str) -> tuple[str | None, int]:
    """Returns the id and sequence number of the run's latest snapshot (None, 0 if none)."""
    s = _sql.snapshots
    row = conn.execute(
        select(s.c.id, s.c.seq).where(s.c.run == run).order_by(s.c.seq.desc()).limit(1)
    ).first()
    return (None, 0) if row is None else (row.id, row.seq)


def require_free(conn: Connection, snapshot: SnapshotRecord) -> None:
    """Raises ConflictError if the snapshot's id or name is already taken."""
    s = _sql.snapshots
    if conn.scalar(select(func.count()).where(s.c.id == snapshot.id)):
        raise ConflictError(f"snapshot id {snapshot.id} already exists")
    if snapshot.name is not None:
        holder = conn.scalar(select(s.c.id).where(s.c.name == snapshot.name))
        if holder is not None:
            raise ConflictError(
                f"snapshot name {snapshot.name!r} is taken by snapshot {holder}; "
                "choose another name or delete that snapshot"
            )


def add_manifest(
    conn: Connection, manifest_id: str, size: int, entries: Sequence[EntryRecord], now: float
) -> None:
    """Inserts the manifest and its entries unless a manifest with that id exists already."""
    row = {"id": manifest_id, "size": int(size), "created_at": now}
    if insert_ignore(conn, _sql.manifests, [row]) != 1:
        return
    rows = [_convert.entry_row(manifest_id, i, e) for i, e in enumerate(entries)]
    for batch in batches(rows):
        conn.execute(insert(conn, _sql.manifest_entries), batch)


def move_tag(conn: Connection, name: str, snapshot_id: str, now: float) -> None:
    """Creates the tag at ``snapshot_id`` or moves it there, bumping its version (atomic upsert)."""
    t = _sql.tags
    stmt = insert(conn, t).values(name=name, snapshot_id=snapshot_id, version=1, updated_at=now)
    stmt = stmt.on_conflict_do_update(
        index_elements=[t.c.name],
        set_={"snapshot_id": snapshot_id, "version": t.c.version + 1, "updated_at": now},
    )
    conn.execute(stmt)


def finish_session(conn: Connection, session_id: str, state: str, now: float | None = None) -> int:
    """Sets an active session's final state and drops its pins; returns how many sessions
    changed (0: unknown, or ended already: a final state is never overwritten, so what
    :meth:`~ckstore.index.Index.settle_session` read stays true)."""
    s = _sql.sessions
    result = conn.execute(
        update(s)
        .where((s.c.id == session_id) & (s.c.state == _sql.ACTIVE))
        .values(state=state, heartbeat_at=now if now is not None else time.time())
    )
    conn.execute(delete(_sql.pins).where(_sql.pins.c.session_id == session_id))
    return result.rowcount
