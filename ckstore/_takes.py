"""How a take runs: one described take (a TakeSpec), in this process or on every rank, now or
in the background.

Every take of the public API comes through here: ``Store.take``, ``Store.async_take``,
``Store.import_checkpoint``, TorchSnapshot's ``Snapshot.take`` / ``async_take`` and the trainer
integrations (through ``Store.take(no_dist=True)``). Each of those builds its
:class:`~ckstore.engine.take.spec.TakeSpec` where the caller's arguments come in, through
:func:`spec_of` (and shows its options with :func:`shows`); here it goes to the
single-process engine (:mod:`ckstore.engine.take.single`) or the distributed one
(:mod:`ckstore.distributed.take`), both of which write through one
:class:`~ckstore.engine.take.local.LocalTake` per process. A DCP save builds the same spec and
uses the same LocalTake from inside DCP's own protocol (:mod:`ckstore.dcp.writer`).

Results are committed ``(record, manifest)`` pairs (the manifest is None on ranks other than
the one that committed); the facade binds them to snapshot handles. The engines, and torch,
are imported when a take runs, so opening a store does not pay for them.
"""

from __future__ import annotations

import inspect
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from .distributed import is_distributed
from .engine.config import check_delta_base
from .engine.knobs import STORE_DEFAULT
from .engine.progress import ProgressFn
from .engine.repository import Repository
from .engine.take.blocking import BlockingReport
from .engine.take.spec import TakeSpec
from .errors import InvalidInputError, ResaveWarning, warn
from .format.limits import check_int
from .format.manifest import Manifest
from .index import SnapshotRecord

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

Committed = tuple[SnapshotRecord, "Manifest | None"]


F = TypeVar("F", bound=Callable[..., Any])


def spec_of(
    repo: Repository | None, accepts: type, options: Mapping[str, Any], **fields: Any
) -> TakeSpec:
    """The :class:`TakeSpec` of a public take: its own arguments ``fields`` (``run``, ``step``,
    ...) and its ``**options``, which must be keys of ``accepts``, the bundle its signature
    unpacks. ``delta_base`` left at :data:`STORE_DEFAULT` is ``repo``'s knob (None without a
    repository, and under torch.distributed, where every chunk is stored whole; an explicit
    ``delta_base`` there is refused when the take starts).

    Raises:
        TypeError: an option the take does not accept (as Python says of any other argument).
        InvalidInputError: an option's value is refused (:meth:`TakeSpec.of`).
    """
    unknown = sorted(set(options) - set(accepts.__annotations__))
    if unknown:
        raise TypeError(
            f"unexpected keyword argument {unknown[0]!r}: this take's options are "
            f"{', '.join(sorted(accepts.__annotations__))}"
        )
    given = {**fields, **options}
    base = given.get("delta_base", STORE_DEFAULT)
    if base is STORE_DEFAULT:
        given["delta_base"] = (
            None if repo is None or _ranks(given.get("no_dist", False)) else repo.delta_base
        )
    else:
        given["delta_base"] = check_delta_base(base)
    fork = given.get("forked_from")
    if repo is not None and isinstance(fork, str) and fork:
        given["forked_from"] = repo.index.resolve(fork).id  # SnapshotNotFoundError: a typo
    return TakeSpec.of(**given)


_LOADED: dict[str, str] = {}
"""Store URL -> the snapshot a restore of this process loaded last into live state."""
_LOADED_LOCK = threading.Lock()


def loaded(repo: Repository, snapshot_id: str) -> None:
    """Remember that a restore of this process loaded ``snapshot_id`` (of ``repo``): the next
    live take into ``repo`` records it as the snapshot it forked from (:func:`fork_of`)."""
    with _LOADED_LOCK:
        _LOADED[repo.url] = snapshot_id


def fork_of(repo: Repository, spec: TakeSpec) -> TakeSpec:
    """``spec`` with the fork it records: the caller's ``forked_from``, else the snapshot a
    restore of this process loaded last from ``repo`` unless that is the run's latest (a plain
    resume, which the parent records already). Either way the remembered restore is used up:
    it is the parent of the next take only."""
    with _LOADED_LOCK:
        restored = _LOADED.pop(repo.url, None)
    if spec.forked_from is not None or restored is None:
        return spec
    latest = repo.index.list_snapshots(run=spec.run, limit=1)
    if latest and latest[0].id == restored:
        return spec
    return replace(spec, forked_from=restored)


