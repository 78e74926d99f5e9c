"""Resolution of a ref string to a snapshot.

Tried in order, first match wins:

0. A snapshot's whole id: that snapshot, whatever tag, snapshot name or run is spelled like it
   (as git takes a full object name over a ref of the same spelling). Tools name snapshots by
   id (the UI, scripts reading ``log --json``), and a tag or run spelled like one snapshot's id
   (one pulled from a shared remote, say) must not make them show, tag or delete another.
1. ``run@step``: the snapshot of that run at that step (the newest if several). Both parts
   are required: ``@5`` and ``run@`` are malformed (InvalidInputError, like a bad step).
   ``run@healthy``: the run's newest healthy snapshot: its take counted no NaN or Inf, found no
   stale tensor and no replicas that disagree (names never hold ``@`` and steps are integers,
   so neither form can mean anything else).
2. A tag name. A tag never takes the name of a run (``_refnames``); should a store made
   before that rule hold a tag and a run of one name pointing at different snapshots, the
   name is ambiguous: an error naming both.
3. A snapshot name.
4. A run name: the run's latest snapshot.
5. A snapshot id, or a hex id prefix of at least 4 characters (ambiguous: an error).

A ref in the display form ``Snapshot.ref`` prints, ``"sft@100 (0123456789ab)"``, names the
snapshot by the id prefix in parentheses, so ``store.get(snap.ref)`` finds ``snap``.
"""

from __future__ import annotations

import difflib
import re
from typing import Any

from sqlalchemy import Row, func, select
from sqlalchemy.engine import Connection

from ckstore.errors import InvalidInputError, SnapshotNotFoundError
from ckstore.index import _sql

MIN_PREFIX = 4
MAX_STEP = 2**63 - 1
"""Steps are stored as signed 64-bit integers."""
_HEX_PREFIX = re.compile(rf"[0-9a-fA-F]{{{MIN_PREFIX},128}}")
_TRIED = "run@step, tag, snapshot name, run name, snapshot id (prefix of >= 4 hex digits)"
SHOWN = 8
"""Runs, tags and steps a not-found message names before saying how many more there are."""
MAX_NAMES = 10_000
"""Snapshot names a not-found message compares the ref with (close matches)."""
_DISPLAY = re.compile(rf"(?P<label>.+) \((?P<id>[0-9a-f]{{{MIN_PREFIX},128}})\)")


def resolve(conn: Connection, ref: str) -> Row[Any]:
    """Returns the ``snapshots`` row ``ref`` names.

    Raises:
        SnapshotNotFoundError: If nothing matches; the message lists what was tried and some
            known runs and tags.
        InvalidInputError: If an id prefix matches several snapshots, or ``run@step`` has a
            step that is not an integer.
    """
    if not isinstance(ref, str) or not ref:
        raise InvalidInputError(f"a snapshot ref must be a non-empty string, got {ref!r}")
    s = _sql.snapshots
    shown = _DISPLAY.fullmatch(ref)
    if shown is not None:  # "sft@100 (0123456789ab)": what Snapshot.ref prints
        row = _by_id(conn, shown["id"])
        if row is None:
            raise SnapshotNotFoundError(_not_found_message(conn, ref, f"snapshot id {shown['id']}"))
        return row
    if "@" in ref:
        return _by_step(conn, ref)
    whole = conn.execute(select(s).where(s.c.id == ref)).first()
    if whole is not None:
        return whole
    tagged = conn.scalar(select(_sql.tags.c.snapshot_id).where(_sql.tags.c.name == ref))
    if tagged is not None:
        _refuse_tag_run_ambiguity(conn, ref, tagged)
        return _one(conn, s.c.id == tagged, ref)
    row = conn.execute(select(s).where(s.c.name == ref)).first()
    if row is None:
        row = _latest(conn, s.c.run == ref)
    if row is None:
        row = _by_id(conn, ref)
    if row is None:
        raise SnapshotNotFoundError(_not_found_message(conn, ref, _TRIED))
    return row


def _refuse_tag_run_ambiguity(conn: Connection, name: str, tagged: str) -> None:
    latest = _latest(conn, _sql.snapshots.c.run == name)
    if latest is not None and latest.id != tagged:
        raise InvalidInputError(
            f"ref {name!r} is ambiguous: tag {name!r} points at snapshot {tagged[:12]} and run "
            f"{name!r} has newer ones (latest {name}@{latest.step}, {latest.id[:12]}); name the "
            f"snapshot by run@step or id, and rename the tag (`ckstore tag {tagged[:12]} "
            f"{name}-tag`, then `ckstore tag --delete {name}`): tags may no longer take a run's name"
        )


HEALTHY = "healthy"
"""``run@healthy``: the run's newest snapshot recorded healthy (``_sql.healthy``)."""


def _by_step(conn: Connection, ref: str) -> Row[Any]:
    run, _, step_text = ref.rpartition("@")
    if not run:
        raise InvalidInputError(
            f"bad ref {ref!r}: a run name comes before '@', as in run{ref if step_text else '@100'}"
        )
    if step_text == HEALTHY:
        return _healthy(conn, run, ref)
    try:
        step = int(step_text)
    except ValueError:
        raise InvalidInputError(
            f"bad ref {ref!r}: after '@' comes a step number, as in {run or 'run'}@100"
        ) from None
    if not 0 <= step <= MAX_STEP:
        raise InvalidInputError(
            f"bad ref {ref!r}: steps are integers from 0 to 2**63-1, got {step_text[:40]!r}"
        )
    s = _sql.snapshots
    row = _latest(conn, (s.c.run == run) & (s.c.step == step))
    if row is None:
        raise SnapshotNotFoundError(
            _not_found_message(conn, ref, f"run {run!r} at step {step}", _steps_of(conn, run, step))
        )
    return row


