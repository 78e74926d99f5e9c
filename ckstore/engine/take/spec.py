"""A take, described: what it records and how it runs, checked once and carried to the commit.

Every way of taking a snapshot (``Store.take`` and ``async_take``, TorchSnapshot's
``Snapshot.take``, ``import_checkpoint``, the trainer integrations, a distributed take, a DCP
save) builds one :class:`TakeSpec` with :meth:`TakeSpec.of` where the caller's arguments come
in, and nothing downstream re-reads or re-validates them: the labels a snapshot is committed
with are exactly the spec's.

The options are written here once. The public takes accept them as ``**options`` typed by
the bundles below (:class:`TakeOptions` and those built on it, PEP 692), and show them in
their signatures as the keyword arguments they are (``help(Store.take)``). A new option is a
field of :class:`TakeSpec`, a parameter of :meth:`TakeSpec.of` with its check, and a key of
the bundle of the takes that accept it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any, TypedDict

from ...errors import InvalidInputError
from ...format.limits import INT64_MAX, check_int, check_metadata, check_number
from ...format.manifest import canonical_json, snapshot_header
from ...index import tag_specs, validate_name
from ..config import check_delta_base
from ..knobs import StoreDefault


class GuardPolicies(TypedDict, total=False):
    """What a take does about what its guard finds (:class:`TakeSpec` documents each)."""

    on_nonfinite: str
    on_stale: str


class RankOptions(TypedDict, total=False):
    """How the ranks of a distributed take wait for each other, and what the take does about
    replicas that disagree between them."""

    dist_timeout: float | None
    on_divergence: str


class TakeOptions(GuardPolicies, total=False):
    """The keyword options of every take into a store (``Store.take``, ``async_take``,
    ``import_checkpoint``); :class:`TakeSpec` documents each. ``delta_base`` may also be
    ``STORE_DEFAULT``: the store's knob of that name."""

    name: str | None
    delta_base: str | None | StoreDefault
    move_tags: bool
    health: bool
    trainable: Iterable[str] | None
    forked_from: str | None


class LiveTakeOptions(TakeOptions, RankOptions, total=False):
    """:class:`TakeOptions`, and those of a take of live state, which may run on every rank
    (``Store.take``)."""

    replicated: Iterable[str] | None
    no_dist: bool


class AsyncTakeOptions(LiveTakeOptions, total=False):
    """:class:`LiveTakeOptions`, and how much an asynchronous take may copy
    (``Store.async_take``)."""

    staging_budget: int | None


class PathTakeOptions(GuardPolicies, RankOptions, total=False):
    """The keyword options of TorchSnapshot's ``Snapshot.take`` and ``async_take``, besides
    TorchSnapshot's own (a path's snapshot has no run, step or tags)."""

    metadata: Mapping[str, Any] | None


