"""A payload already checked, decoded again into its destination and checked as it lands.

An atomic restore decodes a compressed chunk past its memory budget twice: in its first pass,
to check the decoded bytes before anything of the caller's is touched, and in its second, into
place (``ChunkReader.load_kept``, ``ChunkReader.load_verified``). The payload is the one
checked, so a decoder gives the same bytes again, unless it errs this time: a CPU or memory
fault while decoding, which nothing would see once the bytes are in place. So the second
decode is hashed too, against the same check (XXH3-64, at memory speed; a chunk without one:
its id), and a decode that does not match runs once more (a fault that came and went passes,
and is logged); one that errs again raises. A restore by id whose first pass only compared
the payloads with their digests decodes once, into place (``ChunkReader.load_kept``,
``ChunkReader.load_digested``), hashed against the id the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ckstore.errors import CorruptionError
from ckstore.objects.hashing import new_checker, new_hasher
from ckstore.objects.location import ChunkLocation

log = logging.getLogger("ckstore")


def decode_checked(
    what: str,
    decode: Callable[[Any], None],
    verifier: Callable[[], tuple[Any, str]],
    by_id: bool,
    decoded_before: bool,
) -> None:
    """Run ``decode(hasher)`` (which writes the chunk into its destination, feeding ``hasher``
    every byte it writes, in order) with a hasher from ``verifier()``, and compare its
    hexdigest with the digest ``verifier`` gave with it (the chunk's id when ``by_id``, else
    its check); when they differ, once more with a new hasher, logging a warning if that one
    matches. ``what`` names the chunk (its id, pack and store); ``decoded_before`` says
    whether the same payloads were decoded and checked before (else only compared with their
    digests), which is what a mismatch then means.

    Raises:
        CorruptionError: both decodes differ from the digest; the destination holds the last
            one. Whatever ``decode`` raises (a payload changed or damaged: not retried).
    """
    for attempt in (1, 2):
        hasher, expected = verifier()
        decode(hasher)
        if str(hasher.hexdigest()) == expected:
            if attempt == 2:
                log.warning(
                    "%s did not match its check as it was decoded into place and was decoded "
                    "again, right this time: a fault of the CPU or memory while decoding "
                    "(if this recurs, test this machine's memory)",
                    what,
                )
            return
    against = "id" if by_id else "check"
    why = (
        f"does not match its {against}, decoded into place twice, though the same payload "
        "matched it before: a decoder that errs (a bug, or a CPU or memory fault)"
        if decoded_before
        else f"does not match its {against}, decoded twice: its stored payload is the one its "
        "writer recorded, so the writer stored a wrong encoding (or the decoder errs)"
    )
    raise CorruptionError(f"{what} {why}")


UNCHECKED = "unchecked"
"""A ``check`` that skips the check of the decoded bytes (lengths and formats are still
checked): what a benchmark measures the checks' cost against; ckstore never passes it."""


class _NoCheck:
    def update(self, data: Any) -> None:
        pass

    def hexdigest(self) -> str:
        return UNCHECKED


def verifier(loc: ChunkLocation, check: str | None) -> tuple[Any, str]:
    """A hasher for the chunk's decoded bytes and the hexdigest it must end with: XXH3-64
    seeded with the id against ``check``, or BLAKE3 against the id."""
    if check == UNCHECKED:
        return _NoCheck(), UNCHECKED
    if check is None:
        return new_hasher(), loc.chunk_id
    try:
        return new_checker(loc.chunk_id), check
    except ValueError:  # an id that is not hex: never matches
        return new_hasher(), loc.chunk_id
