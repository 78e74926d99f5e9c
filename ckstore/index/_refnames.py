"""One name, one meaning: tags never take a run's name, and takes never move tags by surprise.

Refs resolve a tag before a snapshot's name before a run (``_resolve``), so a tag named like a
run would silently shadow the run's latest snapshot: ``get("sft")`` would keep answering the
tagged step after newer takes. So a tag may not take the name of a run that has snapshots, and
a new run may not take the name of a tag. Snapshot names (a TorchSnapshot path's, ``name=``)
follow the same rule: a snapshot may not be named like a tag or a run with snapshots, and a
tag or a new run may not take a snapshot's name. A store made before these rules may still
hold such a pair; resolving a tag named like a run then raises an error naming both
(``_resolve``).

Tags given to a commit follow ``set_tag``'s rule: an existing tag is moved only when asked.
The commit receives them as *specs*: ``"name"`` (create; refused if the tag is elsewhere) or
``"+name"`` (create or move, as git's ``+refspec``), built by :func:`~ckstore.index.names.tag_specs`.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import select
from sqlalchemy.engine import Connection

from ckstore.errors import ConflictError
from ckstore.index import _sql
from ckstore.index.names import parse_spec


def run_head(conn: Connection, run: str) -> tuple[str, str] | None:
    """The id and ``run@step`` label of a run's latest snapshot, or None if it has none."""
    s = _sql.snapshots
    row = conn.execute(
        select(s.c.id, s.c.step, s.c.name).where(s.c.run == run).order_by(s.c.seq.desc()).limit(1)
    ).first()
    if row is None:
        return None
    label = row.name or (f"{run}@{row.step}" if row.step is not None else run)
    return str(row.id), f"{label} ({str(row.id)[:12]})"


def tag_target(conn: Connection, name: str) -> str | None:
    """The snapshot id tag ``name`` points at, or None."""
    return conn.scalar(select(_sql.tags.c.snapshot_id).where(_sql.tags.c.name == name))


def refuse_tag_hiding_a_name(conn: Connection, name: str) -> None:
    """Raises ConflictError if a run called ``name`` has snapshots, or a snapshot is named
    ``name`` (a TorchSnapshot path's name): a ref names a tag first."""
    head = run_head(conn, name)
    if head is not None:
        raise ConflictError(
            f"tag {name!r} would hide run {name!r} (latest {head[1]}): a ref names a tag before "
            f"a run, so {name!r} would stop meaning the run's latest snapshot; choose another "
            f"tag name (e.g. {name}-best)"
        )
    named = name_holder(conn, name)
    if named is not None:
        raise ConflictError(
            f"tag {name!r} would hide the snapshot named {name!r} ({named[:12]}): a ref names "
            f"a tag before a snapshot's name; choose another tag name (e.g. {name}-tag)"
        )


def refuse_new_run_named_like_a_tag(conn: Connection, run: str) -> None:
    """Raises ConflictError if ``run`` has no snapshot yet and a tag or a snapshot's name is
    its name."""
    if run_head(conn, run) is not None:
        return
    target = tag_target(conn, run)
    if target is not None:
        raise ConflictError(
            f"run {run!r} would be hidden by tag {run!r} (at snapshot {target[:12]}): a ref names "
            f"a tag before a run, so {run!r} would keep meaning the tagged snapshot; choose "
            "another run name, or delete the tag first (`ckstore tag --delete "
            f"{run}`)"
        )
    named = name_holder(conn, run)
    if named is not None:
        raise ConflictError(
            f"run {run!r} would be hidden by the snapshot named {run!r} ({named[:12]}): a ref "
            "names a snapshot's name before a run; choose another run name"
        )


def name_holder(conn: Connection, name: str) -> str | None:
    """The id of the snapshot named ``name``, or None."""
    s = _sql.snapshots
    return conn.scalar(select(s.c.id).where(s.c.name == name))


def refuse_snapshot_name_clash(conn: Connection, name: str, run: str) -> None:
    """Raises ConflictError if a snapshot named ``name`` (taken into ``run``) would hide a tag
    or a run, or be hidden by a tag: the ref ``name`` must keep one meaning."""
    target = tag_target(conn, name)
    if target is not None:
        raise ConflictError(
            f"snapshot name {name!r} is a tag's (at snapshot {target[:12]}): a ref names a tag "
            "before a snapshot's name, so it would not open this snapshot; choose another name "
            f"(another path), or delete the tag first (`ckstore tag --delete {name}`)"
        )
    head = run_head(conn, name)
    if name == run or head is not None:
        latest = f" (latest {head[1]})" if head is not None else ""
        raise ConflictError(
            f"snapshot name {name!r} would hide run {name!r}{latest}: a ref names a snapshot's "
            "name before a run, so it would keep meaning this snapshot after newer takes; "
            "choose another name (another path)"
        )


def refuse_moving_tags(conn: Connection, specs: Sequence[str], snapshot_id: str | None) -> None:
    """Raises ConflictError for a plain spec whose tag exists at another snapshot."""
    for spec in specs:
        name, move = parse_spec(spec)
        target = tag_target(conn, name)
        if not move and target is not None and target != snapshot_id:
            raise ConflictError(
                f"tag {name!r} already exists (at snapshot {target[:12]}); a take or import "
                "moves an existing tag only when asked, as `ckstore tag` does: pass "
                "move_tags=True (ckstore import --move-tags), or delete the tag first"
            )


def check_take(
    conn: Connection,
    run: str,
    specs: Sequence[str],
    snapshot_id: str | None = None,
    name: str | None = None,
) -> None:
    """Every name rule a take into ``run`` with tags ``specs`` (and snapshot name ``name``)
    must keep (see the module)."""
    refuse_new_run_named_like_a_tag(conn, run)
    refuse_moving_tags(conn, specs, snapshot_id)
    if name is not None:
        refuse_snapshot_name_clash(conn, name, run)
    for spec in specs:
        tag, _ = parse_spec(spec)
        if tag in (run, name):
            raise ConflictError(
                f"tag {tag!r} would hide {'run' if tag == run else 'the snapshot named'} "
                f"{tag!r}: a ref names a tag first; choose another tag name (e.g. {tag}-best)"
            )
        refuse_tag_hiding_a_name(conn, tag)
