"""The object backend contract: a flat namespace of immutable, content-named objects.

Everything above this layer (packs, manifests, the index rebuild) talks to storage only through
:class:`Backend`. Implementations live in ``local.py`` (plain files), ``fsspec_backend.py``
(``memory://`` and any other fsspec filesystem) and ``s3.py`` (S3 via s3fs); ``opener.py`` picks
one from a URL.
"""

from __future__ import annotations

import abc
import errno
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Union

from ckstore.errors import (
    CorruptionError,
    InvalidInputError,
    NoSpaceError,
    ObjectNotFoundError,
    StorageError,
)

Buffer = Union[bytes, bytearray, memoryview]
"""A contiguous byte buffer accepted by :meth:`Backend.put`."""

PutData = Union[Buffer, Sequence[Buffer]]
"""One buffer, or a sequence of buffers written back to back."""

_VISIBLE = re.compile("[\x21-\x7e]+")
"""Visible ASCII: the characters a name may hold (a regular expression, as every read of a
chunk checks its pack's name)."""

MAX_NAME_LENGTH = 1024
"""Hard limit on a name, in bytes (S3's key limit)."""


def validate_name(name: str) -> str:
    """Check that ``name`` is a safe object name and return it unchanged.

    Rules: a non-empty ``str`` of at most :data:`MAX_NAME_LENGTH` visible ASCII characters
    (0x21-0x7E); parts separated by ``/``; no leading or trailing ``/``, no empty part, no
    backslash, and no part starting with ``.`` (this rules out ``.`` and ``..`` and keeps the
    names backends use for temporary files out of the namespace).

    Args:
        name: the candidate object name.

    Returns:
        ``name``.

    Raises:
        InvalidInputError: if any rule is broken; the message names the rule.
    """
    if not isinstance(name, str) or not name:
        raise InvalidInputError(f"object name must be a non-empty str, got {name!r}")
    if len(name) > MAX_NAME_LENGTH:
        raise InvalidInputError(f"object name longer than {MAX_NAME_LENGTH} characters: {name!r}")
    if not _VISIBLE.fullmatch(name):
        raise InvalidInputError(f"object name must be visible ASCII only: {name!r}")
    if "\\" in name:
        raise InvalidInputError(f"object name must not contain a backslash: {name!r}")
    for part in name.split("/"):
        if not part:
            raise InvalidInputError(f"object name has an empty part or a leading '/': {name!r}")
        if part.startswith("."):
            raise InvalidInputError(f"object name part must not start with '.': {name!r}")
    return name


def validate_prefix(prefix: str) -> str:
    """Check a listing prefix: ``""`` or a name prefix that follows :func:`validate_name`.

    A trailing ``/`` is allowed (``"packs/"``).

    Raises:
        InvalidInputError: if the prefix could never match a valid name.
    """
    if prefix == "":
        return prefix
    validate_name(prefix[:-1] if prefix.endswith("/") and len(prefix) > 1 else prefix)
    return prefix


def as_buffers(data: PutData) -> list[memoryview]:
    """Normalise ``put`` data to a list of flat byte memoryviews (no copies).

    Raises:
        InvalidInputError: if ``data`` is not a buffer or a sequence of buffers.
    """
    items = [data] if isinstance(data, (bytes, bytearray, memoryview)) else list(data)
    views = []
    for item in items:
        try:
            view = memoryview(item)
        except TypeError as exc:
            raise InvalidInputError(f"put data must be bytes-like, got {type(item)!r}") from exc
        views.append(view.cast("B") if view.format != "B" or view.ndim != 1 else view)
    return views


def check_range(offset: int, length: int | None) -> None:
    """Reject negative offsets/lengths.

    Raises:
        InvalidInputError: if ``offset < 0`` or ``length < 0``.
    """
    if offset < 0 or (length is not None and length < 0):
        raise InvalidInputError(f"bad byte range: offset={offset}, length={length}")


_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}