def shows(accepts: type) -> Callable[[F], F]:
    """Show a take's ``**options: Unpack[accepts]`` as the keyword arguments they are, with
    :meth:`TakeSpec.of`'s defaults and order (``delta_base``: :data:`STORE_DEFAULT`), to ``help()``,
    ``inspect.signature`` and documentation tools; type checkers read the bundle itself."""
    defaults = {name: p.default for name, p in inspect.signature(TakeSpec.of).parameters.items()}
    defaults["delta_base"] = STORE_DEFAULT
    hints = accepts.__annotations__

    def show(fn: F) -> F:
        sig = inspect.signature(fn)
        own = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
        cut = next((i for i, p in enumerate(own) if p.kind is p.KEYWORD_ONLY), len(own))
        options = [
            inspect.Parameter(
                name,
                inspect.Parameter.KEYWORD_ONLY,
                default=defaults[name],
                annotation=getattr(hints[name], "__forward_arg__", hints[name]),
            )
            for name in defaults
            if name in hints
        ]
        fn.__signature__ = sig.replace(parameters=[*own[:cut], *options, *own[cut:]])  # type: ignore[attr-defined]
        return fn

    return show


@dataclass
class Background:
    """A take finishing in the background, and how much of the state it had to copy."""

    future: Future[Committed]
    staged_bytes: int = 0
    sync_bytes: int = 0
    blocking: BlockingReport | None = None


def take(
    repo: Repository,
    app_state: Mapping[str, Any],
    spec: TakeSpec,
    pg: ProcessGroup | None = None,
    progress: ProgressFn | None = None,
) -> Committed:
    """Take ``app_state`` into ``repo`` now: on every rank of ``pg`` under torch.distributed
    (unless ``spec.no_dist``), else in this process. Background compaction of this process
    waits from the first state_dict call to the commit."""
    with repo.activity():
        return _take(repo, app_state, spec, pg, progress)


def _take(
    repo: Repository,
    app_state: Mapping[str, Any],
    spec: TakeSpec,
    pg: ProcessGroup | None,
    progress: ProgressFn | None,
) -> Committed:
    from .engine.take.plan import state_dicts

    spec = with_live_trainable(spec, app_state)
    # a name clash is refused before anything is written
    repo.index.check_take(spec.run, spec.tag_specs, spec.name)
    warn_resave(repo, spec)
    if _ranks(spec.no_dist):
        from .distributed.comm import Comm
        from .distributed.take import take as dist_take
        from .distributed.take_async import ddp_apps

        _no_dist_deltas(spec)
        comm = Comm(pg, spec.dist_timeout)
        return dist_take(repo, state_dicts(app_state), spec, comm, ddp_apps(app_state))
    from .engine.take.single import take as engine_take

    result = engine_take(repo, state_dicts(app_state), spec, progress)
    return result.record, result.manifest


def take_async(
    repo: Repository,
    app_state: Mapping[str, Any],
    spec: TakeSpec,
    pg: ProcessGroup | None = None,
    progress: ProgressFn | None = None,
) -> Background:
    """Return once the state at this call is safe; hash, write and commit in the background."""
    from .engine.take.plan import state_dicts

    spec = replace(with_live_trainable(spec, app_state), asynchronous=True)
    repo.index.check_take(spec.run, spec.tag_specs, spec.name)  # before any state_dict() call
    if _ranks(spec.no_dist):
        from .distributed.take_async import take_async as dist_take_async

        warn_resave(repo, spec)
        _no_dist_deltas(spec)
        return Background(dist_take_async(repo, app_state, spec, pg))
    from .engine.take.single import take_async as engine_take_async

    budget = repo.staging_budget if spec.staging_budget is None else spec.staging_budget
    warn = partial(warn_resave, repo, spec)  # an index read: while the state is copied
    job = engine_take_async(repo, state_dicts(app_state), spec, budget, progress, warn)
    future: Future[Committed] = Future()

    def done(job_future: Future[Any]) -> None:
        exc = job_future.exception()
        if exc is not None:
            future.set_exception(exc)
        else:
            result = job_future.result()
            future.set_result((result.record, result.manifest))

    job.future.add_done_callback(done)
    return Background(future, job.staged_bytes, job.sync_bytes, job.blocking)


def prepare_staging(
    repo: Repository, app_state: Mapping[str, Any], budget: int | None
) -> Future[int]:
    """Make ready, behind training, the staging memory an async take of ``app_state`` under
    ``budget`` (None: ``repo.staging_budget``) copies into (``Store.prepare_staging``)."""
    from .engine.stateful import check_app_state
    from .engine.take.plan import state_dicts
    from .engine.take.single import prepare_staging as prepare

    check_app_state(app_state)
    if budget is not None:
        check_int("staging_budget", budget)
    states = state_dicts(app_state)
    return prepare(repo, states, repo.staging_budget if budget is None else budget)


