"""One name, one meaning: tags never take a run's name, and takes never move tags by surprise.

Refs resolve a tag before a run (``_resolve``), so a tag named like a run would silently
shadow the run's latest snapshot: ``get("sft")`` would keep answering the tagged step after
newer takes. So a tag may not take the name of a run that has snapshots, and a new run may not
take the name of a tag. A store made before this rule may still hold such a pair; resolving
the name then raises an error naming both (``_resolve``).

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


def refuse_tag_named_like_a_run(conn: Connection, name: str) -> None:
    """Raises ConflictError if a run called ``name`` has snapshots."""
    head = run_head(conn, name)
    if head is not None:
        raise ConflictError(
            f"tag {name!r} would hide run {name!r} (latest {head[1]}): a ref names a tag before "
            f"a run, so {name!r} would stop meaning the run's latest snapshot; choose another "
            f"tag name (e.g. {name}-best)"
        )


def refuse_new_run_named_like_a_tag(conn: Connection, run: str) -> None:
    """Raises ConflictError if ``run`` has no snapshot yet and a tag has its name."""
    target = tag_target(conn, run)
    if target is not None and run_head(conn, run) is None:
        raise ConflictError(
            f"run {run!r} would be hidden by tag {run!r} (at snapshot {target[:12]}): a ref names "
            f"a tag before a run, so {run!r} would keep meaning the tagged snapshot; choose "
            "another run name, or delete the tag first (`ckstore tag --delete "
            f"{run}`)"
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
    conn: Connection, run: str, specs: Sequence[str], snapshot_id: str | None = None
) -> None:
    """Every name rule a take into ``run`` with tags ``specs`` must keep (see the module)."""
    refuse_new_run_named_like_a_tag(conn, run)
    refuse_moving_tags(conn, specs, snapshot_id)
    for spec in specs:
        name, _ = parse_spec(spec)
        if name == run:
            raise ConflictError(
                f"tag {name!r} would hide run {name!r}: a ref names a tag before a run; choose "
                f"another tag name (e.g. {name}-best)"
            )
        refuse_tag_named_like_a_run(conn, name)
