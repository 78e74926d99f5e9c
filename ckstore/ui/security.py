"""Who may talk to the page's server, and who may change the store through it.

- **Host check** (every request): the ``Host`` header must name a loopback address
  (``127.0.0.1``, ``localhost``, ``[::1]``) or the host the server was explicitly bound to.
  A DNS-rebinding page (``evil.example`` resolving to 127.0.0.1) sends its own name and is
  refused, so it can neither read the store nor try the token.
- **Origin check** (requests that change something): a browser's ``Origin`` must be this
  server's own origin, exactly: ``http``, the host and the port the request is addressed to
  (its ``Host``). Another local server (any other loopback port) is another origin and is
  refused; non-browser clients send no ``Origin``.
- **Token** (requests that change something): the ``X-Ckstore-Token`` header must equal the
  server's token (compared in constant time). A header is not sent cross-site without a CORS
  preflight, which this server never grants, and a cookie is never trusted on its own, so a
  page elsewhere cannot make the browser act (CSRF). Changes are POST with a JSON body.
- **Response headers**: a Content-Security-Policy allowing only this origin's scripts and
  styles, no framing, no referrer (the token may be in the address bar), no MIME sniffing.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
from collections.abc import Iterable
from urllib.parse import urlsplit

TOKEN_ENV = "CKSTORE_UI_TOKEN"
TOKEN_HEADER = "x-ckstore-token"
LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})

SECURITY_HEADERS = {
    "content-security-policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
}


def new_token(given: str | None = None) -> str:
    """The token: ``given``, else ``$CKSTORE_UI_TOKEN``, else 32 random URL-safe characters."""
    token = given or os.environ.get(TOKEN_ENV) or secrets.token_urlsafe(24)
    return token


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and any address in 127.0.0.0/8 or ``::1``."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The host of a ``Host`` header value, without port or IPv6 brackets, lowercase."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else ""
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def _origin(url: str) -> tuple[str, int] | None:
    """(host, port) of an ``http`` origin (``scheme://host[:port]``, nothing after), else None."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port or 80
    except ValueError:
        return None
    if parts.scheme != "http" or not parts.hostname or parts.path or parts.query:
        return None
    if parts.fragment or parts.username is not None:
        return None
    return parts.hostname.lower(), port


class Guard:
    """The checks of this module for one server: its token and the host names it answers."""

    def __init__(self, token: str, extra_hosts: Iterable[str] = ()) -> None:
        if not token:
            raise ValueError("the UI token must not be empty")
        self.token = token
        self.hosts = set(LOOPBACK_NAMES) | {h.lower().strip("[]") for h in extra_hosts}

    def host_ok(self, header: str | None) -> bool:
        """A request's ``Host`` names this server (loopback or its explicit host)."""
        if not header:
            return False
        name = host_name(header)
        return name in self.hosts or is_loopback(name)

    def origin_ok(self, origin: str | None, host: str | None) -> bool:
        """No ``Origin`` (not a browser), or exactly the origin of the page this server serves
        at ``host`` (the request's ``Host``, itself allowed): http, same host, same port."""
        if origin is None:
            return True
        if not host or not self.host_ok(host):
            return False
        own = _origin(f"http://{host.strip()}")
        return own is not None and _origin(origin) == own

    def token_ok(self, given: str | None) -> bool:
        """The request carries the token (constant-time comparison)."""
        return given is not None and hmac.compare_digest(given.encode(), self.token.encode())
