"""ASGI middleware: refuse requests for other host names, add the security headers.

Pure ASGI (no request body buffering): it looks at the ``Host`` header before the app runs and
adds :data:`security.SECURITY_HEADERS` to every response's start message.
"""

from __future__ import annotations

from typing import Any

from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import refused
from .security import SECURITY_HEADERS, Guard

_EXTRA = [(k.encode(), v.encode()) for k, v in SECURITY_HEADERS.items()]


class HostGuard:
    """Refuses (403) any HTTP request whose ``Host`` is not one the guard allows."""

    def __init__(self, app: ASGIApp, guard: Guard) -> None:
        self.app = app
        self.guard = guard

    @classmethod
    def middleware(cls, guard: Guard) -> Middleware:
        """This middleware, configured, for ``Starlette(middleware=[...])``."""
        return Middleware(cls, guard=guard)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        host = _header(scope, b"host")
        if not self.guard.host_ok(host):
            response = refused(
                403, "refused: this server answers only requests addressed to its own host"
            )
            await response(scope, receive, _with_headers(send))
            return
        await self.app(scope, receive, _with_headers(send))


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key == name:
            return bytes(value).decode("latin-1")
    return None


def _with_headers(send: Send) -> Send:
    async def sender(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers: list[Any] = list(message.get("headers", []))
            present = {bytes(k).lower() for k, _ in headers}
            headers.extend((k, v) for k, v in _EXTRA if k not in present)
            message = {**message, "headers": headers}
        await send(message)

    return sender