NO_SPACE_ADVICE = (
    "the take, import or gc writing it stops, and nothing was committed (no snapshot is added, "
    "no tag moves); what it wrote so far is unreferenced and `ckstore gc` reclaims it once the "
    "writer has ended (at once with `ckstore gc --grace 0s` when no other take or restore is "
    "running; gc needs a little free space for the index itself). Free some space (or delete "
    "old snapshots and gc), then take again"
)
"""What a "disk full" error adds: nothing was committed, and how to get the space back."""


def write_failed(name: str, url: str, exc: BaseException) -> StorageError:
    """The error for a failed write of object ``name``: NoSpaceError when the disk or quota is
    full (saying that nothing was committed and that gc reclaims what was written)."""
    if isinstance(exc, OSError) and exc.errno in _FULL:
        return NoSpaceError(
            f"no space left to write object {name!r} in store {url} ({exc.strerror}): {NO_SPACE_ADVICE}"
        )
    return StorageError(f"cannot write object {name!r} in store {url}: {exc}")


def not_found(name: str, url: str) -> ObjectNotFoundError:
    """The error for a missing object, naming it and the store."""
    return ObjectNotFoundError(f"object {name!r} not found in store {url}")


def truncated(name: str, url: str, offset: int, wanted: int | None, got: int) -> CorruptionError:
    """The error for a read that returned fewer bytes than asked for."""
    want = "to the end" if wanted is None else f"{wanted} bytes"
    return CorruptionError(
        f"object {name!r} in store {url} is truncated: asked for {want} at offset {offset}, "
        f"got {got} bytes"
    )


