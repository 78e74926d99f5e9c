"""Choosing delta bases for a take: which stored chunk each new chunk may be XORed against.

A chunk's base is the chunk at the same place of the same key in a base snapshot: same key,
same dtype and shape, same box of the grid. The writer stores the chunk as a delta only if
that is smaller (``objects.delta.encode_delta``); it never builds a chain longer than the
depth limit: when the base candidate already sits at the limit, its ancestor one link
shallower than the limit is used instead. With a limit of 1 every delta is taken against the
full chunk at the root (a keyframe), so reading any chunk decodes at most two payloads and a
take reads one base, however long the run; the chunk is stored whole again (a new keyframe)
once a delta against the old one no longer pays.

Bases are pinned to the take's session when chosen (``Index.lookup_chunks``), so no gc removes
one while the take runs; once a delta is indexed the index itself keeps its base (a foreign
key, and gc deletes a base only after its last delta).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ...format.manifest import Manifest, TensorEntry
from ...index import ChunkRecord
from ..config import check_delta_base
from ..locations import to_location
from ..repository import Repository
from .packing import Chunk

if TYPE_CHECKING:
    from ..interfaces import WriteIndex


def base_manifest(repo: Repository, delta_base: str | None, run: str) -> Manifest | None:
    """The manifest a take into ``run`` stores deltas against: that of ``delta_base``
    (``"parent"``: the run's latest snapshot, none for a new run), or None.

    ``"parent"`` is deferred to compaction while it runs after takes (``auto_compact``, loose
    takes): compaction stores each loose chunk as a delta against the same place in the
    snapshot's parent anyway, against a dense keyframe, off the critical path; a take-time
    delta would cost the take time and pin its base loose (bases stay whole).

    Raises:
        SnapshotNotFoundError: ``delta_base`` is a ref that names no snapshot.
    """
    delta_base = check_delta_base(delta_base)
    if delta_base is None or repo.delta_depth == 0:
        return None
    if delta_base == "parent" and repo.compacts_later:
        return None
    if delta_base == "parent":
        latest = repo.index.list_snapshots(run=run, limit=1)
        if not latest:
            return None
        record = latest[0]
    else:
        record = repo.index.resolve(delta_base)
    return repo.load_manifest(record)


def attach_bases(
    keys: dict[str, list[tuple[tuple[int, ...], tuple[int, ...], Chunk]]],
    entries: dict[str, Any],
    base: Manifest,
) -> int:
    """Give each chunk of ``keys`` (key -> [(offsets, sizes, chunk)]) the id of the chunk at the
    same place in ``base`` as its candidate base; returns how many got one.

    ``entries`` are the take's own entries (placeholders carrying dtype and shape): a key whose
    dtype or shape differs in ``base`` gets no base (its bytes mean something else there).
    """
    count = 0
    for key, boxes in keys.items():
        old, new = base.entries.get(key), entries.get(key)
        if not isinstance(old, TensorEntry) or old.inline or not isinstance(new, TensorEntry):
            continue
        if (old.dtype, old.shape) != (new.dtype, new.shape):
            continue
        at = {(c.offsets, c.sizes): c.id for c in old.chunks}
        for offsets, sizes, chunk in boxes:
            cid = at.get((offsets, sizes))
            if cid is not None:
                chunk.base_id = cid
                count += 1
    return count


def resolve_bases(
    index: WriteIndex, session: str, chunks: Iterable[Chunk], depth_limit: int
) -> None:
    """Pin the base of each chunk in ``chunks`` that has a candidate and give it the base's
    location (with its chain); a chunk whose candidate the index lacks, or whose candidate is
    its own id, gets none.

    A candidate at ``depth_limit`` or deeper is replaced by its ancestor at ``depth_limit - 1``.
    """
    todo = [c for c in chunks if c.base_id and c.base_id != c.id]
    if depth_limit <= 0 or not todo:
        return
    known: dict[str, ChunkRecord] = index.chunk_locations({c.base_id for c in todo})
    wanted: list[tuple[Chunk, str]] = []
    for c in todo:
        rec = known.get(c.base_id)
        while rec is not None and rec.depth >= depth_limit:
            rec = known.get(rec.base_id) if rec.base_id is not None else None
        if (
            rec is not None
            and rec.depth < depth_limit
            and rec.chunk_id != c.id
            and rec.raw_length == c.nbytes
        ):
            wanted.append((c, rec.chunk_id))
    pinned = index.lookup_chunks(session, {b for _, b in wanted})  # gone meanwhile: no delta
    for c, base_id in wanted:
        rec = pinned.get(base_id)
        if rec is not None:
            c.base = to_location(rec, known)
            c.depth = rec.depth + 1
