"""Serving the page: bind (loopback unless told), print the URL with its token, run uvicorn.

Like Jupyter, the URL printed on the terminal carries the token (``?token=...``); the page
keeps it for the session and takes it out of the address bar. Binding to an address other
than loopback needs ``host`` given explicitly and prints a warning: anyone who can reach that
address can read the store (the token still guards every change).
"""

from __future__ import annotations

import errno
import socket
import sys
import threading
import webbrowser
from collections.abc import Callable
from typing import TextIO
from urllib.parse import quote

import uvicorn

from ..errors import InvalidInputError
from ..store import Store
from .app import make_app
from .security import is_loopback

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8765


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (``port`` 0: any free port).

    Raises:
        InvalidInputError: the port is taken or the address cannot be bound (the message
            says to try ``--port 0``).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as exc:
        sock.close()
        why = "is in use" if exc.errno == errno.EADDRINUSE else f"cannot be bound ({exc.strerror})"
        raise InvalidInputError(f"{host}:{port} {why}; pass --port 0 for any free port") from None
    sock.listen(128)
    sock.setblocking(False)
    return sock


def url_of(sock: socket.socket, host: str, token: str) -> str:
    """The page's address with the token, as printed on the terminal."""
    port = sock.getsockname()[1]
    shown = f"[{host.strip('[]')}]" if ":" in host else host
    return f"http://{shown}:{port}/?token={quote(token)}"


def warm_numeric_diff() -> None:
    """Import the numeric diff (and torch, about 3 s) in the background, so the first
    comparison of two snapshots does not pay for it. Reading history never imports torch."""

    def load() -> None:
        try:
            import ckstore.history.diff_numeric  # noqa: F401
        except Exception:  # noqa: BLE001, S110 - the diff imports it again and reports then
            pass

    threading.Thread(target=load, name="ckstore-ui-warm", daemon=True).start()


def serve(
    opener: Callable[[], Store],
    token: str,
    *,
    label: str,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    explicit_host: bool = False,
    open_browser: bool = True,
    out: TextIO = sys.stdout,
) -> None:
    """Serve the page for one store until interrupted.

    Raises:
        InvalidInputError: ``host`` is not loopback and was not given explicitly, or the
            address cannot be bound.
    """
    if not is_loopback(host.strip("[]")) and not explicit_host:
        raise InvalidInputError(f"refusing to serve on {host}: pass --host {host} explicitly")
    sock = bind(host, port)
    extra = () if is_loopback(host.strip("[]")) else (host,)
    app = make_app(opener, token, label=label, extra_hosts=extra)
    url = url_of(sock, host, token)
    if extra:
        print(
            f"warning: serving on {host}, not loopback: anyone who can reach it can read this "
            "store (changes still need the token)",
            file=out,
        )
    print(f"ckstore ui for {label}\n  open {url}\n  (Ctrl-C to stop)", file=out, flush=True)
    warm_numeric_diff()
    if open_browser:
        webbrowser.open(url)
    config = uvicorn.Config(
        app, log_level="warning", access_log=False, server_header=False, lifespan="on"
    )
    uvicorn.Server(config).run(sockets=[sock])
