"""The restore's phases: rebuild tensors in place from verified chunks.

``restore`` runs in three phases so a bad snapshot never leaves the caller half-loaded:
validate (keys, dtypes, shapes against the destination), check (every chunk's stored payloads
read once and checked: its decoded bytes against the fast check its manifest records, or,
verifying by id (``verify="full"``, or a chunk without a check), against its id, or its
payloads against the digests the index recorded, the id then hashed as apply decodes; a
mismatch raises CorruptionError naming the key), apply (each chunk put in place from what the
check left: its decoded bytes staged in an arena, the mapped views of its payloads in a local
store's packs, or a fingerprint of its payload, read again and compared before it is decoded
into place; then ``load_state_dict``). Nothing of the caller's is touched before the check
phase succeeded. The chunk passes themselves are in ``fetch.py`` (whose docstring has each
case), the jobs they run in ``jobs.py``.

One process (``StoredSnapshot.restore``): ``validate`` -> ``prepare`` (the check pass:
``Fetcher.verify`` into an ``Arena``, inline and new tensors read) -> ``apply``
(``Fetcher.apply``, then ``load_state_dict``). ``atomic=False``: ``prepare`` skips the check
and ``apply`` runs ``Fetcher.load``, one pass into place.

Under torch.distributed, the calls each rank makes, in order (``distributed/restore.py``,
each step inside a bounded ``distributed.comm.phase``):

1. ``plan``: ``validate`` here (nothing read); ``Reader.jobs`` for the destination and for new
   tensors; the chunks needed sent to rank 0 as runs of the manifest's numbering; rank 0 picks
   one reader per distinct chunk and scatters each rank its ``Part`` (what it reads, sends,
   receives; ``held`` when every rank can keep what it receives within its budget).
2. ``read``: ``Fetcher.verify`` of the chunks this rank reads for itself (into its ``Arena``);
   with a held plan, ``Exchange.run`` (readers send verified bytes, receivers check size and
   fingerprint and keep them); streamed, ``Fetcher.verify(sent, 0)`` of what it will send.
   ``atomic=False``: ``Exchange.run`` then ``Fetcher.load`` of its own chunks, straight in.
3. ``broadcast`` (streamed plan only): ``Exchange.run`` again, each received chunk put in
   place as it arrives, then ``Fetcher.apply`` of its own.
4. apply (local): a held plan ``Fetcher.load(..., source=exchange)`` of the received chunks
   and ``Fetcher.apply`` of its own; then :func:`apply` here (inline values,
   ``load_state_dict``).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ...errors import CorruptionError, MismatchError
from ...format.dtypes import dtype_from_name
from ...format.manifest import TensorEntry
from ...format.tree import ABSENT, flatten, prune, tree_refs, unflatten
from ..config import restore_budget
from ..stateful import RNGState, check_app_state, rng_last
from .fetch import Arena, Fetcher
from .hints import castable, compiled_hint
from .jobs import Job, Region
from .reader import Reader, check_destination, is_dtensor_dest, refuse_overlapping
from .tied import tied_keys

log = logging.getLogger("ckstore")


@dataclass
class _AppPlan:
    name: str
    obj: Any
    keys: list[str]
    dest: dict[str, torch.Tensor] = field(default_factory=dict)
    target: dict[str, torch.Tensor] = field(
        default_factory=dict
    )  # where the bytes go (a DTensor's local shard)
    region: dict[str, Region] = field(default_factory=dict)  # the part of the global tensor needed
    keep: dict[str, Any] = field(
        default_factory=dict
    )  # per-rank keys with no value here: left as they are
    meta: list[str] = field(default_factory=list)  # destinations on the meta device: replaced
    cast: dict[str, torch.Tensor] = field(default_factory=dict)  # read anew, then cast into these
    cast_meta: dict[str, torch.dtype] = field(default_factory=dict)  # meta ones: read, converted


@dataclass
class Prepared:
    """A validated and verified restore, not yet applied to the destination.

    ``tensors`` holds new tensors read for keys without a destination tensor; ``jobs`` fill the
    destination tensors ``direct``: verified (atomic: staged within the budget, kept as mapped
    views, or remembered by payload fingerprint) and put in place by :func:`apply`, or, with
    ``verified`` False (``atomic=False``), read, verified and decoded into place by
    :func:`apply` in one pass.
    """

    plans: list[_AppPlan]
    tensors: dict[str, torch.Tensor]
    direct: dict[str, tuple[torch.Tensor, Region | None]] = field(default_factory=dict)
    jobs: list[Job] = field(default_factory=list)
    verified: bool = True
    arena: Arena | None = None
    fetcher: Fetcher | None = None


def restore(
    reader: Reader,
    app_state: Mapping[str, Any],
    strict: bool = True,
    budget: int | None = None,
    atomic: bool = True,
    cast: bool = False,
) -> None:
    """Load the snapshot into ``app_state`` in place (see module docstring for the phases);
    ``cast``: see :func:`validate`."""
    apply(prepare(reader, app_state, strict, budget, atomic=atomic, cast=cast), reader)


def prepare(
    reader: Reader,
    app_state: Mapping[str, Any],
    strict: bool = True,
    budget: int | None = None,
    plans: list[_AppPlan] | None = None,
    skip: frozenset[str] = frozenset(),
    *,
    atomic: bool = True,
    cast: bool = False,
) -> Prepared:
    """Validate and verify everything a restore needs; the destination is not touched.

    Every chunk of the destination tensors is checked here (``Fetcher.verify``): its stored
    payloads read once, its decoded bytes checked against its fast check (or its id). A
    compressed chunk (any chunk, on a store that does not map its files) is decoded into a
    staging arena of at most ``budget`` bytes (None: the default,
    :func:`~ckstore.engine.config.restore_budget` of the destination's size) while it has
    room, which :func:`apply` copies into place. Past it, and for a raw chunk, a local store
    keeps the mapped views of the payloads checked (immutable packs: :func:`apply`
    decodes or copies those very bytes into place); another store keeps a fingerprint of each
    payload, which :func:`apply` compares when it reads the payload again (from a spill copy
    where reading again would fetch it from the store again). Verifying by id, payloads with
    digests in the index are compared with them here, undecoded, and hashed against the id as
    :func:`apply` decodes them into place. Memory stays bounded and a damaged chunk is found
    before anything of the caller's changes.

    ``atomic=False`` skips this pass: :func:`apply` reads, checks and decodes every destination
    tensor straight into place, in one pass and with no staging memory; a damaged chunk then
    raises with the destination partly loaded.

    ``plans`` (from :func:`validate`) skips validating again; keys in ``skip`` are not read
    (the caller puts their tensors into ``Prepared.tensors`` before :func:`apply`).
    """
    if plans is None:
        plans = validate(reader, app_state, strict, cast=cast)
    wanted: dict[str, Region | None] = {}
    direct: dict[str, tuple[torch.Tensor, Region | None]] = {}
    for p in plans:
        for k in p.keys:
            if k not in skip and reader.is_tensor(k):
                wanted[k] = p.region.get(k)
                if k in p.target:
                    direct[k] = (p.target[k], p.region.get(k))
    jobs = reader.jobs(direct)
    fetcher = reader.fetcher()
    try:
        arena = (
            fetcher.verify(jobs, restore_budget(budget, destination_bytes(direct)))
            if atomic
            else None
        )
        rest = {k: r for k, r in wanted.items() if k not in direct}
        tensors = reader.read_regions(rest)
    except BaseException:
        fetcher.close()
        raise
    return Prepared(plans, tensors, direct, jobs, verified=atomic, arena=arena, fetcher=fetcher)


def destination_bytes(direct: Mapping[str, tuple[torch.Tensor, Region | None]]) -> int:
    """Bytes of the destination tensors a restore writes into."""
    return sum(t.numel() * t.element_size() for t, _ in direct.values())


def validate(
    reader: Reader, app_state: Mapping[str, Any], strict: bool = True, *, cast: bool = False
) -> list[_AppPlan]:
    """Check keys, dtypes and shapes against the destination; read nothing.

    ``cast``: a floating-point destination of another floating-point dtype than the stored
    tensor (a bfloat16 model, a float32 snapshot) is accepted; the tensor is read as stored
    into new memory and converted into the destination by :func:`apply` (``Tensor.copy_``).

    Plans come in app_state order with :class:`RNGState` entries last, so :func:`apply` loads
    the generators after every other ``load_state_dict()`` (whose random draws then do not
    shift the restored stream). With ``strict=False``, per-rank entries this rank has no value
    for (the take had fewer ranks) are skipped and logged; see :func:`_skip_missing`.

    Raises:
        InvalidInputError: ``app_state`` is not a mapping of str names.
        UnsupportedValueError: a value is not stateful (also a TypeError).
        MismatchError: keys, dtypes or shapes differ.
    """
    check_app_state(app_state, restoring=True)
    if reader.rank is None:
        reader.rank = 0
    plans = [_validate(reader, name, obj, strict, cast) for name, obj in rng_last(app_state)]
    return [p for p in plans if p is not None]


def whole_plain_keys(reader: Reader, plans: list[_AppPlan]) -> list[str]:
    """Keys whose destination here is a plain tensor needing the whole stored tensor.

    Only entries equal on every rank (not per-rank) and kept in packs (not inline) count: these
    are the ones a distributed restore may read once and broadcast.
    """
    out = []
    for p in plans:
        for k in p.target:
            entry = reader.manifest.entries[k]
            if (
                k not in p.region
                and isinstance(entry, TensorEntry)
                and not entry.inline
                and entry.chunks
            ):
                out.append(k)
    return out


def apply(prepared: Prepared, reader: Reader) -> None:
    """Write what :func:`prepare` verified into the destination and call ``load_state_dict``.

    An atomic restore (``prepared.verified``) runs to its end once it has begun to write: a
    Ctrl-C or a signal handler of the program's (a preemption handler that raises) arriving
    meanwhile is held and raised once the destination is wholly restored (see
    :func:`interrupts_held`), never leaving it part old, part new."""
    with interrupts_held(prepared.verified):
        _apply_all(prepared, reader)


_HELD = (signal.SIGINT, signal.SIGTERM) + ((signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ())


@contextlib.contextmanager
def interrupts_held(hold: bool) -> Iterator[None]:
    """Hold the Python-level handlers of SIGINT, SIGTERM and SIGHUP (a default action that
    kills the process is left alone) until the block is done, then run each for the signals
    that came meanwhile. Signal handlers run in the main thread only, so elsewhere nothing
    needs holding."""
    if not hold or threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[tuple[int, Any]] = []
    saved: dict[int, Any] = {}

    def note(signum: int, frame: Any) -> None:
        came.append((signum, frame))

    for sig in _HELD:
        handler = signal.getsignal(sig)
        if callable(handler):
            saved[sig] = handler
            signal.signal(sig, note)
    try:
        yield
    finally:
        for held, handler in saved.items():
            if signal.getsignal(held) is note:  # one the program installed meanwhile stays
                signal.signal(held, handler)
        for signum, frame in came:
            saved[signum](signum, frame)


def _apply_all(prepared: Prepared, reader: Reader) -> None:
    fetcher = prepared.fetcher or reader.fetcher()
    try:
        reader.copy_inline(prepared.direct)
        if prepared.verified:
            fetcher.apply(prepared.jobs)
        else:
            fetcher.load(prepared.jobs)
    except CorruptionError as exc:  # atomic: the bytes changed since they were verified moments ago
        why = (
            "a chunk failed its check while being put in place"
            if prepared.verified
            else "restore(atomic=False) loads as it reads"
        )
        raise CorruptionError(f"{exc} (the destination may be partly loaded: {why})") from exc
    except BaseException as exc:  # a progress callback's cancel, an interrupt not held (above)
        exc.add_note(
            f"ckstore: the restore of {reader.where} stopped while it put the chunks in place: "
            "the destination is partly loaded; restore it again before using it"
        )
        raise
    finally:
        fetcher.close()
        prepared.arena = None
    for p in prepared.plans:
        _apply(reader, p, prepared.tensors)


def _validate(
    reader: Reader, name: str, obj: Any, strict: bool, cast: bool = False
) -> _AppPlan | None:
    m = reader.manifest
    if name not in m.apps:
        if not strict:
            return None
        raise MismatchError(
            f"{reader.where} has no app_state key {name!r} (it has {sorted(m.apps)}); "
            "pass strict=False to restore the others"
        )
    keys = tree_refs(m.apps[name])
    current = flatten(name, obj.state_dict(), lenient=True).leaves
    plan = _AppPlan(name, obj, keys)
    if not _skip_missing(reader, plan, current, strict):
        return None
    _refuse_meta_optimizer(reader, name, obj)
    for key in plan.keys:
        dest = current.get(key)
        if not isinstance(dest, torch.Tensor):
            continue
        entry = reader.entry(key)
        if not isinstance(entry, TensorEntry):
            # load_state_dict would raise midway; set_extra_state() takes any value
            if isinstance(obj, torch.nn.Module) and not _extra_state(key):
                raise MismatchError(
                    f"{reader.where}: key {key!r} is a plain value in the snapshot but a tensor "
                    f"({dest.dtype} {list(dest.shape)}) in app_state[{name!r}]; build the "
                    "destination as it was taken, or read it with read_object() and convert"
                )
            continue
        stored = dtype_from_name(entry.dtype)
        if dest.is_meta and is_dtensor_dest(dest):
            raise MismatchError(
                f"{reader.where}: key {key!r} of app_state[{name!r}] is a DTensor on the meta "
                "device: its shard has no memory to load into. Materialise the model first "
                "(module.to_empty(device=...), as FSDP2 models are before loading), then restore"
            )
        if cast and castable(dest, stored) and tuple(dest.shape) == entry.shape:
            if dest.is_meta:  # read as a new tensor, converted, assigned
                plan.meta.append(key)
                plan.cast_meta[key] = dest.dtype
            else:
                refuse_overlapping(dest, key, reader.where)
                plan.cast[key] = dest  # read as a new tensor of the stored dtype, then converted
            continue
        check_destination(dest, stored, entry.shape, key, reader.where, cast_hint=not cast)
        if dest.is_meta and not is_dtensor_dest(dest):
            plan.meta.append(key)  # no storage to load into: read as a new tensor, assigned
            continue
        plan.dest[key] = dest
        plan.target[key] = dest
        if is_dtensor_dest(dest):
            from ...format.boxes import local_box

            plan.target[key] = dest.to_local()  # type: ignore[attr-defined]
            plan.region[key] = local_box(dest)
    if strict:
        _check_keys(reader, plan, current, isinstance(obj, torch.nn.Module))
    return plan


def _refuse_meta_optimizer(reader: Reader, name: str, obj: Any) -> None:
    """An optimizer over meta parameters can hold no state: refuse it before anything loads."""
    if not isinstance(obj, torch.optim.Optimizer):
        return
    if any(p.is_meta for group in obj.param_groups for p in group.get("params", ())):
        raise MismatchError(
            f"{reader.where}: app_state[{name!r}] optimizes parameters on the meta device, so "
            "it cannot hold the stored state; restore the model first (its meta tensors are "
            "materialised), then build the optimizer over its parameters and restore that"
        )


def _skip_missing(reader: Reader, plan: _AppPlan, current: dict[str, Any], strict: bool) -> bool:
    """Set aside the per-rank keys this rank has no value for; False: skip the whole app.

    Strict, the first such key raises MismatchError. Otherwise each keeps the destination's
    current value (or is left out of the state passed to ``load_state_dict`` if the
    destination has none), and a warning names them. An app with no key left to load, and an
    :class:`RNGState` missing any of its keys (generators are restored all or nothing), is not
    loaded at all.
    """
    missing = [k for k in plan.keys if not reader.has_value(k)]
    if not missing:
        return True
    if strict:
        reader.entry(missing[0])  # raises, naming the key and the ranks
    plan.keys = [k for k in plan.keys if k not in set(missing)]
    plan.keep = {k: current.get(k, ABSENT) for k in missing}
    whole = not plan.keys or isinstance(plan.obj, RNGState)  # generators: all or nothing
    log.warning(
        "%s: rank %d has no stored value for %d per-rank key(s) of app_state[%r] (the take had "
        "fewer ranks): %s%s; %s (strict=False)",
        reader.where,
        reader.rank or 0,
        len(missing),
        plan.name,
        missing[:10],
        "..." if len(missing) > 10 else "",
        "the app was not loaded" if whole else "they keep their current values",
    )
    return not whole


def _check_keys(reader: Reader, plan: _AppPlan, current: dict[str, Any], module: bool) -> None:
    stored = set(plan.keys)
    missing = sorted(
        k for k, v in current.items() if isinstance(v, torch.Tensor) and k not in stored
    )
    unexpected = sorted(stored - set(current)) if module else []
    if missing or unexpected:
        raise MismatchError(
            f"{reader.where} does not match app_state[{plan.name!r}]: missing from the snapshot "
            f"{missing[:5]}{'...' if len(missing) > 5 else ''}, not in the destination "
            f"{unexpected[:5]}{'...' if len(unexpected) > 5 else ''}; "
            + (
                compiled_hint(plan.name, missing, unexpected)
                or "pass strict=False to load what matches"
            )
        )


def _apply(reader: Reader, plan: _AppPlan, tensors: Mapping[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for key, target in plan.target.items():
            if key in tensors:  # else it was decoded in place already
                target.copy_(tensors[key])

    module = isinstance(plan.obj, torch.nn.Module)
    # assigning (for meta destinations) keeps the module's own parameters where it had storage
    own = _module_tensors(plan) if module and plan.meta else {}

    with torch.no_grad():
        for key, dest in plan.cast.items():
            dest.copy_(tensors[key])
    tied = tied_keys(plan.meta, own, tensors)  # one tensor for the keys of one parameter
    shared: dict[str, Any] = {}

    def resolve(key: str) -> Any:
        key = tied.get(key, key)
        if key not in shared:
            shared[key] = _resolved(key)
        return shared[key]

    def _resolved(key: str) -> Any:
        if key in plan.keep:
            return plan.keep[key]
        if key in plan.cast:  # the module's own parameter, when meta ones are assigned
            return own.get(key, plan.cast[key])
        if key in plan.dest:
            return own.get(key, plan.dest[key])
        if key in plan.cast_meta:
            return tensors[key].to(plan.cast_meta[key])
        return reader.value_of(key, tensors)

    state = unflatten(reader.manifest.apps[plan.name], resolve)
    if plan.keep:
        state = prune(state)
    if module and plan.meta:
        plan.obj.load_state_dict(state, strict=False, assign=True)
    elif module:
        plan.obj.load_state_dict(state, strict=False)
    else:
        plan.obj.load_state_dict(state)
    if plan.meta:
        _check_materialised(reader, plan)


def _extra_state(key: str) -> bool:
    """Whether ``key`` is a module's extra state (``get_extra_state``), whatever it holds."""
    return key.endswith(("/_extra_state", "._extra_state"))


def _module_tensors(plan: _AppPlan) -> dict[str, Any]:
    """The module's own parameters and buffers by key (``state_dict(keep_vars=True)``)."""
    own = flatten(plan.name, plan.obj.state_dict(keep_vars=True), lenient=True).leaves
    return {k: v for k, v in own.items() if isinstance(v, torch.Tensor)}


def _check_materialised(reader: Reader, plan: _AppPlan) -> None:
    """Refuse an app whose meta destinations are still on meta after ``load_state_dict``."""
    now = flatten(plan.name, plan.obj.state_dict(), lenient=True).leaves
    left = [k for k in plan.meta if isinstance(now.get(k), torch.Tensor) and now[k].is_meta]
    if left:
        raise MismatchError(
            f"{reader.where}: app_state[{plan.name!r}] kept its tensors on the meta device after "
            f"load_state_dict() ({left[:5]}{'...' if len(left) > 5 else ''}): it copies in "
            "place, so nothing was loaded into them. Materialise them first (e.g. "
            "module.to_empty(device='cpu')), or make its load_state_dict() take the new tensors"
        )
