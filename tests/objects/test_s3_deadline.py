"""A frozen S3 endpoint (connections accepted, never answered): every call has one deadline.

botocore retries each request and s3fs retries whole calls, and a ranged read nests the s3fs
layer twice: against a frozen endpoint a read with ``max_attempts=1, connect_timeout=2,
read_timeout=3`` took 174 s. Each call of the S3 backend now ends within what botocore's own
settings allow, ``(connect_timeout + read_timeout)`` per attempt (plus its bytes at
``MIN_RATE``), with a :class:`StorageError` that says so.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest

from ckstore import errors
from ckstore.objects import open_backend
from ckstore.objects.s3 import Deadline
from tests.support.faultproxy import HANG, FaultProxy, Schedule
from tests.support.s3server import storage_options

pytestmark = pytest.mark.s3

TIMEOUTS = {"connect_timeout": 1, "read_timeout": 1, "retries": {"max_attempts": 1}}


def test_the_deadline_follows_botocores_settings() -> None:
    assert Deadline(TIMEOUTS).seconds() == 4.0  # 2 attempts of 1 s + 1 s
    assert Deadline({"retries": {"total_max_attempts": 3}}).seconds(1 << 20) == 3 * 120 + 1
    assert Deadline(None).seconds() == 5 * 120  # botocore's defaults, legacy retry mode


def test_a_read_against_a_frozen_endpoint_ends_at_its_deadline(s3_server: Any) -> None:
    bucket = f"ck-{uuid.uuid4().hex[:12]}"
    s3_server.create_bucket(bucket)
    with FaultProxy(s3_server.endpoint_url) as proxy:
        options = {**storage_options(proxy.url), "config_kwargs": TIMEOUTS}
        backend = open_backend(f"s3://{bucket}/frozen", options)
        backend.put("blob", b"x" * 1000)
        assert backend.get("blob", 10, 20) == b"x" * 20
        proxy.reset(Schedule(seed=0, faults=(HANG,), rate=1.0, max_in_a_row=None))
        for call in (
            lambda: backend.get("blob", 10, 20),
            lambda: backend.size("blob"),
            lambda: list(backend.list("")),
        ):
            t0 = time.monotonic()
            with pytest.raises(errors.StorageError):
                call()
            took = time.monotonic() - t0
            assert took < 4.0 + 4.0, f"{took:.1f} s against a deadline of 4 s"
        assert proxy.faults()  # the endpoint was frozen for every one of them
        backend.close()
