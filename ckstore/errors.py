"""One exception tree for ckstore.

Every error derives from :class:`CkstoreError` and also from the builtin that fits, so callers
that already catch ``KeyError``/``FileNotFoundError``/``ValueError`` keep working; where no
builtin means the same (a conflict, a schema version, a guard's refusal, a rank's failure) it
derives from ``Exception`` alone. Every class here is exported from ``ckstore``. Messages name
the key, ref or object involved and say what to do. Lower layers translate foreign errors
(fsspec, SQLAlchemy) at their boundary with ``raise ... from``. :data:`ERROR_KINDS` is the one
table of how each kind of error surfaces: the command line's exit code and the web view's HTTP
status.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import FrameType


class CkstoreError(Exception):
    """Base class of every error ckstore raises on purpose."""


class NotFoundError(CkstoreError, LookupError):
    """Something named does not exist (a ref, a key, an object)."""


class SnapshotNotFoundError(NotFoundError, KeyError):
    """No snapshot matches a ref ("run", "run@step", a tag, an id prefix, a path)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class CheckpointNotFoundError(SnapshotNotFoundError, FileNotFoundError):
    """A trainer asked for a checkpoint by path and neither a file nor a snapshot is there.

    A :class:`SnapshotNotFoundError` that is also the ``FileNotFoundError`` the trainers
    (Lightning, Hugging Face) raise, and catch, for a missing checkpoint file.
    """

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class KeyNotFoundError(NotFoundError, KeyError):
    """A key asked for is not in a snapshot's manifest."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class AppNotFoundError(KeyNotFoundError, AssertionError):
    """TorchSnapshot's ``get_state_dict_for_key`` of an app_state name the snapshot lacks:
    also an AssertionError, which TorchSnapshot raises there, so code written for it keeps
    catching it."""


class ObjectNotFoundError(NotFoundError, FileNotFoundError):
    """A stored object (pack, manifest) is missing from the backend."""


class CorruptionError(CkstoreError, IOError):
    """Stored bytes do not match their recorded id, length or structure. Never ignored."""


class InvalidInputError(CkstoreError, ValueError):
    """The caller passed something ckstore refuses (a value it cannot store, a bad name)."""


class UnsupportedValueError(InvalidInputError, TypeError):
    """A value in app_state has a type ckstore will not store (no pickle in the format)."""


class UnsafePickleError(UnsupportedValueError):
    """A checkpoint file can only be loaded by unpickling arbitrary objects, which could run code.

    ckstore loads ``torch.save`` files with ``weights_only=True`` and never falls back: whoever
    trusts the file loads it themselves and takes the result.
    """


class MismatchError(CkstoreError, ValueError):
    """A snapshot does not fit the destination (keys, dtypes or shapes differ)."""


class ConflictError(CkstoreError):
    """A concurrent change won (a tag moved, a name taken, a store already exists)."""


class DestinationExistsError(ConflictError, FileExistsError):
    """A destination is not empty: an export's directory (pass ``force=True`` to replace it),
    or the folder (or prefix) a new store was to be created in."""


class LeaseExpiredError(ConflictError):
    """A write session's lease ran out before commit; GC may have reclaimed its pins."""


class ReadOnlyStoreError(CkstoreError, PermissionError):
    """A write (take, tag, delete, gc, reindex) on a store opened read-only: its folder is not
    writable, its index URL is read-only, or it was opened with ``read_only=True``."""


class SchemaError(CkstoreError):
    """The index schema or store format is older/newer than this ckstore understands."""


class StorageError(CkstoreError, OSError):
    """The object backend failed (after retries) for a reason other than not-found."""


class NoSpaceError(StorageError):
    """A write found its disk (or quota) full. The operation that was writing commits
    nothing (a take or import leaves no snapshot and moves no tag); what it had written is
    garbage that ``gc`` reclaims. The message says so, and how."""


class IndexDatabaseError(CkstoreError, OSError):
    """The SQL index database failed for a reason other than a conflict (unreachable,
    locked, out of space, broken): an I/O failure, as :class:`StorageError` is for objects."""


IndexError_ = IndexDatabaseError
"""The former name of :class:`IndexDatabaseError` (the builtin ``IndexError`` is a
sequence's; this is the index database's)."""


class IndexCorruptionError(CorruptionError, IndexDatabaseError):
    """The SQL index database itself is damaged (unreadable pages, rows that do not decode).

    The store's objects are not affected: the message says how to rebuild the index from them.
    """


