"""A throwaway PostgreSQL server for tests, on 127.0.0.1 only.

``initdb --auth=trust --no-sync`` into a temporary directory, ``pg_ctl -w start`` on a free
loopback port with ``fsync=off``; stopped with ``pg_ctl stop -m immediate`` and removed at the end.
PostgreSQL refuses to run as root, so as root the server runs as the ``postgres`` user.
Each test gets a fresh database (``CREATE DATABASE`` is fast).
"""

from __future__ import annotations

import glob
import itertools
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class PgServerError(Exception):
    """The server could not be started."""


def _bin_dir() -> Path:
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    preferred = [c for c in candidates if "/15/" in c] + candidates
    for candidate in preferred:
        if os.path.exists(os.path.join(candidate, "pg_ctl")):
            return Path(candidate)
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).parent
    raise PgServerError("PostgreSQL server binaries (pg_ctl, initdb) not found")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PgServer:
    """A running throwaway server; :meth:`new_database` returns a fresh database's URL."""

    def __init__(self, bin_dir: Path, root: Path, port: int, as_user: list[str]) -> None:
        self.bin_dir, self.root, self.port, self._as_user = bin_dir, root, port, as_user
        self._counter = itertools.count()

    def _run(self, *args: str) -> None:
        cmd = [*self._as_user, str(self.bin_dir / args[0]), *args[1:]]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            detail = proc.stderr.strip() or proc.stdout.strip()
            raise PgServerError(f"{' '.join(args[:2])} failed: {detail}")

    def start(self) -> None:
        data = self.root / "data"
        self._run(
            "initdb", "-D", str(data), "--auth=trust", "--no-sync", "-U", "postgres", "-E", "UTF8"
        )
        options = (
            f"-c listen_addresses=127.0.0.1 -p {self.port} -c fsync=off "
            f"-c synchronous_commit=off -c full_page_writes=off "
            f"-c unix_socket_directories={self.root} -c max_connections=200"
        )
        self._run(
            "pg_ctl",
            "-D",
            str(data),
            "-w",
            "-t",
            "30",
            "-l",
            str(self.root / "log"),
            "-o",
            options,
            "start",
        )

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.root / "data"), "-m", "immediate", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def url(self, database: str) -> str:
        """SQLAlchemy URL of a database on this server."""
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def new_database(self, prefix: str = "t") -> str:
        """Creates an empty database and returns its URL."""
        import psycopg

        name = f"{prefix}_{os.getpid()}_{next(self._counter)}"
        dsn = f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres"
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)


@contextmanager
def pg_server() -> Iterator[PgServer]:
    """Starts a server, yields it, stops and removes it.

    Raises:
        PgServerError: If the server cannot start (binaries missing, initdb or start failed).
    """
    bin_dir = _bin_dir()
    root = Path(tempfile.mkdtemp(prefix="ckstore-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:
        runuser = shutil.which("runuser")
        if runuser is None:
            raise PgServerError("running as root but runuser is missing")
        try:
            shutil.chown(root, user="postgres", group="postgres")
        except (LookupError, OSError) as exc:
            shutil.rmtree(root, ignore_errors=True)
            raise PgServerError(f"cannot hand the data dir to user postgres: {exc}") from exc
        as_user = [runuser, "-u", "postgres", "--"]
    last: Exception | None = None
    for _ in range(3):  # a free port can be taken between probing and binding
        server = PgServer(bin_dir, root, _free_port(), as_user)
        try:
            server.start()
        except (PgServerError, subprocess.TimeoutExpired) as exc:
            last = exc
            for child in ("data", "log"):
                path = root / child
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(
                    missing_ok=True
                )
            continue
        try:
            yield server
        finally:
            server.stop()
        return
    shutil.rmtree(root, ignore_errors=True)
    raise PgServerError(f"PostgreSQL did not start: {last}")