@dataclass(frozen=True)
class TakeSpec:
    """One take's description, validated (build it with :meth:`of`).

    Attributes:
        run: the run the snapshot joins (created on first use).
        step: the training step it records, or None.
        tags: tags pointing at it once committed (in the commit's transaction).
        metadata: JSON-able user metadata (a read-only copy).
        name: a unique snapshot name (TorchSnapshot paths inside a store), or None.
        delta_base: None (chunks stored whole), ``"parent"`` or a snapshot ref: new chunks
            may be stored as XOR deltas against the chunk at the same place there.
        replicated: key globs of plain tensors that are the same on every rank (written once).
        dist_timeout: seconds ranks wait for each other (None: ``$CKSTORE_DIST_TIMEOUT`` or 600).
        staging_budget: bytes an asynchronous take may copy (None: the store's default).
        no_dist: take in this process alone, even under torch.distributed (what a hook called
            on one rank only needs, as DCP's ``no_dist``).
        move_tags: move a tag that already exists to this snapshot (otherwise the take is
            refused, as ``tag`` without ``force``).
        on_nonfinite: what a take does when a tensor holds NaN or Inf: ``"warn"`` (default:
            commit, recorded unhealthy, one warning per key pattern), ``"raise"``
            (NonFiniteError, nothing committed) or ``"ignore"`` (commit, recorded, silent).
        on_stale: the same for tensors that should train and did not change since the run's
            previous snapshot although the step advanced (StaleStateError on ``"raise"``).
        on_divergence: the same for replicated tensors (DDP modules, ``replicated`` globs, and
            DTensor shards several ranks hold) whose copies differ between the ranks of a
            distributed take (ReplicaDivergenceError on ``"raise"``; the other ranks raise
            DistributedError naming it).
        health: measure NaN, Inf and norms per tensor while hashing (False: skip it; the
            snapshot's health is then unknown). Staleness is checked either way.
        trainable: key globs of tensors that should change on every take, besides the live
            parameters and optimizer moments recognised (``engine/take/trainable.py``).
        trainable_keys: keys of the live parameters that train, found by the facade on the
            app_state's modules (``trainable.trainable_keys``) before ``state_dict()``.
        forked_from: the id of the snapshot this state was loaded from, when it is not the
            run's previous one (a fine-tune's base, a rollback's target): recorded in the
            header (docs/FORMAT.md, section 7.5) and drawn as the fork on the lineage. The
            facade resolves the caller's ref, or takes the snapshot a restore of this process
            loaded last (``_takes.fork_of``).
        asynchronous: taken by ``async_take`` (set by ``_takes.take_async``; not an argument
            of :meth:`of`): the header says so, and a restore of the snapshot readies the
            staging memory of the next one (knob ``stage_after_restore``).
    """

    run: str = "default"
    step: int | None = None
    tags: tuple[str, ...] = ()
    metadata: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    name: str | None = None
    delta_base: str | None = None
    replicated: tuple[str, ...] = ()
    dist_timeout: float | None = None
    staging_budget: int | None = None
    no_dist: bool = False
    move_tags: bool = False
    on_nonfinite: str = "warn"
    on_stale: str = "warn"
    health: bool = True
    trainable: tuple[str, ...] = ()
    trainable_keys: frozenset[str] = frozenset()
    on_divergence: str = "warn"
    forked_from: str | None = None
    asynchronous: bool = False

    @classmethod
    def of(
        cls,
        *,
        run: str = "default",
        step: int | None = None,
        tags: Iterable[str] = (),
        metadata: Mapping[str, Any] | None = None,
        name: str | None = None,
        delta_base: str | None = None,
        replicated: Iterable[str] | None = (),
        dist_timeout: float | None = None,
        staging_budget: int | None = None,
        no_dist: bool = False,
        move_tags: bool = False,
        on_nonfinite: str = "warn",
        on_stale: str = "warn",
        health: bool = True,
        trainable: Iterable[str] | None = (),
        trainable_keys: Iterable[str] = (),
        on_divergence: str = "warn",
        forked_from: str | None = None,
    ) -> TakeSpec:
        """Check every argument and build the description.

        Raises:
            InvalidInputError: a bad run, step, name or tag (the message names it), metadata
                that is not JSON-able, a string where a list of names or globs belongs, a
                non-positive ``dist_timeout``, a negative ``staging_budget``, an
                ``on_nonfinite`` / ``on_stale`` / ``on_divergence`` other than ``"warn"``,
                ``"raise"``, ``"ignore"``, a ``health`` that is not a bool, or a ``forked_from``
                that is not a non-empty str.
        """
        if step is not None:
            step = check_int("step", step, 0, INT64_MAX)
        if not isinstance(run, str) or not run:
            raise InvalidInputError(f"run must be a non-empty str, got {run!r}")
        validate_name(run, "run")
        if name is not None:
            validate_name(name, "snapshot")
        tag_names = _names("tags", "tag names", tags)
        for tag in tag_names:
            validate_name(tag, "tag")
        globs = _names("replicated", "key globs", replicated or ())
        if dist_timeout is not None:
            dist_timeout = check_number("dist_timeout", dist_timeout, 0.0, math.inf, lo_open=True)
        if staging_budget is not None:
            staging_budget = check_int("staging_budget", staging_budget)
        meta = _json_metadata(metadata)
        if not isinstance(health, bool):
            raise InvalidInputError(f"health must be True or False, got {health!r}")
        if forked_from is not None and (not isinstance(forked_from, str) or not forked_from):
            raise InvalidInputError(
                f"forked_from must be a snapshot ref (str) or None, got {forked_from!r}"
            )
        return cls(
            run,
            step,
            tag_names,
            MappingProxyType(meta),
            name,
            check_delta_base(delta_base),
            globs,
            dist_timeout,
            staging_budget,
            bool(no_dist),
            bool(move_tags),
            _policy("on_nonfinite", on_nonfinite),
            _policy("on_stale", on_stale),
            health,
            _names("trainable", "key globs", trainable or ()),
            frozenset(_names("trainable_keys", "keys", trainable_keys)),
            _policy("on_divergence", on_divergence),
            forked_from,
        )

    def evolve(self, **changes: Any) -> TakeSpec:
        """This description with ``changes`` (arguments of :meth:`of`), checked again."""
        return _rebuild({**self._fields(), **changes})

    @property
    def tag_specs(self) -> tuple[str, ...]:
        """The tags as the commit takes them: ``"+name"`` may move an existing tag, ``"name"``
        may only create one (``ckstore.index.tag_specs``)."""
        return tag_specs(self.tags, self.move_tags)

    def without_deltas(self) -> TakeSpec:
        """The same take storing every chunk whole."""
        return replace(self, delta_base=None)

    def header(self, *, created_at: float, session: str, **extra: Any) -> dict[str, Any]:
        """The ``snapshot`` header of this take's manifest; ``extra`` adds the distributed
        fields (``world_size``, ``ranks``, ``dcp``)."""
        return snapshot_header(
            run=self.run,
            step=self.step,
            created_at=created_at,
            metadata=dict(self.metadata),
            name=self.name,
            session=session,
            **({"forked_from": self.forked_from} if self.forked_from else {}),
            **({"async_take": True} if self.asynchronous else {}),
            **extra,
        )

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle as the arguments of :meth:`of` (a DCP writer travels to another process)."""
        return (_rebuild, (self._fields(),))

    def _fields(self) -> dict[str, Any]:
        """The arguments of :meth:`of` that build this description again."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["metadata"] = dict(self.metadata)
        out["trainable_keys"] = sorted(self.trainable_keys)
        return out