def _healthy(conn: Connection, run: str, ref: str) -> Row[Any]:
    s = _sql.snapshots
    row = _latest(conn, (s.c.run == run) & _sql.healthy())
    if row is None:
        recorded = conn.scalar(
            select(s.c.id).where((s.c.run == run) & s.c.nonfinite.is_not(None)).limit(1)
        )
        why = (
            "every snapshot it recorded health for holds NaN or Inf, is stale (tensors that "
            "should train did not change) or has replicas that disagree between ranks"
            if recorded is not None
            else "none of its snapshots recorded health (taken before ckstore did, or with health=False)"
        )
        raise SnapshotNotFoundError(
            _not_found_message(conn, ref, f"a healthy snapshot of run {run!r}: {why}")
        )
    return row


def _latest(conn: Connection, where: Any) -> Row[Any] | None:
    s = _sql.snapshots
    return conn.execute(select(s).where(where).order_by(s.c.seq.desc()).limit(1)).first()


def _one(conn: Connection, where: Any, ref: str) -> Row[Any]:
    row = conn.execute(select(_sql.snapshots).where(where)).first()
    if row is None:  # a dangling tag cannot exist (foreign key), but be explicit
        raise SnapshotNotFoundError(f"ref {ref!r} points at a snapshot that does not exist")
    return row


def _by_id(conn: Connection, ref: str) -> Row[Any] | None:
    s = _sql.snapshots
    row = conn.execute(select(s).where(s.c.id == ref)).first()
    if row is not None or not _HEX_PREFIX.fullmatch(ref):
        return row
    rows = conn.execute(
        select(s).where(s.c.id.startswith(ref.lower())).order_by(s.c.id).limit(11)
    ).all()
    if len(rows) > 1:
        shown = ", ".join(f"{r.id} ({r.run}@{r.step})" for r in rows[:10])
        more = " and more" if len(rows) > 10 else ""
        raise InvalidInputError(
            f"snapshot id prefix {ref!r} is ambiguous: it matches {shown}{more}; give more digits"
        )
    return rows[0] if rows else None


def _not_found_message(conn: Connection, ref: str, tried: str, detail: str = "") -> str:
    """What was tried, the closest names the store has, and what it has: every run and tag
    when few, else the first ones and how many more (an existing run never looks missing)."""
    if detail:
        return f"no snapshot matches {ref!r} ({tried}): {detail}"
    s = _sql.snapshots
    runs = list(conn.scalars(select(s.c.run).distinct().order_by(s.c.run)))
    tags = list(conn.scalars(select(_sql.tags.c.name).order_by(_sql.tags.c.name)))
    wanted = ref.rpartition("@")[0] if "@" in ref else ref
    names = list(conn.scalars(select(s.c.name).where(s.c.name.is_not(None)).limit(MAX_NAMES)))
    near = difflib.get_close_matches(wanted, runs + tags + names, n=3, cutoff=0.6)
    hint = f" Did you mean {' or '.join(repr(n) for n in near)}?" if near else ""
    return (
        f"no snapshot matches {ref!r} (tried: {tried}).{hint} "
        f"Runs: {_some(runs)}; tags: {_some(tags)} (`ckstore log` lists every snapshot)"
    )


def _some(names: list[str]) -> str:
    """``names`` when few, else the first :data:`SHOWN` and how many more."""
    if not names:
        return "(none)"
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more


def _steps_of(conn: Connection, run: str, step: int) -> str:
    """The steps run ``run`` has, those nearest ``step`` when it has many (what ``show
    run@41`` should have named), or "" when there is no such run."""
    s = _sql.snapshots
    mine = s.c.run == run
    count = conn.scalar(select(func.count()).select_from(s).where(mine)) or 0
    if not count:
        return ""
    below = list(
        conn.scalars(
            select(s.c.step).where(mine & (s.c.step < step)).distinct()
            .order_by(s.c.step.desc()).limit(SHOWN)
        )
    )  # fmt: skip
    above = list(
        conn.scalars(
            select(s.c.step).where(mine & (s.c.step > step)).distinct()
            .order_by(s.c.step).limit(SHOWN)
        )
    )  # fmt: skip
    take_below = min(len(below), max(SHOWN // 2, SHOWN - len(above)))
    near = sorted(below[:take_below] + above[: SHOWN - take_below])
    first, last = conn.execute(select(func.min(s.c.step), func.max(s.c.step)).where(mine)).one()
    if first is None:
        return f"run {run!r} has {_count(count, 'snapshot')}, none of them with a step"
    listed = ", ".join(str(n) for n in near)
    span = "" if len(near) >= count else f" (of steps {first} to {last})"
    which = "its steps" if len(near) >= count else "the nearest steps"
    return (
        f"run {run!r} has {_count(count, 'snapshot')}; {which}: {listed}{span} "
        f"(`ckstore log --run {run}` lists them)"
    )


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
