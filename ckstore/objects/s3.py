"""S3 backend over s3fs, with create-only puts (``If-None-Match: *``).

A put that finds the key taken answers HTTP 412 ``PreconditionFailed``. s3fs maps that to
``FileExistsError`` for some servers and to ``OSError(EINVAL)`` for others (SeaweedFS), so this
module recognises it by the HTTP status / error code found on the botocore error in the
exception chain, never by the exception type. Objects up to ``multipart_threshold`` go up in
one ``PutObject`` (the buffers joined); larger ones as a multipart upload whose parts are built
one at a time from the buffers (memory bounded by ``part_size``), completed with the same
condition.

Retries happen below this module, in two layers, both bounded: botocore retries each request
(throttling, 5xx, connection errors) up to ``config_kwargs={"retries": {"max_attempts": N}}``,
and s3fs repeats a whole call up to ``S3FileSystem.retries`` times (default 5) on throttling and
on errors while reading a body (a connection reset or a truncated body). A ranged read nests the
s3fs layer twice. When they give up, the error comes out as :class:`StorageError`.

**One deadline per call.** The layers multiply: against a frozen endpoint (a connection that
is accepted and never answered) a read with ``max_attempts=1, connect_timeout=2,
read_timeout=3`` took 174 s, 58 times the read timeout. So every call has one deadline of its
own (:class:`Deadline`): what botocore's settings allow, ``(connect_timeout + read_timeout)``
for each of its attempts, plus the time to move the call's bytes at :data:`MIN_RATE`. Past it
the call is cancelled (fsspec's ``timeout``) and :class:`StorageError` says so.

**Checked bytes on the wire.** Every ``PutObject`` and every multipart part carries its CRC32
(``x-amz-checksum-crc32``, computed here, whatever the client's ``request_checksum_calculation``
says), which the server verifies before it stores anything: a byte changed in transit makes it
answer HTTP 400 (``BadDigest`` and kin), nothing is stored, and the put is sent again (at most
:data:`_CONFLICT_RETRIES` times; past that :class:`StorageError` says so). CRC32 is what
botocore computes without the optional CRT extension (CRC32C and CRC64NVME need it); servers
that ignore the header (moto) store what they receive. Reads are checked above this module:
every chunk read from a pack is verified against its id before it is decoded, and a whole
object read is also checked by botocore against the checksum the server returns with it, where
it returns one.

Names are content-addressed, which makes a retried put safe: when a put's acknowledgement is
lost, the retry (or the next put) meets the object it created and answers 412, and an existing
object under the name is by construction the same object. :meth:`S3Backend.put` still checks
(with a HEAD) that an object is really there before reporting it as existing, and settles a
put that failed for any other reason the same way, if an object of exactly the size being
written is in place (the write may have been committed before the connection broke); puts are
atomic, so that object is complete.
"""

from __future__ import annotations

import base64
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

from ckstore.errors import CkstoreError, InvalidInputError, StorageError
from ckstore.objects.backend import (
    PutData,
    as_buffers,
    check_range,
    not_found,
    truncated,
    validate_name,
    validate_prefix,
)
from ckstore.objects.fsspec_backend import FsspecBackend

_CONFLICT_RETRIES = 5

MIN_RATE = 1 << 20
"""Bytes per second a call's deadline allows for moving its bytes (beyond the timeouts)."""


class Deadline:
    """How long one call may take, from botocore's settings in ``config_kwargs`` (its defaults:
    60 s to connect, 60 s per read, 5 attempts in its legacy retry mode)."""

    def __init__(self, config_kwargs: Any = None) -> None:
        conf: dict[str, Any] = config_kwargs if isinstance(config_kwargs, dict) else {}
        found = conf.get("retries")
        retries: dict[str, Any] = found if isinstance(found, dict) else {}
        self.connect = float(conf.get("connect_timeout") or 60)
        self.read = float(conf.get("read_timeout") or 60)
        if retries.get("total_max_attempts") is not None:
            self.attempts = max(1, int(retries["total_max_attempts"]))
        elif retries.get("max_attempts") is not None:
            self.attempts = max(1, int(retries["max_attempts"]) + 1)  # retries after the first
        else:
            self.attempts = 5

    def seconds(self, nbytes: int = 0) -> float:
        """The deadline of a call moving ``nbytes``."""
        return self.attempts * (self.connect + self.read) + nbytes / MIN_RATE