def _policy(what: str, value: Any) -> str:
    # the patterns of format.health are compiled at the first take, not when a store opens
    from ...format.health import POLICIES

    if value not in POLICIES:
        raise InvalidInputError(
            f"{what} must be one of {', '.join(map(repr, POLICIES))}, got {value!r}"
        )
    return str(value)


def _rebuild(fields: dict[str, Any]) -> TakeSpec:
    given = dict(fields)
    asynchronous = bool(given.pop("asynchronous", False))
    return replace(TakeSpec.of(**given), asynchronous=asynchronous)


def _names(what: str, kind: str, values: Iterable[str]) -> tuple[str, ...]:
    if isinstance(values, (str, bytes)):
        raise InvalidInputError(f"{what} must be a list of {kind}, got the string {values!r}")
    out = tuple(values)
    bad = [v for v in out if not isinstance(v, str)]
    if bad:
        raise InvalidInputError(f"{what} must be a list of {kind} (str), got {bad[0]!r} in it")
    return out


def _json_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    meta = check_metadata(metadata)
    try:
        canonical_json(meta)
    except (TypeError, ValueError) as exc:  # pragma: no cover - check_metadata refuses first
        raise InvalidInputError(
            f"metadata must be JSON-able (finite numbers, str, lists, dicts): {exc}"
        ) from exc
    return meta
