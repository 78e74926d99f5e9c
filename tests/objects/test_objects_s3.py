"""S3-specific behaviour: 412 detection by status/code, what a 412 must be checked against,
multipart uploads."""

from __future__ import annotations

import errno

import pytest
from botocore.exceptions import ClientError

from ckstore.errors import StorageError
from ckstore.objects import Backend, S3Backend
from ckstore.objects.s3 import is_precondition_failed


def _client_error(status: int, code: str) -> ClientError:
    response = {
        "Error": {"Code": code, "Message": "m"},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    return ClientError(response, "PutObject")  # type: ignore[arg-type]


def test_412_detected_whatever_the_exception_type() -> None:
    for outer in (FileExistsError("exists"), OSError(errno.EINVAL, "Invalid argument")):
        outer.__cause__ = _client_error(412, "PreconditionFailed")
        assert is_precondition_failed(outer)
    other = OSError(errno.EINVAL, "bad")
    other.__cause__ = _client_error(400, "InvalidArgument")
    assert not is_precondition_failed(other)
    assert not is_precondition_failed(FileExistsError("no http response"))


@pytest.mark.s3
def test_multipart_put(s3_backend: Backend) -> None:
    assert isinstance(s3_backend, S3Backend)
    backend = S3Backend(
        s3_backend.fs,
        s3_backend.url[len("s3://") :],
        multipart_threshold=1 << 20,
        part_size=5 << 20,
    )
    parts = [bytes([i]) * (3 << 20) for i in range(4)]  # 12 MiB -> parts of 5, 5, 2 MiB
    assert backend.put("big/object", parts) is True
    assert backend.size("big/object") == 12 << 20
    assert backend.get("big/object", (3 << 20) - 2, 4) == b"\x00\x00\x01\x01"
    assert backend.put("big/object", parts) is False
    assert backend.get("big/object") == b"".join(parts)


@pytest.mark.s3
def test_a_412_without_an_object_is_not_reported_as_existing(s3_backend: Backend) -> None:
    # SeaweedFS stores keys as files in directories: once "q/r" exists, a create-only put of
    # "q" answers 412 although no object "q" exists. put() must not return False for it.
    assert s3_backend.put("q/r", b"1") is True
    try:
        created = s3_backend.put("q", b"2")
    except StorageError as exc:
        assert "412" in str(exc) and "'q'" in str(exc)
        assert not s3_backend.exists("q")
    else:
        assert created is True and s3_backend.get("q") == b"2"
    assert s3_backend.get("q/r") == b"1"