def stage_after_restore(
    repo: Repository, header: Mapping[str, Any], app_state: Mapping[str, Any]
) -> Future[int] | None:
    """After a training job's restore of ``app_state`` from a snapshot an ``async_take`` took
    (its header's ``async_take``): ready the staging memory of the next one behind training,
    as :func:`prepare_staging` (knob ``stage_after_restore``). The first ``async_take`` after
    a restart then copies into touched memory, not new memory whose every page the kernel
    must first zero. Only a restore that loads an optimizer's state counts as a training
    job's (an evaluation that loads weights gets nothing it would not use), on a handle that
    may write and keeps no arena already. A hint: the future holds the arena's size, or None
    when nothing was started."""
    if not header.get("async_take") or not repo.stage_after_restore or repo.read_only:
        return None
    if repo.spare_staging.held():  # an async take of this process left one: it is ready
        return None
    from .engine.take.plan import state_dicts
    from .engine.take.single import prepare_staging as prepare

    states = state_dicts(app_state)
    if not any(_optimizer_state(sd) for sd in states.values()):
        return None
    return prepare(repo, states, repo.staging_budget)


def _optimizer_state(state_dict: Any) -> bool:
    """Whether a state dict is an optimizer's (``torch.optim.Optimizer.state_dict()``'s keys),
    or holds one at its first level (``StateDict(model=..., optim=opt.state_dict())``)."""

    def optimizer(d: Any) -> bool:
        return isinstance(d, Mapping) and {"state", "param_groups"} <= d.keys()

    return optimizer(state_dict) or (
        isinstance(state_dict, Mapping) and any(optimizer(v) for v in state_dict.values())
    )


def with_live_trainable(spec: TakeSpec, app_state: Mapping[str, Any]) -> TakeSpec:
    """``spec`` knowing which of the app_state's live parameters train (read before
    ``state_dict()`` detaches them), so the take can tell a stale one.

    The first look at the app_state, so it is checked here: a value that is not a mapping of
    names to statefuls is refused (``InvalidInputError`` / ``UnsupportedValueError`` naming
    what was expected) before anything reads it.
    """
    from .engine.stateful import check_app_state
    from .engine.take.trainable import trainable_keys

    check_app_state(app_state)
    return spec.evolve(trainable_keys=trainable_keys(app_state))


_SAVED: OrderedDict[tuple[str, str, int], None] = OrderedDict()
"""The (store, run, step) this process took last: saving one of them again is one training
saving a step under two names (a trainer's top-k file and its ``last``), not a re-save."""
_SAVED_SIZE = 1024


def warn_resave(repo: Repository, spec: TakeSpec) -> None:
    """Warn (:class:`ResaveWarning`, at the caller's line) when ``spec``'s ``run@step`` exists
    already and this process did not take it: a trainer resumed from an earlier step saves it
    again. The take goes on and makes a second snapshot at that step, which ``run@step`` then
    names. Under torch.distributed only rank 0 warns."""
    if spec.step is None:
        return
    if _ranks(spec.no_dist):
        import torch.distributed as dist

        if dist.get_rank() != 0:
            return
    key = (repo.url, spec.run, spec.step)
    with _LOADED_LOCK:
        ours = key in _SAVED
        _SAVED[key] = None
        _SAVED.move_to_end(key)
        while len(_SAVED) > _SAVED_SIZE:
            _SAVED.popitem(last=False)
    old = None if ours else repo.index.at_step(spec.run, spec.step)
    if old is not None:
        warn(
            ResaveWarning(
                f"ckstore: {spec.run}@{spec.step} exists already (snapshot {old.id[:12]}): this "
                f"take saves that step again as a second snapshot, which {spec.run}@{spec.step} "
                f"will name; the first stays (`ckstore rm {old.id[:12]}` forgets it). A trainer "
                "resumed from an earlier step? Pass each save its own step to keep one per step"
            )
        )


def _ranks(no_dist: bool) -> bool:
    """Whether a take runs on every rank: torch.distributed is up and the take is not local."""
    return not no_dist and is_distributed()


def _no_dist_deltas(spec: TakeSpec) -> None:
    if spec.delta_base is not None:
        raise InvalidInputError(
            f"delta_base={spec.delta_base!r}: a distributed take stores every chunk whole (deltas are "
            "written by single-process takes and imports; restores read them under any world size). "
            "Pass delta_base=None, or set store.delta_base = None"
        )
