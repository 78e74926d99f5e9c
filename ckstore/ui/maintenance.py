"""Maintenance from the page: what a ``gc`` would do (nothing changes), and the few actions.

The preview runs the same retention policy ``gc`` applies (:class:`ckstore.history.policy.Policy`)
to name the snapshots it would drop, and ``store.gc(..., dry_run=True)`` for what it would
reclaim; it also gives the ``ckstore gc`` command line that does it. The actions (tag, untag,
delete a snapshot) are the store's own verbs; the app lets them through only with the token.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, replace
from typing import Any

from ..errors import ConflictError, InvalidInputError
from ..history.defaults import DEFAULT_GRACE_SECONDS
from ..history.policy import MAX_SECONDS, Heads, Policy
from ..store import Store
from .timeline import History, ref_of


@dataclass(frozen=True)
class GcRequest:
    """A retention policy and grace period, checked, from the page's form (query strings)."""

    keep_last: int | None
    keep_every_steps: int | None
    keep_tagged: bool
    older_than: float | None
    runs: tuple[str, ...] | None
    grace_seconds: float
    keep_best: int | None = None
    metric: str | None = None
    mode: str = "min"

    @classmethod
    def parse(cls, q: dict[str, str]) -> GcRequest:
        """From query parameters; empty fields are unset.

        Raises:
            InvalidInputError: a field is not a number of the right range.
        """
        runs = tuple(r for r in (q.get("runs") or "").split(",") if r) or None
        grace = _number(q, "grace_seconds")
        req = cls(
            keep_last=_int(q, "keep_last"),
            keep_every_steps=_int(q, "keep_every_steps"),
            keep_tagged=(q.get("keep_tagged") or "1") not in ("0", "false", "no"),
            older_than=_number(q, "older_than"),
            runs=runs,
            grace_seconds=DEFAULT_GRACE_SECONDS if grace is None else grace,
            keep_best=_int(q, "keep_best"),
            metric=(q.get("metric") or "").strip() or None,
            mode=(q.get("mode") or "min").strip(),
        )
        if req.metric is not None and req.keep_best is None:
            req = replace(req, metric=None)  # the form's metric field alone keeps nothing
        req.policy()  # checks the ranges
        return req

    def policy(self) -> Policy:
        return Policy(
            self.keep_last,
            self.keep_every_steps,
            self.keep_tagged,
            self.older_than,
            self.runs,
            keep_best=self.keep_best,
            metric=self.metric,
            mode=self.mode,
        )

    def command(self) -> str:
        """The ``ckstore gc`` command line that applies this policy."""
        args = ["ckstore", "gc"]
        if self.keep_last is not None:
            args += ["--keep-last", str(self.keep_last)]
        if self.keep_every_steps is not None:
            args += ["--keep-every-steps", str(self.keep_every_steps)]
        if self.keep_best is not None:
            args += ["--keep-best", str(self.keep_best), "--metric", str(self.metric)]
            if self.mode != "min":
                args += ["--mode", self.mode]
        if self.older_than is not None:
            args += ["--older-than", f"{self.older_than:g}s"]
        for run in self.runs or ():
            args += ["--run", run]
        if not self.keep_tagged:
            args.append("--no-keep-tagged")
        if self.grace_seconds != DEFAULT_GRACE_SECONDS:
            args += ["--grace", f"{self.grace_seconds:g}s"]
        return shlex.join(args)


def _int(q: dict[str, str], name: str) -> int | None:
    text = (q.get(name) or "").strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise InvalidInputError(f"gc: {name} must be an integer, got {text[:40]!r}") from None


