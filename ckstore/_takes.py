"""How a take runs: checked arguments, then one process or every rank, now or in the background.

Shared by :class:`ckstore.Store` and the TorchSnapshot-style :meth:`ckstore.Snapshot.take`, so
both choose between the single-process engine (:mod:`ckstore.engine.take`) and the distributed
one (:mod:`ckstore.distributed`) in one place. Results are committed ``(record, manifest)`` pairs; the
facade binds them to :class:`ckstore.Snapshot` handles. The engines (and torch) are imported
when a take runs, so opening a store does not pay for them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from .distributed import is_distributed
from .engine.config import check_delta_base
from .engine.repository import Repository
from .errors import InvalidInputError
from .format.limits import INT64_MAX, check_int, check_metadata, check_number
from .format.manifest import Manifest, canonical_json
from .index import SnapshotRecord, validate_name

Committed = tuple[SnapshotRecord, "Manifest | None"]


@dataclass(frozen=True)
class TakeArgs:
    """What a take records besides the state: where it goes and how it is labelled."""

    run: str = "default"
    step: int | None = None
    tags: tuple[str, ...] = ()
    metadata: Mapping[str, Any] | None = None
    name: str | None = None
    replicated: tuple[str, ...] = ()
    delta_base: str | None = None

    @classmethod
    def of(
        cls,
        run: str,
        step: int | None,
        tags: Sequence[str],
        metadata: Mapping[str, Any] | None,
        name: str | None,
        replicated: Sequence[str],
        delta_base: str | None = None,
    ) -> TakeArgs:
        meta = check_take_args(run, step, metadata, name, tags)
        if step is not None:
            step = int(step)
        return cls(run, step, tuple(tags), meta, name, tuple(replicated), check_delta_base(delta_base))


class _StoreDefault:
    """The type of :data:`STORE_DEFAULT`."""

    def __repr__(self) -> str:
        return "STORE_DEFAULT"


STORE_DEFAULT = _StoreDefault()
"""``delta_base`` left to the store's default (``Store.delta_base``)."""


def delta_base_of(repo: Repository, given: str | None | _StoreDefault) -> str | None:
    """The delta base a take uses: ``given``, or the store's default for ``STORE_DEFAULT``
    (which a distributed take, storing every chunk whole, leaves aside; an explicit
    ``delta_base`` there is refused)."""
    if isinstance(given, _StoreDefault):
        return None if is_distributed() else repo.delta_base
    return check_delta_base(given)


@dataclass
class Background:
    """A take finishing in the background, and how much of the state it had to copy."""

    future: Future[Committed]
    staged_bytes: int = 0
    sync_bytes: int = 0


def take(
    repo: Repository,
    app_state: Mapping[str, Any],
    args: TakeArgs,
    pg: Any,
    dist_timeout: float | None,
) -> Committed:
    """Take ``app_state`` into ``repo`` now (on every rank when distributed)."""
    if is_distributed():
        _no_dist_deltas(args)
        return _dist_take(repo, app_state, None, args, pg, dist_timeout)
    from .engine.take import state_dicts
    from .engine.take import take as engine_take

    base = repo.delta_manifest(args.delta_base, args.run)
    result = engine_take(
        repo.objects,
        repo.index,
        state_dicts(app_state),
        repo.take_options(deltas=args.delta_base is not None),
        run=args.run,
        step=args.step,
        tags=args.tags,
        metadata=dict(args.metadata or {}),
        name=args.name,
        base=base,
    )
    return result.record, result.manifest


def async_take(
    repo: Repository,
    app_state: Mapping[str, Any],
    args: TakeArgs,
    pg: Any,
    dist_timeout: float | None,
    staging_budget: int | None,
) -> Background:
    """Return once the state at this call is safe; hash, write and commit in the background."""
    from .engine.stage import stage
    from .engine.take import state_dicts, take_async

    if is_distributed():
        _no_dist_deltas(args)
        from .distributed._classify import _ddp_apps
        from .distributed._comm import Comm
        from .distributed._take import background

        comm = Comm(pg, dist_timeout, purpose="async")  # made now: opening a group waits for every member
        ddp = _ddp_apps(app_state)
        staged = stage(state_dicts(app_state))
        fut: Future[Committed] = background().submit(
            _dist_take, repo, None, staged, args, pg, dist_timeout, comm, ddp
        )
        return Background(fut)
    budget = repo.staging_budget if staging_budget is None else staging_budget
    base = repo.delta_manifest(args.delta_base, args.run)
    job = take_async(
        repo.objects,
        repo.index,
        state_dicts(app_state),
        repo.take_options(deltas=args.delta_base is not None),
        budget,
        run=args.run,
        step=args.step,
        tags=args.tags,
        metadata=dict(args.metadata or {}),
        name=args.name,
        base=base,
    )
    future: Future[Committed] = Future()

    def done(job_future: Future[Any]) -> None:
        exc = job_future.exception()
        if exc is not None:
            future.set_exception(exc)
        else:
            result = job_future.result()
            future.set_result((result.record, result.manifest))

    job.future.add_done_callback(done)
    return Background(future, staged_bytes=job.staged_bytes, sync_bytes=job.sync_bytes)


def _no_dist_deltas(args: TakeArgs) -> None:
    if args.delta_base is not None:
        raise InvalidInputError(
            f"delta_base={args.delta_base!r}: a distributed take stores every chunk whole (deltas are "
            "written by single-process takes and imports; restores read them under any world size). "
            "Pass delta_base=None, or set store.delta_base = None"
        )


def _dist_take(
    repo: Repository,
    app_state: Mapping[str, Any] | None,
    states: Mapping[str, Any] | None,
    args: TakeArgs,
    pg: Any,
    dist_timeout: float | None,
    comm: Any = None,
    ddp: Any = None,
) -> Committed:
    from .distributed import _take as dist_take

    return dist_take.take(
        repo,
        app_state,
        repo.take_options(),
        run=args.run,
        step=args.step,
        tags=args.tags,
        metadata=dict(args.metadata or {}),
        name=args.name,
        replicated=args.replicated,
        pg=pg,
        timeout=dist_timeout,
        states=states,
        comm=comm,
        ddp=ddp,
    )


def check_budgets(dist_timeout: float | None, staging_budget: int | None) -> None:
    """Refuse a non-positive or non-finite ``dist_timeout`` and a negative ``staging_budget``."""
    if dist_timeout is not None:
        check_number("dist_timeout", dist_timeout, 0.0, math.inf, lo_open=True)
    if staging_budget is not None:
        check_int("staging_budget", staging_budget)


def check_take_args(
    run: str,
    step: int | None,
    metadata: Mapping[str, Any] | None,
    name: str | None = None,
    tags: Sequence[str] = (),
) -> dict[str, Any]:
    """Refuse a bad run, step, name, tag or metadata before anything is planned or written.

    Returns the metadata as plain JSON (a copy).
    """
    if step is not None:
        check_int("step", step, 0, INT64_MAX)
    if not isinstance(run, str) or not run:
        raise InvalidInputError(f"run must be a non-empty str, got {run!r}")
    validate_name(run, "run")
    if name is not None:
        validate_name(name, "snapshot")
    if isinstance(tags, str):
        raise InvalidInputError(f"tags must be a list of tag names, got the string {tags!r}")
    for tag in tags:
        validate_name(tag, "tag")
    meta = check_metadata(metadata)
    try:
        canonical_json(meta)
    except (TypeError, ValueError) as exc:  # pragma: no cover - check_metadata refuses first
        raise InvalidInputError(
            f"metadata must be JSON-able (finite numbers, str, lists, dicts): {exc}"
        ) from exc
    return meta