def _http_error(exc: BaseException | None) -> tuple[int | None, str | None]:
    """(HTTP status, error code) from the first botocore-style error in the chain."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        response = getattr(exc, "response", None)
        if isinstance(response, dict):
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            code = response.get("Error", {}).get("Code")
            return status, code
        exc = exc.__cause__ or exc.__context__
    return None, None


def is_precondition_failed(exc: BaseException) -> bool:
    """Whether ``exc`` (or its cause) is an HTTP 412 / ``PreconditionFailed`` answer."""
    status, code = _http_error(exc)
    return status == 412 or code == "PreconditionFailed"


def _is_conditional_conflict(exc: BaseException) -> bool:
    """HTTP 409 ``ConditionalRequestConflict``: a concurrent conditional write; retry."""
    status, code = _http_error(exc)
    return code == "ConditionalRequestConflict" or (status == 409 and code is None)


def _is_not_found(exc: BaseException) -> bool:
    status, code = _http_error(exc)
    return isinstance(exc, FileNotFoundError) or status == 404 or code in {"NoSuchKey", "404"}


_BAD_DIGEST_CODES = frozenset(
    {"BadDigest", "InvalidDigest", "XAmzContentChecksumMismatch", "XAmzContentSHA256Mismatch"}
)


def is_bad_digest(exc: BaseException) -> bool:
    """Whether ``exc`` (or its cause) is the server refusing a body whose checksum it did not
    match: the bytes changed on the way, nothing was stored."""
    status, code = _http_error(exc)
    if code in _BAD_DIGEST_CODES:
        return True
    text = str(exc).lower()
    return (
        status in (400, None)
        and "did not match" in text
        and ("md5" in text or "checksum" in text or "crc" in text)
    )


def crc32(body: bytes | memoryview) -> str:
    """The ``x-amz-checksum-crc32`` value of ``body``: its CRC32, big-endian, in base64."""
    return base64.b64encode(zlib.crc32(body).to_bytes(4, "big")).decode("ascii")


def _is_invalid_range(exc: BaseException) -> bool:
    status, code = _http_error(exc)
    return status == 416 or code == "InvalidRange"


class S3Backend(FsspecBackend):
    """Objects below ``bucket/prefix`` on S3 (or any S3-compatible server).

    Args:
        fs: an ``s3fs.S3FileSystem``.
        root: ``bucket`` or ``bucket/prefix`` (no ``s3://``).
        multipart_threshold: objects larger than this use a multipart upload.
        part_size: size of each multipart part (at least 5 MiB, S3's minimum).
    """

    def __init__(
        self,
        fs: Any,
        root: str,
        multipart_threshold: int = 64 << 20,
        part_size: int = 16 << 20,
    ) -> None:
        super().__init__(fs, root.strip("/"))
        self._threshold = multipart_threshold
        self._part_size = max(part_size, 5 << 20)
        self.deadline = Deadline(getattr(fs, "config_kwargs", None))

    def _s3(self, method: str, nbytes: int = 0, **kwargs: Any) -> Any:
        """One S3 call, within its deadline (module docstring)."""
        return self._within(nbytes, self._fs.call_s3, method, **kwargs)

    def _within(self, nbytes: int, fn: Any, *args: Any, **kwargs: Any) -> Any:
        seconds = self.deadline.seconds(nbytes)
        try:
            return fn(*args, timeout=seconds, **kwargs)
        except TimeoutError as exc:  # fsspec's FSTimeoutError: the call was cancelled
            raise StorageError(
                f"store {self.url}: no answer within {seconds:.0f} s (the deadline of one call: "
                f"{self.deadline.attempts} attempt(s) of connect_timeout {self.deadline.connect:g} s "
                f"+ read_timeout {self.deadline.read:g} s, and {nbytes} bytes at "
                f"{MIN_RATE >> 20} MiB/s); is the endpoint frozen or unreachable?"
            ) from exc

    def _bucket_key(self, name: str) -> tuple[str, str]:
        bucket, _, key = self._path(name).partition("/")
        return bucket, key

    def put(self, name: str, data: PutData) -> bool:
        """Create-only put; see :class:`Backend`.

        After a lost acknowledgement the retry finds the object this call wrote, so a put may
        return False for an object it created itself; the object is in place either way.

        Raises:
            StorageError: the write failed and no complete object of this size is under
                ``name``, or the server answered 412 without holding an object by that name.
        """
        bucket, key = self._bucket_key(name)
        views = as_buffers(data)
        total = sum(len(v) for v in views)
        last: BaseException | None = None
        for _ in range(_CONFLICT_RETRIES):
            try:
                if total <= self._threshold:
                    body = b"".join(views) if len(views) != 1 else bytes(views[0])
                    self._s3(
                        "put_object",
                        len(body),
                        Bucket=bucket,
                        Key=key,
                        Body=body,
                        ChecksumCRC32=crc32(body),
                        IfNoneMatch="*",
                    )
                else:
                    self._multipart(bucket, key, views)
                self._fs.invalidate_cache(self._path(name))
                return True
            except CkstoreError:
                raise
            except Exception as exc:
                if is_precondition_failed(exc):
                    return self._check_existing(name, total, exc)
                if is_bad_digest(exc):  # changed in transit, nothing stored: send it again
                    last = exc
                    continue
                if not _is_conditional_conflict(exc):
                    return self._settle_failed_put(name, total, exc)
                last = exc
        if last is not None and is_bad_digest(last):
            raise StorageError(
                f"cannot write object {name!r} in store {self.url}: the server refused its "
                f"bytes {_CONFLICT_RETRIES} times as not matching their checksum (changed in "
                "transit); check the network path to the server (a proxy, a NIC) and retry"
            ) from last
        raise self._fail("write", name, last or RuntimeError("conflict")) from last

    def _check_existing(self, name: str, size: int, exc: BaseException) -> bool:
        """After a 412: confirm that an object of ``size`` bytes holds ``name`` (its content
        is not compared: the name is the content's hash, see :class:`Backend`; its size is,
        for the 412 may answer a retry below this call whose first attempt the server stored
        in part, its acknowledgement lost)."""
        head = self._head(name)
        if head is None:
            # SeaweedFS (and other file-system-backed servers) answer 412 when the name is a
            # directory, i.e. a prefix of other objects' names.
            raise StorageError(
                f"cannot write object {name!r} in store {self.url}: the server reports it as "
                "existing (HTTP 412) but holds no such object; is the name also a prefix of "
                "other objects on a server that cannot store both?"
            ) from exc
        if int(head["ContentLength"]) != size:
            raise StorageError(
                f"cannot write object {name!r} in store {self.url}: the server holds "
                f"{int(head['ContentLength'])} bytes under that name where {size} were written "
                "(an earlier attempt stored in part); nothing was recorded, retry the call"
            ) from exc
        return False

    def _settle_failed_put(self, name: str, size: int, exc: BaseException) -> bool:
        """After a failed put: False if a complete object is in place anyway, else raise.

        The write may have been committed before its acknowledgement was lost (a reset after
        the server stored it; a multipart completion retried into ``NoSuchUpload``).
        """
        try:
            head = self._head(name)
        except StorageError:
            head = None
        if head is not None and int(head["ContentLength"]) == size:
            return False
        raise self._fail("write", name, exc) from exc

    def _parts(self, views: list[memoryview]) -> Iterator[bytes]:
        """Yield ``part_size`` pieces of the concatenation of ``views``, one at a time."""
        buf = bytearray()
        for view in views:
            while len(view):
                take = min(self._part_size - len(buf), len(view))
                buf += view[:take]
                view = view[take:]
                if len(buf) == self._part_size:
                    yield bytes(buf)
                    buf.clear()
        if buf:
            yield bytes(buf)

    def _multipart(self, bucket: str, key: str, views: list[memoryview]) -> None:
        mpu = self._s3("create_multipart_upload", Bucket=bucket, Key=key)
        upload_id = mpu["UploadId"]
        try:
            parts = []
            for number, body in enumerate(self._parts(views), start=1):
                out = self._s3(
                    "upload_part",
                    len(body),
                    Bucket=bucket,
                    Key=key,
                    Body=body,
                    ChecksumCRC32=crc32(body),
                    PartNumber=number,
                    UploadId=upload_id,
                )
                parts.append({"PartNumber": number, "ETag": out["ETag"]})
            self._s3(
                "complete_multipart_upload",
                Bucket=bucket,
                Key=key,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
                IfNoneMatch="*",
            )
        except BaseException:
            try:
                self._s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
            except Exception:  # noqa: S110 - the original error matters more
                pass
            raise

    def partial_uploads(self) -> Sequence[tuple[str, str]]:
        """Multipart uploads under the root never completed or aborted (``ListMultipartUploads``).

        :meth:`_multipart` aborts its upload when it fails, but a writer killed mid-upload
        (SIGKILL, a lost node) leaves the parts on the server, billed and invisible to
        :meth:`list`, until an abort. Only keys a store writes (:func:`_own_object`) are listed:
        another store's root may lie below this one's (``s3://bucket`` and
        ``s3://bucket/team-b``), and its uploads are not this store's to abort.
        """
        bucket, _, base = self._root.partition("/")
        base = f"{base}/" if base else ""
        args: dict[str, Any] = {"Bucket": bucket, "Prefix": base}
        found: list[tuple[str, str]] = []
        try:
            while True:
                page = self._s3("list_multipart_uploads", **args)
                for up in page.get("Uploads", []):
                    key = str(up["Key"])
                    if key.startswith(base) and _own_object(key[len(base) :]):
                        found.append((key[len(base) :], str(up["UploadId"])))
                if not page.get("IsTruncated"):
                    break
                args["KeyMarker"] = page.get("NextKeyMarker")
                args["UploadIdMarker"] = page.get("NextUploadIdMarker")
        except Exception as exc:
            raise StorageError(
                f"cannot list the unfinished uploads of store {self.url}: {exc}"
            ) from exc
        return sorted(found)

    def discard_upload(self, name: str, upload_id: str) -> None:
        """Abort one multipart upload (its parts are deleted); an upload gone already is fine."""
        bucket, key = self._bucket_key(name)
        try:
            self._s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
        except Exception as exc:
            status, code = _http_error(exc)
            if status != 404 and code not in {"NoSuchUpload", "404"}:
                raise self._fail("abort the upload of", name, exc) from exc

    def get(self, name: str, offset: int = 0, length: int | None = None) -> bytes:
        check_range(offset, length)
        path = self._path(name)
        if length == 0:
            if self.size(name) < offset:
                raise truncated(name, self.url, offset, length, 0)
            return b""
        end = None if length is None else offset + length
        try:
            data = self._within(
                length if length is not None else self._threshold,
                self._fs.cat_file,
                path,
                start=offset,
                end=end,
            )
        except Exception as exc:
            if _is_not_found(exc):
                raise not_found(name, self.url) from exc
            if _is_invalid_range(exc):
                if length is None and self.size(name) == offset:
                    return b""
                raise truncated(name, self.url, offset, length, 0) from exc
            raise self._fail("read", name, exc) from exc
        if length is not None and len(data) != length:
            raise truncated(name, self.url, offset, length, len(data))
        return bytes(data)

    def _head(self, name: str) -> dict[str, Any] | None:
        bucket, key = self._bucket_key(name)
        try:
            return dict(self._s3("head_object", Bucket=bucket, Key=key))
        except Exception as exc:
            if _is_not_found(exc):
                return None
            raise self._fail("stat", name, exc) from exc

    def size(self, name: str) -> int:
        head = self._head(name)
        if head is None:
            raise not_found(name, self.url)
        return int(head["ContentLength"])

    def exists(self, name: str) -> bool:
        return self._head(name) is not None

    def delete(self, name: str) -> None:
        bucket, key = self._bucket_key(name)
        try:
            self._s3("delete_object", Bucket=bucket, Key=key)
        except Exception as exc:
            if not _is_not_found(exc):
                raise self._fail("delete", name, exc) from exc
        self._fs.invalidate_cache(self._path(name))

    def list(self, prefix: str = "") -> Iterator[str]:
        """Keys below the root from ``ListObjectsV2`` (not s3fs's ``find``).

        Only keys that are valid object names are listed: no directory markers (keys ending
        in ``/``) and never the root itself, which s3fs's ``find`` reports as a file on servers
        that keep an emptied directory (SeaweedFS).
        """
        validate_prefix(prefix)
        bucket, _, base = self._root.partition("/")
        base = f"{base}/" if base else ""
        args: dict[str, Any] = {"Bucket": bucket, "Prefix": base + prefix}
        names = []
        try:
            while True:
                page = self._s3("list_objects_v2", **args)
                for obj in page.get("Contents", []):
                    key = str(obj["Key"])
                    if key.startswith(base) and _is_name(key[len(base) :]):
                        names.append(key[len(base) :])
                if not page.get("IsTruncated"):
                    break
                args["ContinuationToken"] = page["NextContinuationToken"]
        except Exception as exc:
            if not _is_not_found(exc):
                raise StorageError(f"cannot list {prefix!r} in store {self.url}: {exc}") from exc
        yield from sorted(names)


def _own_object(name: str) -> bool:
    """Whether ``name`` (relative to a store's root) is an object a store writes: a pack
    (``packs/<2 hex>/<id>.pack``) or a blob (``<kind>/<2 hex>/<id>``, a manifest), not a key
    of another store whose root lies below (``team-b/packs/...``)."""
    from ckstore.objects.hashing import is_chunk_id
    from ckstore.objects.packs import pack_id_from_name

    if pack_id_from_name(name) is not None:
        return True
    parts = name.split("/")
    return (
        len(parts) == 3
        and parts[0] != "packs"
        and is_chunk_id(parts[2])
        and parts[1] == parts[2][:2]
        and _is_name(name)
    )


def _is_name(key: str) -> bool:
    try:
        validate_name(key)
    except InvalidInputError:
        return False
    return True
