"""Checked bytes on the wire (issue 34, item 4): a bit flipped in transit is rejected.

Every PUT and multipart part carries its CRC32 (:mod:`ckstore.objects.s3`); SeaweedFS checks
it and refuses a body that changed on the way, and the put goes through on a later attempt.
A GET body flipped on the way is caught above the backend, where every chunk read is checked
against its id: a restore returns the tensors taken or raises, never other values. Run with
``-s`` to see the figures.
"""

from __future__ import annotations

import base64
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckstore.objects.s3 import crc32, is_bad_digest
from tests.support.fault_report import FaultBench, fast_retry_backoff
from tests.support.wire_flips import run_flipped_puts, run_flipped_store

pytestmark = pytest.mark.s3


@pytest.fixture(scope="module")
def bench(seaweed_server: Any) -> Iterator[FaultBench]:
    bench = FaultBench(seaweed_server, "seaweedfs")
    yield bench
    bench.close()


@pytest.fixture(autouse=True)
def _fast_backoff() -> Iterator[None]:
    with fast_retry_backoff():
        yield


def test_every_flipped_put_is_refused_and_sent_again(bench: FaultBench) -> None:
    row, flips = run_flipped_puts(bench)
    print(f"\nflipped PUTs: {flips.refused} of {flips.flipped} refused by the server; {row}")
    assert flips.flipped > 0
    assert flips.refused == flips.flipped  # 100 % rejected
    assert row.typed == row.raw == 0, row.errors  # each put went through on a later attempt
    assert row.partial == row.wrong == 0, row
    assert row.committed == row.expected == 13


def test_a_restore_never_returns_flipped_bytes(bench: FaultBench, tmp_path: Path) -> None:
    row, flips = run_flipped_store(bench, tmp_path)
    print(f"\nflipped bodies: {flips}; take: {row}")
    assert row.typed == row.raw == 0, row.errors  # the take went through its flipped PUTs
    assert flips.refused > 0
    assert flips.flipped > flips.refused  # GET bodies were flipped too
    assert flips.wrong == 0  # 0 wrong tensors
    assert flips.exact + flips.rejected == flips.restores
    assert flips.rejected > 0
    for error in flips.errors:  # caught where the chunk is checked against its id
        assert error.startswith("CorruptionError: "), error


def test_the_checksum_is_the_crc32_botocore_sends() -> None:
    body = b"checkpoint" * 1000
    assert crc32(body) == crc32(memoryview(body))
    assert zlib.crc32(body).to_bytes(4, "big") == base64.b64decode(crc32(body))


class _Refused(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.response = {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": 400}}


def test_a_checksum_refusal_is_told_apart() -> None:
    assert is_bad_digest(_Refused("BadDigest", "The CRC32 you specified did not match"))
    assert is_bad_digest(_Refused("XAmzContentChecksumMismatch", "mismatch"))
    try:
        raise OSError(22, "The Content-Md5 you specified did not match what we received.")
    except OSError as exc:
        assert is_bad_digest(exc)
    assert not is_bad_digest(_Refused("InvalidArgument", "bad part number"))
    assert not is_bad_digest(_Refused("PreconditionFailed", "At least one of the pre-conditions"))
