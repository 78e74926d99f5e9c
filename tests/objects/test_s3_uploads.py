"""Multipart uploads a writer never finished: listed, aborted by gc once no writer is alive.

:meth:`S3Backend.put` aborts its own upload when it fails, but a writer killed between
``CreateMultipartUpload`` and ``CompleteMultipartUpload`` leaves its parts on the server,
billed and invisible to ``list``. ``gc`` now aborts them with the orphan objects, under the
same rule: only when no write session is alive.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

import ckstore
from ckstore.objects import Backend, S3Backend

pytestmark = pytest.mark.s3


def _dead_writer(backend: S3Backend, name: str) -> str:
    """Begin a multipart upload of ``name`` and upload one part, as a killed writer would."""
    bucket, _, root = backend.url[len("s3://") :].partition("/")
    key = f"{root}/{name}" if root else name
    upload = backend.fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
    backend.fs.call_s3(
        "upload_part", Bucket=bucket, Key=key, Body=b"x" * (5 << 20), PartNumber=1, UploadId=upload
    )
    return str(upload)


def test_partial_uploads_are_listed_and_discarded(s3_backend: Backend) -> None:
    assert isinstance(s3_backend, S3Backend)
    assert s3_backend.partial_uploads() == []
    name = "packs/ab/" + "ab" * 32 + ".pack"
    upload = _dead_writer(s3_backend, name)
    assert s3_backend.partial_uploads() == [(name, upload)]
    assert list(s3_backend.list()) == []  # invisible to a listing of objects
    s3_backend.discard_upload(name, upload)
    assert s3_backend.partial_uploads() == []
    s3_backend.discard_upload(name, upload)  # idempotent


def test_gc_aborts_unfinished_uploads_once_no_writer_is_alive(
    s3_server: Any, tmp_path: Path
) -> None:
    bucket = f"up-{uuid.uuid4().hex[:12]}"
    s3_server.create_bucket(bucket)
    with ckstore.open(
        f"s3://{bucket}/ckpts",
        create=True,
        index=f"sqlite:///{tmp_path / 'i.db'}",
        storage_options=s3_server.storage_options(),
    ) as store:
        backend = store.repository.objects.backend
        assert isinstance(backend, S3Backend)
        name = "packs/cd/" + "cd" * 32 + ".pack"
        _dead_writer(backend, name)
        live = store.repository.index.begin_session("a take still running", 600)
        assert store.gc().uploads_aborted == 0  # it may be that take's upload: kept
        assert len(backend.partial_uploads()) == 1
        store.repository.index.end_session(live.id, "aborted")
        assert store.gc(dry_run=True).uploads_aborted == 1  # predicted...
        assert len(backend.partial_uploads()) == 1  # ...and a dry run changes nothing
        assert store.gc().uploads_aborted == 1
        assert backend.partial_uploads() == []


@pytest.mark.parametrize(("upper", "sibling"), [("", False), ("ckpts", False), ("a", True)])
def test_gc_of_one_store_leaves_the_uploads_of_a_store_below_its_root_alone(
    s3_server: Any, tmp_path: Path, upper: str, sibling: bool
) -> None:
    """Store A at the bucket's root (or a parent prefix) and store B below it, each with its own
    index: A's routine gc, with no session of its own alive, aborted B's multipart upload in
    flight (a key ``team-b/packs/...`` passed for one of A's), and B's take failed. A sibling
    (``s3://bucket/a`` beside ``s3://bucket/ab``) was never affected."""
    bucket = f"sh-{uuid.uuid4().hex[:12]}"
    s3_server.create_bucket(bucket)
    opts = s3_server.storage_options()
    top = f"s3://{bucket}/{upper}".rstrip("/")
    lower = f"{top}b" if sibling else f"{top}/team-b"
    with (
        ckstore.open(
            top, create=True, index=f"sqlite:///{tmp_path / 'a.db'}", storage_options=opts
        ) as a,
        ckstore.open(
            lower, create=True, index=f"sqlite:///{tmp_path / 'b.db'}", storage_options=opts
        ) as b,
    ):
        backend = b.repository.objects.backend
        assert isinstance(backend, S3Backend)
        backend._threshold = 1024  # every pack of B's take goes up in parts
        real = backend._s3
        swept: list[Any] = []

        def s3(method: str, *args: Any, **kwargs: Any) -> Any:
            if method == "complete_multipart_upload" and not swept:
                swept.append(a.gc(grace_seconds=0))  # A's gc, while B uploads its first pack
            return real(method, *args, **kwargs)

        backend._s3 = s3  # type: ignore[method-assign]
        state = ckstore.StateDict(w=torch.arange(4096, dtype=torch.float32))
        snap = b.take({"m": state}, run="b", step=1)
        assert swept and swept[0].uploads_aborted == 0
        assert torch.equal(snap.read_object("m/w"), state["w"])
        a.take({"m": ckstore.StateDict(v=torch.ones(4096))}, run="a", step=1)
        a.delete_run("a")
        a.gc(grace_seconds=0)  # A's own objects go; B's stay
        assert b.check(read_data=True).ok
        assert torch.equal(b.get("b@1").read_object("m/w"), state["w"])
