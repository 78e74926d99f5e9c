"""A lost acknowledgement whose retry meets a partial object (RELIABILITY I1, S3).

The first ``PutObject`` of a pack reaches a server that stores only part of its body, and the
answer is lost; botocore's own retry, below ``S3Backend.put``, sends the body again and the
server answers 412: the name is taken. Before, the 412 only asked whether *an* object held
the name: the partial pack was taken as written, recorded, and the take committed a snapshot
that could not be restored. Simulated below the backend: the wrapper makes the partial put
(cut body, its CRC32 recomputed so the server stores it), then the full one, whose 412 it
raises, as botocore would after its retry.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

import ckstore
from ckstore.objects import s3 as s3_mod

pytestmark = pytest.mark.s3

KNOBS = {"chunk_bytes": 1024, "pack_bytes": 8192, "inline_bytes": 64}


def test_a_partial_object_met_by_a_retried_put_refuses_the_take(
    tmp_path: Path, s3_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket = f"ck-ack-{uuid.uuid4().hex[:8]}"
    s3_server.create_bucket(bucket)
    real = s3_mod.S3Backend._s3
    hit = {"n": 0}

    def _s3(self: Any, method: str, nbytes: int = 0, **kw: Any) -> Any:
        if method == "put_object" and "/packs/" in str(kw.get("Key", "")) and hit["n"] == 0:
            hit["n"] += 1
            part = kw["Body"][: len(kw["Body"]) // 2]  # what the server stored...
            cut = {**kw, "Body": part, "ChecksumCRC32": s3_mod.crc32(part)}
            real(self, method, len(part), **cut)
            return real(self, method, nbytes, **kw)  # ...and the retry's answer: 412
        return real(self, method, nbytes, **kw)

    monkeypatch.setattr(s3_mod.S3Backend, "_s3", _s3)
    state = {"w": torch.randn(64, 64, generator=torch.Generator().manual_seed(1))}
    with ckstore.open(
        f"s3://{bucket}/ckpts",
        index=f"sqlite:///{tmp_path / 'index.sqlite'}",
        storage_options=s3_server.storage_options(),
        create=True,
        auto_compact=False,
        **KNOBS,
    ) as store:
        with pytest.raises(ckstore.errors.StorageError, match="stored in part"):
            store.take({"m": ckstore.StateDict(dict(state))}, run="r", step=1)
        assert hit["n"] == 1 and store.log() == []
        monkeypatch.undo()
        snap = store.take({"m": ckstore.StateDict(dict(state))}, run="r", step=1)  # again
        assert torch.equal(snap.read_object("m/w"), state["w"])
        assert store.check(read_data=True).ok


def test_two_creators_of_one_s3_store_both_open_the_first_ones_config(
    tmp_path: Path, s3_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second creator found no config, then met the first's at its put (412, another
    size): a partial object for any other name, here whoever created the store first wins."""
    bucket = f"ck-two-{uuid.uuid4().hex[:8]}"
    s3_server.create_bucket(bucket)
    url, opts = f"s3://{bucket}/ckpts", s3_server.storage_options()
    index = f"sqlite:///{tmp_path / 'index.sqlite'}"
    ckstore.open(url, index=index, storage_options=opts, create=True, chunk_bytes=1024).close()
    real, missed = s3_mod.S3Backend.get, []

    def get(self: Any, name: str, *a: Any, **k: Any) -> Any:
        if name == "ckstore.json" and not missed:  # read before the first creator's put
            missed.append(name)
            raise ckstore.errors.ObjectNotFoundError(f"no object {name!r}")
        return real(self, name, *a, **k)

    monkeypatch.setattr(s3_mod.S3Backend, "get", get)
    with ckstore.open(
        url, index=index, storage_options=opts, create=True, chunk_bytes=4 << 20
    ) as second:
        assert missed and second.config.chunk_bytes == 1024
