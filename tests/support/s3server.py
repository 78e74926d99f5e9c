"""A throwaway S3 server (moto) on loopback for tests.

Usage::

    server = S3Server.start()          # listens on 127.0.0.1, a free port
    server.create_bucket("b")
    opts = server.storage_options()    # for s3fs / open_backend(..., storage_options=opts)
    server.reset()                     # wipe every bucket
    server.stop()

If moto cannot start, :func:`start_or_skip` skips the test, unless the environment variable
``CI`` is set, in which case it fails.
"""

from __future__ import annotations

import json
import os
import urllib.request
from collections.abc import Callable
from typing import Any, TypeVar

DUMMY_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def set_dummy_credentials() -> None:
    """Put dummy AWS credentials in the environment (never real ones; moto ignores them)."""
    for key, value in DUMMY_CREDENTIALS.items():
        os.environ.setdefault(key, value)


def storage_options(endpoint_url: str) -> dict[str, Any]:
    """s3fs options for a loopback S3 server at ``endpoint_url``.

    No ``region_name`` in ``client_kwargs`` (bucket creation fails with it); a fresh s3fs
    instance per call (``skip_instance_cache``) so tests never share cached state.
    """
    return {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint_url},
        "config_kwargs": {"retries": {"max_attempts": 10, "mode": "standard"}},
        "skip_instance_cache": True,
        "use_listings_cache": False,
    }


def remote_options(endpoint_url: str) -> dict[str, Any]:
    """:func:`storage_options` without the credentials, as a remote keeps them (credentials
    come from the environment: :func:`set_dummy_credentials`)."""
    return {k: v for k, v in storage_options(endpoint_url).items() if k not in ("key", "secret")}


class S3Server:
    """A moto S3 server running in a thread of this process, bound to 127.0.0.1 only."""

    def __init__(self, server: Any, endpoint_url: str) -> None:
        self._server = server
        self.endpoint_url = endpoint_url

    @classmethod
    def start(cls) -> S3Server:
        """Start moto on 127.0.0.1 and a free port."""
        from moto.server import ThreadedMotoServer

        set_dummy_credentials()
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        return cls(server, f"http://{host}:{port}")

    def storage_options(self) -> dict[str, Any]:
        """s3fs options pointing at this server."""
        return storage_options(self.endpoint_url)

    def remote_options(self) -> dict[str, Any]:
        """s3fs options pointing at this server, without credentials (for a remote)."""
        return remote_options(self.endpoint_url)

    def _request(self, method: str, path: str, body: bytes | None = None) -> bytes:
        req = urllib.request.Request(self.endpoint_url + path, data=body, method=method)
        with urllib.request.urlopen(req, timeout=30) as resp:  # noqa: S310 - loopback only
            return bytes(resp.read())

    def create_bucket(self, bucket: str) -> None:
        """Create ``bucket`` (us-east-1 style, no location constraint)."""
        self._request("PUT", f"/{bucket}")

    def reset(self) -> None:
        """Wipe every bucket and object (``POST /moto-api/reset``)."""
        self._request("POST", "/moto-api/reset", json.dumps({}).encode())

    def stop(self) -> None:
        """Stop the server."""
        self._server.stop()


T = TypeVar("T")


def start_server_or_skip(what: str, start: Callable[[], T]) -> T:
    """``start()`` a server; skip the calling test if it cannot start (its binary or package
    missing, no port to bind), or fail it if ``CI`` is set: CI must run every suite."""
    import pytest

    try:
        return start()
    except Exception as exc:
        if os.environ.get("CI"):
            pytest.fail(f"cannot start the {what} and CI is set: {exc!r}")
        pytest.skip(f"cannot start the {what}: {exc!r}")


def start_or_skip() -> S3Server:
    """Start a moto server (see :func:`start_server_or_skip`)."""
    return start_server_or_skip("moto S3 server", S3Server.start)