class Backend(abc.ABC):
    """A store of immutable objects named by relative keys. The whole storage contract.

    Names are '/'-separated relative keys such as ``packs/ab/<hex>.pack``; every method validates
    them with :func:`validate_name` and raises :class:`InvalidInputError` for a bad one.

    Guarantees an implementation MUST give:

    * **Atomic, durable, create-if-absent puts.** :meth:`put` either makes the complete object
      visible or nothing; readers never see a partial object. When it returns, the object is
      durable (local: fsynced file and directory; S3: acknowledged). If the name already exists,
      ``put`` does not touch it and returns ``False`` (names are content-addressed, so the
      existing content is assumed identical; a backend MAY raise :class:`StorageError` when
      the object in place is not of the size written: S3's, whose retries below a put may meet
      an earlier attempt the server stored in part). Of several concurrent puts of one name, at most one
      returns ``True`` (the generic fsspec backend guarantees this only within one process).
    * **Read-after-write.** Once ``put`` returns, ``get``/``size``/``exists``/``list`` see the
      object (in this process and, for shared stores, in any other).
    * **Exact ranged reads.** ``get(name, offset, length)`` returns exactly ``length`` bytes (or
      everything from ``offset`` when ``length`` is None); ``get_into(name, offset, out)`` reads
      exactly ``len(out)`` bytes into a caller's buffer (the default goes through ``get``;
      ``get_into_each`` the same, handing ``each`` its pieces in order as they land), and
      ``view(name, offset, length)`` a read-only view of exactly that range (the default a
      copy; a mapping where :attr:`mapped_views`). A missing object raises
      :class:`ObjectNotFoundError` naming the object and :attr:`url`; an object shorter than
      the range raises :class:`CorruptionError` ("truncated"). ``get`` is idempotent.
    * **Idempotent deletes.** Deleting a missing object is not an error.
    * **Sorted recursive listing.** ``list(prefix)`` yields every name that starts with
      ``prefix`` (all depths), as relative names, in sorted order; never temporary files.
    * **Typed errors.** Any other failure raises :class:`StorageError` (after the
      implementation's retries), chained with ``raise ... from`` to the underlying error.

    Backends are safe to call from several threads at once. ``close`` releases resources; a
    closed backend must not be used again.
    """

    @property
    @abc.abstractmethod
    def url(self) -> str:
        """The URL this backend stores under (used in error messages)."""

    @abc.abstractmethod
    def put(self, name: str, data: PutData) -> bool:
        """Store ``data`` under ``name`` atomically and durably, unless ``name`` exists.

        Args:
            name: object name.
            data: a bytes-like object, or a sequence of them written back to back without
                concatenating them in memory where the backend allows it.

        Returns:
            True if this call created the object, False if it already existed.
        """

    @abc.abstractmethod
    def get(self, name: str, offset: int = 0, length: int | None = None) -> bytes:
        """Read ``length`` bytes of ``name`` starting at ``offset`` (to the end if None).

        Raises:
            ObjectNotFoundError: the object does not exist.
            CorruptionError: the object is shorter than the requested range.
        """

    def get_into(self, name: str, offset: int, out: memoryview) -> None:
        """Read exactly ``len(out)`` bytes of ``name`` starting at ``offset`` into ``out``.

        Readers that recycle their buffers use this instead of :meth:`get` (no new ``bytes``
        per read). The default calls :meth:`get` and copies; a backend that can read straight
        into memory (the local one: ``preadv``) overrides it. Same errors as :meth:`get`.
        """
        data = self.get(name, offset, len(out))
        if len(data) != len(out):
            raise truncated(name, self.url, offset, len(out), len(data))
        out[:] = data

    def get_into_each(
        self, name: str, offset: int, out: memoryview, each: Callable[[memoryview], object]
    ) -> None:
        """:meth:`get_into`, calling ``each`` with every piece of ``out`` once it holds its
        bytes: in order, back to back, all of ``out`` covered (a check of what was read).
        The default reads it all, then calls ``each`` once; a backend that reads from this
        host's page cache (the local one) reads in pieces small enough to be in the CPU's
        cache still when ``each`` runs over them. Same errors as :meth:`get`; nothing is
        passed to ``each`` past a failed read."""
        self.get_into(name, offset, out)
        each(out)

    mapped_views = False
    """Whether :meth:`view` maps the object instead of reading it (the local backend): a view
    then costs no memory until its bytes are touched, touching them again is no read from
    storage (a reader keeps the views of what it checked instead of reading it twice), and
    it outlives the object's deletion."""

    def view(self, name: str, offset: int, length: int) -> memoryview:
        """A read-only view of ``length`` bytes of ``name`` from ``offset``, valid while it is
        referenced. The default reads them (:meth:`get`, into new memory); a backend with
        :attr:`mapped_views` maps them. Same errors as :meth:`get`."""
        data = self.get(name, offset, length)
        if len(data) != length:
            raise truncated(name, self.url, offset, length, len(data))
        return memoryview(data)

    def current(self, view: memoryview) -> bool:
        """Whether the bytes of ``view`` (from :meth:`view`) are still its object's: False
        once the object was written in place since the view was made (which breaks the
        immutability every object has, and which a mapping shows). The default, whose views
        are copies: True."""
        return True

    def read_view_into(self, view: memoryview, out: memoryview) -> None:
        """Fill ``out`` (as long as ``view``) with the bytes of ``view`` (from :meth:`view`).
        The default copies them; a backend with :attr:`mapped_views` may read them from the
        very object mapped instead, which touches no page of the mapping. Either way, bytes
        that were :meth:`current` when the caller last asked."""
        import numpy as np  # here: reading an index or a raw chunk by itself never loads numpy

        np.frombuffer(out, dtype=np.uint8)[:] = np.frombuffer(view, dtype=np.uint8)

    def drop(self, name: str, offset: int, length: int) -> None:  # noqa: B027 - optional hook
        """A hint that the bytes of that range, in views of ``name``, will not be touched for
        a while: a mapping gives their pages back (touching them again maps them again). The
        default does nothing."""

    def prefetch(self, name: str, offset: int, length: int) -> None:  # noqa: B027 - optional hook
        """A hint that that range of ``name`` will be read soon: start fetching it, without
        waiting (the local backend: the kernel reads it ahead into the page cache). The
        default does nothing."""

    def read_ahead(self) -> int:
        """Bytes the storage reads ahead on its own of a read or a page fault in one of its
        objects (the local backend: the kernel's read-ahead window of the disk holding its
        root, read anew at each call); 0 where unknown or none. The default: 0."""
        return 0

    @abc.abstractmethod
    def size(self, name: str) -> int:
        """Size of ``name`` in bytes.

        Raises:
            ObjectNotFoundError: the object does not exist.
        """

    @abc.abstractmethod
    def exists(self, name: str) -> bool:
        """Whether ``name`` exists (a prefix of other names is not an object)."""

    @abc.abstractmethod
    def delete(self, name: str) -> None:
        """Delete ``name``; a missing object is not an error."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[str]:
        """Yield every object name starting with ``prefix``, recursively, sorted."""

    cached_locally = False
    """Whether reading an object again is served from this host (a local disk's page cache,
    process memory) rather than fetched from storage again: an atomic restore, which reads each
    payload in two passes, keeps a copy of what it read (``StashingBackend``) where it is not."""

    def writer(self, direct: bool = False) -> ObjectWriter:
        """A new object written piece by piece and published under its name at the end
        (:class:`ObjectWriter`): a pack whose name, the hash of its trailer, is known only once
        every payload went in. The default keeps the pieces in memory and publishes them with
        one :meth:`put`; a backend that can stage bytes elsewhere (the local one: a temporary
        file) overrides it, so the writer holds nothing in memory. ``direct`` asks that the
        bytes go around the host's page cache where the backend can (the local one: a take
        behind training); others ignore it."""
        return ObjectWriter(self)

    def sweep_temporary(self, older_than: float) -> int:
        """Delete what interrupted writes left behind (e.g. temporary files of a killed
        process) that is older than ``older_than`` (Unix time); the number deleted. Called by gc
        when no writer can be alive. The default has nothing to sweep."""
        return 0

    def partial_uploads(self) -> Sequence[tuple[str, str]]:
        """Writes begun under this backend's root and never finished or discarded, as
        ``(name, upload id)`` pairs: an S3 multipart upload whose writer died before it
        completed or aborted it (its parts are stored, and billed, until someone aborts it).

        The default, for backends whose writes leave nothing behind when they fail (local
        temporary files are removed, or named ``.``-first and never listed), is none.
        """
        return []

    def discard_upload(self, name: str, upload_id: str) -> None:  # noqa: B027 - optional hook
        """Discard one write that :meth:`partial_uploads` listed (idempotent). Only for writes
        no live writer can still finish: gc calls it when no write session is alive."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources. The default does nothing."""

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


