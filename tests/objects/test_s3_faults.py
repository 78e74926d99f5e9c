"""Faults on the wire, between s3fs/botocore and a real S3 server (SeaweedFS on loopback).

A seeded fault proxy (tests/support/faultproxy.py) injects 503 SlowDown, connection resets mid-body,
truncated bodies, latency and lost acknowledgements; tests/support/fault_report.py runs the
scenarios. Whatever the fault: no partial object is ever visible on the server, every read
returns the bytes written or raises a ckstore error, retries are bounded, and when they run
out a typed :class:`StorageError` comes out, never a raw botocore/aiohttp exception. Run with
``-s`` to see the figures.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.fault_report import (
    EXHAUST_MAX_ATTEMPTS,
    EXHAUST_S3FS_RETRIES,
    EXHAUSTIBLE,
    RECOVER_MAX_ATTEMPTS,
    RECOVER_S3FS_RETRIES,
    FaultBench,
    FaultRow,
    attempt_bound,
    fast_retry_backoff,
    format_table,
    run_exhaust,
    run_lost_completion,
    run_recover,
    run_store,
)
from tests.support.faultproxy import FAULTS

pytestmark = pytest.mark.s3

SERVER = "seaweedfs"


@pytest.fixture(scope="module")
def report() -> Iterator[list[FaultRow]]:
    """Rows of figures, printed as a table when the module ends (visible with ``-s``)."""
    rows: list[FaultRow] = []
    yield rows
    if rows:
        print("\n" + format_table(rows))


@pytest.fixture(scope="module")
def bench(seaweed_server: Any) -> Iterator[FaultBench]:
    """One fault proxy in front of the session's SeaweedFS, for the whole module."""
    bench = FaultBench(seaweed_server, SERVER)
    yield bench
    bench.close()


@pytest.fixture(autouse=True)
def _fast_backoff() -> Iterator[None]:
    with fast_retry_backoff():
        yield


def _assert_sound(row: FaultRow) -> None:
    """What must hold whatever happened: nothing partial, nothing wrong, nothing untyped."""
    assert row.raw == 0, row.errors
    assert row.partial == 0, row
    assert row.wrong == 0, row


@pytest.mark.parametrize("fault", FAULTS)
def test_packs_survive_faults_that_retries_get_through(
    bench: FaultBench, report: list[FaultRow], fault: str
) -> None:
    row = run_recover(bench, fault)
    report.append(row)
    _assert_sound(row)
    assert row.faults > 0
    assert row.typed == 0, row.errors
    assert row.committed == row.expected == 5  # four packs and one multipart object
    assert row.max_try <= attempt_bound(RECOVER_MAX_ATTEMPTS, RECOVER_S3FS_RETRIES)
    assert (row.retries > 0) == (fault != "latency")


@pytest.mark.parametrize("fault", EXHAUSTIBLE)
def test_when_retries_run_out_a_typed_error_comes_out(
    bench: FaultBench, report: list[FaultRow], fault: str
) -> None:
    row = run_exhaust(bench, fault)
    report.append(row)
    _assert_sound(row)
    assert row.max_try <= attempt_bound(EXHAUST_MAX_ATTEMPTS, EXHAUST_S3FS_RETRIES)
    for error in row.errors:
        assert error.startswith("StorageError: cannot "), error
        assert f"s3://{bench.bucket}/fault-" in error, error
    if fault == "lost_ack":
        # Every write acknowledgement is lost, yet the put settles on the object it stored.
        assert row.typed == 0 and row.committed == row.expected == 1, row
    elif fault == "truncate":
        # A put's answer has no body to truncate; both reads and the listing fail.
        assert row.typed == 3 and row.committed == row.expected == 1, row
    else:
        assert row.typed == row.ops == 4 and row.committed == 0, row


def test_a_lost_multipart_completion_settles_on_the_stored_object(
    bench: FaultBench, report: list[FaultRow]
) -> None:
    row = run_lost_completion(bench)
    report.append(row)
    _assert_sound(row)
    assert row.faults == 2  # the upload's creation and its completion
    assert row.typed == 0, row.errors
    assert row.committed == row.expected == 1


def test_take_and_restore_through_every_fault(
    bench: FaultBench, report: list[FaultRow], tmp_path: Path
) -> None:
    row = run_store(bench, tmp_path)
    report.append(row)
    _assert_sound(row)
    assert row.faults > 0
    assert row.typed == 0, row.errors
    assert row.committed == row.expected > 0