def _number(q: dict[str, str], name: str) -> float | None:
    text = (q.get(name) or "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= MAX_SECONDS:
        raise InvalidInputError(f"gc: {name} must be a number of seconds >= 0, got {text[:40]!r}")
    return value


def gc_preview(store: Store, history: History, req: GcRequest) -> dict[str, Any]:
    """What ``gc`` with this policy would drop and reclaim; changes nothing."""
    pos = history.position()
    newest_first = list(reversed(history.records))
    runs = {r.run for r in newest_first}
    heads = Heads(  # by commit order, as gc finds them
        {r: s.id for r in runs if (s := store.latest(r)) is not None},
        {r: s.id for r in runs if (s := store.latest(r, healthy=True)) is not None},
    )
    drop = req.policy().select(newest_first, set(history.tags.values()), heads=heads)
    report = store.gc(
        keep_last=req.keep_last,
        keep_every_steps=req.keep_every_steps,
        keep_tagged=req.keep_tagged,
        older_than=req.older_than,
        runs=list(req.runs) if req.runs else None,
        grace_seconds=req.grace_seconds,
        keep_best=req.keep_best,
        metric=req.metric,
        mode=req.mode,
        dry_run=True,
    )
    return {
        "drop": sorted(pos[r.id] for r in drop if r.id in pos),
        "drop_refs": [ref_of(r) for r in drop],
        "drop_logical_bytes": sum(r.logical_bytes for r in drop),
        "report": report.to_dict(),
        "command": req.command(),
    }


# --- actions (the app checks the token before calling these) ---------------------------------
MAX_TEXT = 1024


def text_field(body: dict[str, Any], name: str) -> str:
    """A required string field of an action's JSON body.

    Raises:
        InvalidInputError: it is missing, not a string, empty or over 1,024 characters.
    """
    value = body.get(name)
    if not isinstance(value, str) or not value or len(value) > MAX_TEXT:
        raise InvalidInputError(
            f"{name} must be a non-empty string of at most {MAX_TEXT} characters"
        )
    return value


def do_tag(store: Store, body: dict[str, Any]) -> dict[str, Any]:
    """Point a tag at a snapshot (``force`` moves an existing one)."""
    snap = store.tag(
        text_field(body, "ref"), text_field(body, "name"), force=body.get("force") is True
    )
    return {"ok": True, "tag": body["name"], "id": snap.id}


def do_untag(store: Store, body: dict[str, Any]) -> dict[str, Any]:
    """Remove a tag (the snapshot stays).

    ``snapshot`` (optional, the page sends it): the id of the snapshot whose panel offered
    the tag; a tag that now points elsewhere (moved since) is kept: a ConflictError.
    """
    name = text_field(body, "name")
    expected = body.get("snapshot")
    if expected is not None:
        if not isinstance(expected, str):
            raise InvalidInputError("snapshot must be a snapshot id")
        now = store.tags().get(name)
        if now is not None and now != expected:
            raise ConflictError(
                f"tag {name!r} moved to snapshot {now[:12]} since this page asked (it was at "
                f"{expected[:12]}): it was kept; look again before removing it"
            )
    store.untag(name)
    return {"ok": True}


def do_delete(store: Store, body: dict[str, Any]) -> dict[str, Any]:
    """Forget a snapshot (``gc`` reclaims its bytes); a tagged one only with ``force``.

    ``tags`` (optional, the page sends it): the tags the confirmation named. With ``force``,
    a snapshot that holds any other tag (set since the page asked) is kept: a ConflictError
    naming it, as a tagged snapshot is kept without ``force``.
    """
    snap = store.get(text_field(body, "ref"))
    force = body.get("force") is True
    named = body.get("tags")
    if named is not None:
        if not isinstance(named, list) or not all(isinstance(t, str) for t in named):
            raise InvalidInputError("tags must be a list of tag names")
        held = sorted(name for name, sid in store.tags().items() if sid == snap.id)
        unconfirmed = sorted(set(held) - set(named))
        if force and unconfirmed:
            raise ConflictError(
                f"snapshot {snap.ref} was tagged {', '.join(unconfirmed)} since this page "
                "asked: nothing deleted; look again and confirm with its tags named"
            )
    store.delete(snap.id, force=force)
    return {"ok": True, "deleted": snap.id}