class ObjectWriter:
    """An object written piece by piece, then published under a name given at the end.

    :meth:`write` appends, :meth:`patch` overwrites bytes already written (a header filled in
    last), :meth:`commit` publishes the object with :meth:`Backend.put`'s guarantees (atomic,
    durable, create-if-absent; True if this call created it), :meth:`abort` drops it. Nothing is
    visible before ``commit``. Used by one thread at a time.

    This default keeps the pieces (by reference, never copied) until ``commit``:
    :attr:`holds_data` is True, so a caller must not reuse a buffer it wrote until then.
    """

    holds_data = True
    """Whether written buffers stay referenced until :meth:`commit` (False: copied away)."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._parts: list[memoryview] = []
        self.size = 0

    def write(self, data: Buffer) -> None:
        """Append ``data``."""
        (view,) = as_buffers(data)
        self._parts.append(view)
        self.size += len(view)

    def patch(self, offset: int, data: Buffer) -> None:
        """Overwrite the bytes at ``offset`` (already written) with ``data``.

        Raises:
            InvalidInputError: the range is not inside what was written (this default: it must
                be exactly one earlier :meth:`write`).
        """
        (view,) = as_buffers(data)
        at = 0
        for i, part in enumerate(self._parts):
            if at == offset and len(part) == len(view):
                self._parts[i] = view
                return
            at += len(part)
        raise InvalidInputError(f"patch of {len(view)} bytes at {offset}: not one earlier write")

    def commit(self, name: str) -> bool:
        """Publish under ``name`` (see :meth:`Backend.put`); the writer is spent."""
        parts, self._parts = self._parts, []
        return self._backend.put(name, parts)

    def abort(self) -> None:
        """Drop what was written (idempotent)."""
        self._parts = []
