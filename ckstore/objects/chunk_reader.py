"""Chunks read back from packs: one ranged read each, decoded and verified in one pass (against
the chunk's check from its manifest, else its id), delta chains included
(``objects.store.ObjectStore`` reads through this).

A chunk stored raw is read straight into its destination wherever it has one and its stored
payloads need no digest check first, and hashed piece by piece as each lands
(``Backend.get_into_each``: on a local disk 512 KiB reads, each hashed from the core's L2
cache, where a whole 4 MiB chunk is hashed from the last level or memory). Where the
backend maps its objects (``Backend.mapped_views``: a local disk), any other payload is a
view of its mapped pack: reading it copies nothing, and a caller may keep the views of what
it verified (``keep``) to decode them again later without reading them again
(:meth:`ChunkReader.load_kept`). Elsewhere a payload is read into this thread's recycled
buffer.

Why a raw chunk with a destination is read, not mapped, on a local disk too: mapping a page
costs a fault to map it and a TLB shootdown to unmap it (a reader gives its pages back), where
a read copies from the page cache into memory the destination already has. Measured on a warm
270 MiB ``restore(atomic=False)`` on 2 cores: 59 ms mapped, 42 ms read, the same as one copy of
the payloads through mappings with nothing else done (``bench/ckbench/floor.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ckstore.errors import CorruptionError, InvalidInputError
from ckstore.objects.backend import Backend
from ckstore.objects.codecs import (
    NONE,
    check_out,
    decode_hashed,
    decoded_planes,
    grouped_itemsize,
    interleave_planes,
)
from ckstore.objects.delta import xor_into
from ckstore.objects.hashing import fingerprint, payload_digest
from ckstore.objects.into_place import decode_checked, verifier
from ckstore.objects.location import ChunkLocation
from ckstore.objects.packs import pack_name
from ckstore.objects.payloads import Kept, Payloads, check_sizes, scratch


class ChunkReader:
    """Reads chunks from the packs of one backend; every read is verified (against the chunk's
    check when the caller has it, else re-hashed against its id), and a mismatch raises
    :class:`CorruptionError`: wrong bytes are never returned.

    Buffers are per thread (the payload read, delta scratch), so one reader serves many
    threads at once; what it remembers as trusted (:meth:`trust`) is shared by them.

    Args:
        backend: the storage backend holding the packs.
    """

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._trusted: dict[str, int] = {}

    MAX_TRUSTED = 1 << 18
    """Payload fingerprints remembered (about 40 MiB at most; forgotten all at once when full)."""

    def trust(self, chunk_id: str, payload: Any) -> None:
        """Remember that ``payload`` is a right encoding of chunk ``chunk_id``: this process
        encoded it from bytes it hashed to that id, or decoded it to bytes verified against it.
        Only a fingerprint is kept (``hashing.fingerprint``, seeded per process)."""
        if len(self._trusted) >= self.MAX_TRUSTED:
            self._trusted.clear()
        self._trusted[chunk_id] = fingerprint(payload)

    def trusted_planes(self, loc: ChunkLocation, itemsize: int) -> Any:
        """The byte planes (``itemsize`` uint8 arrays of ``raw_length / itemsize`` bytes, in
        this thread's read buffers: valid until its next read) of a chunk whose every payload
        along its chain this process trusts (:meth:`trust`) and is byte-grouped with
        ``itemsize``; None otherwise.

        The planes are not hashed: each payload is the one this process encoded from, or
        decoded to, verified bytes (its fingerprint says so), and decoding is deterministic.
        What a delta take needs from its base, at the cost of decompression only.
        """
        n = loc.raw_length
        if n % itemsize:
            return None

        def trusted(link: ChunkLocation, payload: memoryview) -> bool:
            expected = self._trusted.get(link.chunk_id)
            return expected is not None and fingerprint(payload) == expected

        planes = self._chain_planes(
            list(reversed(loc.chain())), n, trusted, Payloads(self._backend)
        )
        return planes if planes is not None and len(planes) == itemsize else None

    def _chain_planes(
        self,
        chain: list[ChunkLocation],
        n: int,
        seen: Callable[[ChunkLocation, memoryview], bool],
        reads: Payloads,
    ) -> Any:
        """The byte planes of the bytes ``chain`` (root first) decodes to, when every link is
        byte-grouped with one element size: the root's planes as they lie in its payload (a
        chain of one), else the links XORed plane by plane into this thread's scratch memory,
        never interleaved. None as soon as a link is not byte-grouped alike, or ``seen`` (shown
        each payload as it is read) refuses it.

        Raises:
            CorruptionError: a malformed payload.
        """
        import numpy as np

        size: int | None = None
        planes: Any = None
        root: list[Any] | None = None  # the root's planes, in its payload until XORed
        for i, link in enumerate(chain):
            payload = reads.get(link, "root" if i == 0 else "payload")
            if not seen(link, payload):
                return None
            s = grouped_itemsize(link.codec, payload)
            if s is None or n % s or (size is not None and s != size):
                return None
            size = s
            parts = self._guarded(link, decoded_planes, payload, n)
            if len(parts) != size:
                raise CorruptionError(
                    f"chunk {link.chunk_id}: {len(parts)} byte planes for element size {size}"
                )
            if root is None and planes is None:
                root = parts
                continue
            if planes is None:
                planes = np.frombuffer(scratch("planes", n), dtype=np.uint8, count=n).reshape(
                    size, n // size
                )
            first = root if root is not None else planes
            for j, b in enumerate(parts):
                np.bitwise_xor(first[j], b, out=planes[j])  # root XOR first delta: no copy first
            root = None
        return root if planes is None else planes

    def read_chunk(
        self,
        loc: ChunkLocation,
        out: memoryview | None = None,
        *,
        trust: bool = False,
        check: str | None = None,
    ) -> bytes | memoryview:
        """Read, decode and verify one chunk with ONE ranged get of ``(offset, length)``.

        Args:
            loc: where the chunk is.
            out: optional writable buffer of exactly ``loc.raw_length`` bytes to decode into.
            trust: remember the payloads as right once verified (:meth:`trust`).
            check: the chunk's check (``hashing.raw_check``) to verify the decoded bytes
                against; None verifies them against the id (BLAKE3).

        Returns:
            The chunk's raw bytes (``out`` itself when given).

        Raises:
            ObjectNotFoundError: the pack is missing.
            CorruptionError: the payload is malformed or does not hash to ``loc.chunk_id``.
        """
        check_sizes(loc, self._backend.url)
        target = out if out is not None else memoryview(bytearray(loc.raw_length))
        self.verify_chunk(loc, target, trust=trust, check=check)
        return target

    def check_payloads(self, loc: ChunkLocation, keep: Kept | None = None) -> None:
        """Show that the stored payloads of a chunk (and of every base along its chain) are
        the ones their writer stored, without decoding them: each is read and its
        ``hashing.payload_digest`` compared with the one the index recorded
        (``ChunkLocation.payload_digest``; see :meth:`ChunkLocation.digests_known`). With
        ``keep``, the views read from a mapping are kept there (:meth:`load_kept`).

        Raises:
            InvalidInputError: a payload along the chain has no recorded digest.
            ObjectNotFoundError: the pack is missing.
            CorruptionError: a payload differs from what was written.
        """
        reads = Payloads(self._backend, keep=keep)
        for link in loc.chain():
            self._check_digest(link, reads.get(link))

    def _check_digest(self, loc: ChunkLocation, payload: memoryview) -> None:
        if loc.payload_digest is None:
            raise InvalidInputError(f"chunk {loc.chunk_id} has no recorded payload digest to check")
        try:
            digest = payload_digest(payload, loc.chunk_id, loc.codec, loc.raw_length, loc.base_id)
        except ValueError:  # an id that is not hex: a damaged index row
            digest = None
        if digest != loc.payload_digest:
            raise CorruptionError(
                f"chunk {loc.chunk_id} in pack {loc.pack_id} (store {self._backend.url}): the "
                "stored payload differs from the one its writer recorded (or the index's row for "
                "it was damaged): the stored bytes are corrupt"
            )

    def verify_chunk(
        self,
        loc: ChunkLocation,
        out: memoryview | None = None,
        *,
        fingerprint_it: bool = False,
        trust: bool = False,
        check: str | None = None,
        keep: Kept | None = None,
    ) -> int | None:
        """Read one chunk's payload, decode it and verify it, in one pass.

        The payload is read (a view of the mapped pack, else into this thread's recycled
        buffer: ``Backend.get_into``; a chunk stored raw straight into ``out``), decoded into
        ``out`` (or, when None, kept nowhere: a verify-only pass) and hashed block by block as
        it is decoded (``codecs.decode_hashed``): with XXH3-64 against ``check`` (the chunk's
        check from its manifest, ``hashing.raw_check``) when given, else with BLAKE3 against
        its id. Either covers the stored bytes and the decoder.

        With ``trust``, the payloads of the chunk (and its chain) are remembered as right once
        verified (:meth:`trust`). With ``keep``, the views read from a mapping are kept there
        for :meth:`load_kept`.

        Returns:
            With ``fingerprint_it``, the payload's fingerprint (``hashing.fingerprint``) for
            :meth:`load_verified`; else None.

        Raises:
            ObjectNotFoundError: the pack is missing.
            CorruptionError: the payload is malformed or does not match ``check`` (or
                ``loc.chunk_id``).
        """
        hasher, expected = verifier(loc, check)
        links: list[tuple[str, int]] | None = [] if trust else None
        reads = Payloads(self._backend, keep=keep)
        if loc.base_id is not None:
            prints = self._decode_chain(loc, out, hasher, fingerprint_it, reads, links)
        else:
            if loc.codec == NONE and out is not None and keep is None:
                # read into place (mapping costs more), checked piece by piece as it lands
                payload = reads.read_into(loc, out, hasher.update)
            else:
                payload = reads.get(loc)
                self._decode(loc, payload, out, hasher)
            prints = fingerprint(payload) if fingerprint_it or links is not None else None
            if links is not None:
                assert prints is not None
                links.append((loc.chunk_id, prints))
            prints = prints if fingerprint_it else None
        if str(hasher.hexdigest()) != expected:
            why = "the stored bytes are corrupt" + (
                " (or those of a base in its delta chain)" if loc.base_id else ""
            )
            raise CorruptionError(
                f"chunk {loc.chunk_id} in pack {loc.pack_id} (store {self._backend.url}) "
                f"does not match its {'check' if check is not None else 'id'}: {why}"
            )
        if links:
            if len(self._trusted) + len(links) > self.MAX_TRUSTED:
                self._trusted.clear()
            self._trusted.update(links)
        return prints

    def load_kept(
        self,
        loc: ChunkLocation,
        kept: Kept,
        out: memoryview,
        *,
        verify_id: bool = False,
        check: str | None = None,
    ) -> None:
        """Decode a chunk into ``out`` from the payload views a verifying read kept
        (:meth:`verify_chunk` or :meth:`check_payloads` with ``keep``).

        The views are the very bytes that were verified, mapped from an immutable pack, so
        they are decoded without reading anything again, once each is shown to be still its
        pack's (``Backend.current``: a pack written in place since would show through the
        mapping). A chunk stored raw is read again from its pack into ``out``
        (``Backend.read_view_into``: the same bytes, from the page cache, where a copy out of
        the mapping would map each page in again), or copied out of the view where the pack
        at its path is no longer the file mapped. With ``verify_id`` (the views were only
        compared with their digests), the decoded bytes are hashed against the chunk's id as
        they go into ``out``; else against ``check`` (the chunk's check; None: its id):
        :func:`~ckstore.objects.into_place.decode_checked`, a decoder that errs this time is
        caught and the chunk decoded once more (the packs shown unchanged again first).

        Raises:
            CorruptionError: a payload changed since it was kept (nothing decoded into
                ``out`` at a first attempt), is malformed, or does not decode to its id
                (``verify_id``) or ``check``, twice.
        """
        chain = loc.chain()
        if not all(link.chunk_id in kept for link in chain):
            raise InvalidInputError(
                f"chunk {loc.chunk_id}: not every payload of its chain was kept"
            )

        def unchanged() -> None:
            if not all(self._backend.current(kept[link.chunk_id]) for link in chain):
                raise CorruptionError(f"{self._where(loc)} {_CHANGED}")

        reads = Payloads(self._backend, kept=kept)
        raw = loc.base_id is None and loc.codec == NONE
        if raw and not verify_id and len(kept[loc.chunk_id]) == loc.raw_length:
            unchanged()
            # stored as it is: read from its pack again, not copied out of the mapping
            target = check_out(out, loc.raw_length)
            assert target is not None
            self._backend.read_view_into(kept[loc.chunk_id], target)
            return

        def decode(hasher: Any) -> None:
            unchanged()  # before each attempt: a pack rewritten since says so, not a decoder
            if loc.base_id is not None:
                self._decode_chain(loc, out, hasher, False, reads)
            else:
                self._decode(loc, kept[loc.chunk_id], out, hasher)

        self._into_place(loc, decode, None if verify_id else check, not verify_id)

    def _into_place(
        self,
        loc: ChunkLocation,
        decode: Callable[[Any], None],
        check: str | None,
        decoded_before: bool,
    ) -> None:
        """``decode(hasher)`` into place, checked against ``check`` (None: the id) by
        :func:`~ckstore.objects.into_place.decode_checked`; ``decoded_before``: whether the
        first pass decoded the same payloads and checked the result (else it compared them
        with their digests only)."""
        decode_checked(
            self._where(loc), decode, lambda: verifier(loc, check), check is None, decoded_before
        )

    def _where(self, loc: ChunkLocation) -> str:
        return f"chunk {loc.chunk_id} in pack {loc.pack_id} (store {self._backend.url})"

    def drop(self, loc: ChunkLocation) -> None:
        """A hint: the payloads of ``loc``'s chain will not be touched for a while
        (``Backend.drop``: a mapping gives their pages back)."""
        for link in loc.chain():
            self._backend.drop(pack_name(link.pack_id), link.offset, link.length)

    def prefetch(self, loc: ChunkLocation) -> None:
        """A hint: the payloads of ``loc``'s chain will be read soon (``Backend.prefetch``)."""
        for link in loc.chain():
            self._backend.prefetch(pack_name(link.pack_id), link.offset, link.length)

    def load_verified(
        self, loc: ChunkLocation, out: memoryview, expected: int, check: str | None
    ) -> None:
        """Read a chunk that :meth:`verify_chunk` verified moments ago and decode it into ``out``.

        The payload is checked against the fingerprint ``verify_chunk`` returned before
        anything is decoded: stored objects are immutable, so the payload that decoded to
        verified bytes then is the one read now unless the object changed in between anyway.
        The bytes decoded into ``out`` are hashed against ``check`` too (None: the id):
        :func:`~ckstore.objects.into_place.decode_checked`, a decoder that errs this time is
        caught and the chunk decoded once more.

        Raises:
            ObjectNotFoundError: the pack is missing.
            CorruptionError: the payload differs from the one verified, or is malformed, or
                the chunk does not match ``check``, decoded twice.
        """

        def decode(hasher: Any) -> None:
            if loc.base_id is not None:
                prints = self._decode_chain(
                    loc, out, hasher, True, Payloads(self._backend), expected=expected
                )
            else:
                payload = Payloads(self._backend).get(loc)
                prints = fingerprint(payload)
                if prints == expected:
                    self._decode(loc, payload, out, hasher)
            if prints != expected:
                raise CorruptionError(f"{self._where(loc)} {_CHANGED}")

        self._into_place(loc, decode, check, True)

    def load_digested(self, loc: ChunkLocation, out: memoryview) -> None:
        """Decode into ``out`` a chunk whose payloads (its own and its chain's) the first pass
        compared with their digests (:meth:`check_payloads`), read again: each compared again
        before anything is decoded, and the bytes hashed against the id as they land, a
        decode that does not match run once more (:meth:`_into_place`).

        Raises:
            ObjectNotFoundError: a pack is missing.
            CorruptionError: a payload differs from its digest (nothing decoded into ``out``
                at a first attempt), is malformed, or does not decode to the id, twice.
        """

        def decode(hasher: Any) -> None:
            reads = Payloads(self._backend)
            if loc.base_id is not None:
                self._decode_chain(loc, out, hasher, False, reads, digests=True)
            else:
                payload = reads.get(loc)
                self._check_digest(loc, payload)
                self._decode(loc, payload, out, hasher)

        self._into_place(loc, decode, None, False)

    def _decode_chain(
        self,
        loc: ChunkLocation,
        out: memoryview | None,
        hasher: Any,
        fingerprint_it: bool,
        reads: Payloads,
        links: list[tuple[str, int]] | None = None,
        expected: int | None = None,
        digests: bool = False,
    ) -> int | None:
        """Decode a delta: the full chunk at the root of its chain, then the XOR bytes of each
        delta from the root up; hash the result.

        With ``expected`` (:meth:`load_verified`), nothing is written into ``out`` unless the
        chain's combined fingerprint equals it; with ``digests``, unless every payload matches
        its recorded digest (:meth:`check_payloads`).

        When every link is byte-grouped with one element size (the common case: a float
        tensor), the links are XORed plane by plane and the planes interleaved once, so each
        extra link costs a decompression and an XOR, not a re-interleave. Only the result is
        hashed: it matches the id only if every link decoded right. Returns the combined
        fingerprint of every payload of the chain when asked.
        """
        import numpy as np

        chain = list(reversed(loc.chain()))
        n = loc.raw_length
        prints: list[int] = []
        found: list[tuple[str, int]] = []

        def seen(link: ChunkLocation, payload: memoryview) -> bool:
            if digests:
                self._check_digest(link, payload)
            if fingerprint_it or links is not None:
                prints.append(fingerprint(payload))
                found.append((link.chunk_id, prints[-1]))
            return True

        planes = self._chain_planes(chain, n, seen, reads)
        target: memoryview | None = None
        if planes is None:  # a link of another codec (rare): start again, byte by byte
            prints.clear()
            found.clear()
            aside = (
                expected is not None or digests or out is None
            )  # decoded aside until every link is checked
            target = memoryview(scratch("chain", n))[:n] if aside else out
            for i, link in enumerate(chain):
                payload = reads.get(link)
                seen(link, payload)
                if i == 0:
                    self._decode(link, payload, target, None)
                else:
                    xor = memoryview(scratch("xor", n))[:n]
                    self._decode(link, payload, xor, None)
                    xor_into(target, xor)
        if links is not None:
            links.extend(found)
        combined = hash(tuple(prints)) if fingerprint_it else None
        if expected is not None and combined != expected:
            return combined  # the caller raises: nothing was written into out
        if planes is not None:
            interleave_planes(planes, out, hasher)
            return combined
        assert target is not None
        if out is not None and target is not out:
            np.frombuffer(out, dtype=np.uint8)[:] = np.frombuffer(target, dtype=np.uint8)
        if hasher is not None:
            hasher.update(np.frombuffer(target, dtype=np.uint8))
        return combined

    def _guarded(self, loc: ChunkLocation, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except CorruptionError as exc:
            raise CorruptionError(
                f"chunk {loc.chunk_id} in pack {loc.pack_id} (store {self._backend.url}) "
                f"cannot be decoded: {exc}"
            ) from exc

    def _decode(
        self, loc: ChunkLocation, payload: memoryview, out: memoryview | None, hasher: Any
    ) -> None:
        try:
            decode_hashed(loc.codec, payload, loc.raw_length, out, hasher)
        except CorruptionError as exc:
            raise CorruptionError(
                f"chunk {loc.chunk_id} in pack {loc.pack_id} (store {self._backend.url}) "
                f"cannot be decoded: {exc}"
            ) from exc


_CHANGED = "changed after it was verified: stored objects must never change"
