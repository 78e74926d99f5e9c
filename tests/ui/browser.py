"""Test harness of the page: the app served in-process on 127.0.0.1, and Debian's chromium
driven by Playwright (its own browser download cannot work here, so ``executable_path``).

``start_or_skip`` (as for the S3 and PostgreSQL servers) skips a test whose browser cannot
start, or fails it when ``CI`` is set: CI must run the browser tests.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import uvicorn

import ckstore
from ckstore.ui import make_app

CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip


def chromium_path() -> str:
    """Debian's chromium, or ``$CKSTORE_CHROMIUM``."""
    path = os.environ.get("CKSTORE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if not os.path.exists(path):
        raise FileNotFoundError(f"no chromium at {path} (make test installs Debian's chromium)")
    return path


@dataclass
class Served:
    """An app served by uvicorn in a thread of this process."""

    server: uvicorn.Server
    thread: threading.Thread
    port: int
    token: str

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def serve(
    store_url: str, token: str = "test-token", workdir: str | None = None, **open_kw: Any
) -> Served:
    """Serve the UI of the store at ``store_url`` on 127.0.0.1, a free port (the header names
    the store relative to ``workdir``, as ``ckstore ui`` started there would)."""
    app = make_app(
        lambda: ckstore.open(store_url, create=False, **open_kw),
        token,
        label=store_url,
        workdir=workdir,
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the UI server did not start")
        time.sleep(0.02)
    return Served(server, thread, sock.getsockname()[1], token)


class Browser:
    """One headless chromium with a fresh profile; ``page()`` opens a tab."""

    def __init__(self) -> None:
        from playwright.sync_api import sync_playwright

        self._profile = tempfile.mkdtemp(prefix="ckstore-chromium-")
        self._pw = sync_playwright().start()
        try:
            self.context = self._pw.chromium.launch_persistent_context(
                self._profile,
                executable_path=chromium_path(),
                headless=True,
                args=CHROMIUM_ARGS,
                viewport={"width": 1400, "height": 900},
            )
        except BaseException:
            self._pw.stop()
            raise
        self.context.set_default_timeout(20_000)

    def page(self) -> Any:
        page = self.context.new_page()
        page.errors = []  # uncaught errors of the page's scripts
        page.on("pageerror", lambda exc: page.errors.append(str(exc)))
        return page

    def close(self) -> None:
        self.context.close()
        self._pw.stop()
        shutil.rmtree(self._profile, ignore_errors=True)


def start_or_skip(what: str, start: Callable[[], Any]) -> Any:
    """``start()``; skip the test if it fails, or fail it when ``CI`` is set."""
    import pytest

    try:
        return start()
    except Exception as exc:
        if os.environ.get("CI"):
            pytest.fail(f"cannot start the {what} and CI is set: {exc!r}")
        pytest.skip(f"cannot start the {what}: {exc!r}")