class GuardError(CkstoreError):
    """A take's guard refused the state (``on_nonfinite``, ``on_stale`` or ``on_divergence``
    ``"raise"``); nothing was committed. ``keys`` names the tensors found."""

    def __init__(self, message: str, *, keys: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.keys: list[str] = sorted(keys)


class NonFiniteError(GuardError, FloatingPointError):
    """Tensors of the state hold NaN or Inf (raised with ``on_nonfinite="raise"``)."""


class StaleStateError(GuardError):
    """Tensors that should train did not change since the run's previous snapshot although the
    step advanced (raised with ``on_stale="raise"``): the optimizer did not step, or the
    state saved is not the one trained."""


class ReplicaDivergenceError(GuardError):
    """Replicated tensors (a DDP module's, keys a ``replicated=`` glob names, a DTensor's shard
    several ranks hold) held other bytes on some ranks than on the others (raised with
    ``on_divergence="raise"``). ``keys`` names
    the tensors, ``ranks`` the ranks whose copy differs from the majority's."""

    def __init__(
        self, message: str, *, keys: Iterable[str] = (), ranks: Iterable[int] = ()
    ) -> None:
        super().__init__(message, keys=keys)
        self.ranks: list[int] = sorted(set(ranks))


class GuardWarning(UserWarning):
    """What a take's guard found, with ``on_nonfinite`` / ``on_stale`` / ``on_divergence`` at
    ``"warn"`` (the default)."""


class NonFiniteWarning(GuardWarning):
    """Tensors of the state hold NaN or Inf; the snapshot is committed and recorded unhealthy."""


class StaleStateWarning(GuardWarning):
    """Tensors that should train did not change since the run's previous snapshot."""


class ReplicaDivergenceWarning(GuardWarning):
    """Replicated tensors held other bytes on some ranks than on the others; the snapshot is
    committed and recorded unhealthy."""


class HealedWarning(UserWarning):
    """A restore found damaged local chunks and healed them from a remote that holds them
    (verified against their ids and used at once; written into a new local pack behind the
    restore): the restore went on and is bit-exact. The message names the snapshot, the
    chunks and the remotes."""


class WriteBackWarning(UserWarning):
    """Chunks a read healed (and used, bit-exact) could not be written back into the local
    store behind it: the local copies stay damaged and the remotes still hold them, so the next
    read heals them again (or ``ckstore repair``). Warned when the store closes; the message
    names the store and the chunks."""


class MetadataWarning(UserWarning):
    """A take's ``metadata`` held a value JSON cannot carry as given: a NaN or infinite float
    (a NaN loss, say), recorded as null. The message names each path; the snapshot is
    committed."""


class ResaveWarning(UserWarning):
    """A take recorded a ``run@step`` the store already holds (a trainer resumed from an
    earlier step and saved that step again): the new snapshot is committed beside the old one,
    ``run@step`` names the newer, and ``ckstore log`` marks it ``(re-save)``."""


def warn(warning: Warning) -> None:
    """Issue ``warning`` at the line of the caller's own code that called into ckstore (the
    ``store.take(...)`` line), not at ckstore's: the first frame outside the package. From a
    thread with no such frame (an ``async_take`` finishing in the background) it points at
    the ckstore line that warned."""
    frame: FrameType | None = sys._getframe(1)
    level = 2  # stacklevel 2: warn's caller
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    if frame is None or frame.f_code.co_filename.startswith(_THREADS):
        level = 2
    warnings.warn(warning, stacklevel=level)


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_THREADS = (
    threading.__file__,
    os.path.join(os.path.dirname(threading.__file__), "concurrent") + os.sep,
)


class DistributedError(CkstoreError):
    """One or more ranks failed a collective take/restore; names the ranks and causes.

    Attributes:
        ranks: the failed ranks (ranks within the process group), sorted; empty when they
            could not be told apart.
        causes: rank -> what went wrong there (an error's type and message, or how it was lost).
    """

    def __init__(
        self, message: str, *, ranks: Iterable[int] = (), causes: Mapping[int, str] | None = None
    ) -> None:
        super().__init__(message)
        self.ranks: list[int] = sorted(set(ranks))
        self.causes: dict[int, str] = dict(causes or {})


class RankLostError(DistributedError, TimeoutError):
    """A collective could not complete in time: ranks never arrived, died or stopped.

    ``ranks`` names them (ranks within the process group), when they could be told apart.
    """


class CommitUnknownError(DistributedError):
    """A distributed take's commit phase failed on this rank, and whether its snapshot was
    committed could not be told (the index did not answer, or the snapshot was deleted since):
    it may be in the store, or be committed yet while rank 0 lives (``ckstore log RUN``
    tells). ``ranks`` and ``causes`` are those of the commit phase's failure."""


# --- how each kind of error surfaces ------------------------------------------------------------
@dataclass(frozen=True)
class ErrorKind:
    """One kind of error as the faces report it: the command line's exit code and the web view's
    HTTP status, for every error that is an instance of one of ``errors``.

    Attributes:
        name: What the kind is called in docs and messages.
        errors: The classes of the kind (an error of a subclass is of the kind too).
        exit_code: ``ckstore``'s exit status for it.
        http_status: ``ckstore ui``'s HTTP status for it.
    """

    name: str
    errors: tuple[type[Exception], ...]
    exit_code: int
    http_status: int


CORRUPTION = ErrorKind("corruption", (CorruptionError, ObjectNotFoundError), 5, 500)
"""Something stored is missing or damaged: the store's side, not the caller's ref."""
NOT_FOUND = ErrorKind("not found", (NotFoundError,), 3, 404)
CONFLICT = ErrorKind("conflict", (ConflictError,), 4, 409)
USAGE = ErrorKind("usage", (InvalidInputError,), 2, 400)
ERROR_KINDS: tuple[ErrorKind, ...] = (CORRUPTION, NOT_FOUND, CONFLICT, USAGE)
"""The kinds, first match wins (an ObjectNotFoundError is corruption before it is not found)."""
OTHER_ERROR = ErrorKind("other", (), 6, 500)
"""Every error of no kind above: a read-only store, a schema from another version, a failed
backend or rank, and any exception that is not a ckstore error."""


def kind_of(exc: BaseException) -> ErrorKind:
    """The kind of ``exc``: the first of :data:`ERROR_KINDS` it is an instance of, else
    :data:`OTHER_ERROR`."""
    return next((k for k in ERROR_KINDS if isinstance(exc, k.errors)), OTHER_ERROR)
