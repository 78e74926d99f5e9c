"""A fault-injecting HTTP reverse proxy on loopback, in front of a test S3 server.

The proxy runs an asyncio server in a thread of its own, on 127.0.0.1 and a free port, and
forwards each HTTP/1.1 request to the upstream server on a fresh connection, unchanged
(headers included, so SigV4 signatures still verify). A seeded :class:`Schedule` chosen by the
test decides, request by request, whether to inject one fault:

``slowdown``
    answer ``503 SlowDown`` (S3's throttling error) without forwarding.
``reset``
    a connection reset mid-body: a request with a body goes upstream with only half of it and
    both connections are reset; otherwise the client connection is reset after half the
    response body (before the response, if it has no body).
``truncate``
    the response keeps its full ``Content-Length`` but the connection closes cleanly after half
    the body (only for responses with a body).
``latency``
    wait before forwarding (a delay drawn from the schedule's range).
``lost_ack``
    forward a write (PUT/POST) whole, so the server commits it, then reset the client
    connection instead of answering: the client's retry meets an existing object.
``flip`` (:data:`FLIP`, not in :data:`FAULTS`: a read of a server that returns no checksum
    cannot tell, so only the layers above, which check chunks against their ids, reject it)
    one bit flipped in transit, in the middle of the body: of a request with a body (a PUT
    or an upload part: the server receives other bytes than the client sent) or else of the
    response's body (a GET answered with other bytes than the server holds); a message without
    a body goes through untouched.
``hang`` (:data:`HANG`, not in :data:`FAULTS`: retries never get through it)
    a frozen endpoint: the request is read and never answered; the connection stays open
    until the client gives up on it.

The proxy answers ``Expect: 100-continue`` itself (and does not forward the header), or
botocore would wait for a ``100 Continue`` that a buffering proxy never relays. Every request is
recorded as an :class:`Event`.

Usage::

    with FaultProxy(upstream_url, Schedule(seed=1, faults=("reset",), rate=0.3)) as proxy:
        options = storage_options(proxy.url)
"""

from __future__ import annotations

import asyncio
import random
import socket
import struct
import threading
from dataclasses import dataclass, field
from urllib.parse import urlsplit

FAULTS = ("slowdown", "reset", "truncate", "latency", "lost_ack")
HANG = "hang"
FLIP = "flip"
WRITE_METHODS = frozenset({"PUT", "POST"})
_SLOWDOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)
_MAX_HEADER_BYTES = 64 << 10


@dataclass(frozen=True)
class Event:
    """One request seen by the proxy and what was done to it.

    Attributes:
        index: 0-based order of arrival.
        method: HTTP method.
        target: request target (path and query).
        range: the request's ``Range`` header, or None.
        fault: the fault injected, or None.
        upstream_status: the status the upstream server answered, or None if the request was
            not forwarded whole (slowdown, reset of a request body).
    """

    index: int
    method: str
    target: str
    range: str | None
    fault: str | None
    upstream_status: int | None

    @property
    def key(self) -> tuple[str, str, str | None]:
        """What identifies a logical request: its retries repeat the same key."""
        return self.method, self.target, self.range


def applies(fault: str, method: str) -> bool:
    """Whether ``fault`` can be injected into a request with ``method``."""
    return fault != "lost_ack" or method in WRITE_METHODS


@dataclass
class Schedule:
    """A seeded, reproducible choice of faults, one decision per request.

    Args:
        seed: seed of the schedule's own random generator.
        faults: the fault kinds to inject (from :data:`FAULTS`); one is drawn per faulted
            request among those that apply to it. Empty: no faults.
        rate: probability that an eligible request gets a fault (1.0: every one).
        methods: only requests with these methods are eligible (None: all).
        max_in_a_row: at most this many consecutive eligible requests get a fault, so that
            bounded retries can get through (None: no limit).
        latency_s: (min, max) seconds of added latency for the ``latency`` fault.
    """

    seed: int
    faults: tuple[str, ...] = ()
    rate: float = 0.3
    methods: frozenset[str] | None = None
    max_in_a_row: int | None = 2
    latency_s: tuple[float, float] = (0.02, 0.08)
    _rng: random.Random = field(init=False, repr=False)
    _run: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        unknown = set(self.faults) - set(FAULTS) - {HANG, FLIP}
        if unknown:
            raise ValueError(
                f"unknown faults {sorted(unknown)}; choose from {FAULTS}, {HANG} or {FLIP}"
            )
        self._rng = random.Random(self.seed)

    def decide(self, method: str) -> str | None:
        """The fault for the next request with ``method`` (None: forward it untouched)."""
        kinds = [f for f in self.faults if applies(f, method)]
        if not kinds or (self.methods is not None and method not in self.methods):
            return None
        draw, pick = self._rng.random(), self._rng.random()  # both drawn: reproducible
        if self.max_in_a_row is not None and self._run >= self.max_in_a_row:
            self._run = 0
            return None
        if draw < self.rate:
            self._run += 1
            return kinds[int(pick * len(kinds))]
        self._run = 0
        return None

    def latency(self) -> float:
        """A delay for the ``latency`` fault."""
        lo, hi = self.latency_s
        return lo + (hi - lo) * self._rng.random()


@dataclass
class _Message:
    """A parsed HTTP/1.1 message head and its (de-chunked) body."""

    start: str
    headers: list[tuple[str, str]]
    body: bytes = b""

    def header(self, name: str) -> str | None:
        lname = name.lower()
        for key, value in self.headers:
            if key.lower() == lname:
                return value
        return None

    def without(self, *names: str) -> list[tuple[str, str]]:
        drop = {n.lower() for n in names}
        return [(k, v) for k, v in self.headers if k.lower() not in drop]


async def _read_head(reader: asyncio.StreamReader) -> _Message | None:
    """Read a start line and headers; None at a clean EOF before any byte."""
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise
    if len(raw) > _MAX_HEADER_BYTES:
        raise ValueError("header block too large")
    lines = raw.decode("latin-1").split("\r\n")
    headers = []
    for line in lines[1:]:
        if line:
            key, _, value = line.partition(":")
            headers.append((key.strip(), value.strip()))
    return _Message(lines[0], headers)


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    body = bytearray()
    while True:
        size_line = await reader.readuntil(b"\r\n")
        size = int(size_line.split(b";")[0].strip(), 16)
        if size == 0:
            while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers
                pass
            return bytes(body)
        body += await reader.readexactly(size)
        await reader.readexactly(2)


async def _read_body(reader: asyncio.StreamReader, msg: _Message, *, to_eof: bool) -> bytes:
    if (msg.header("Transfer-Encoding") or "").lower() == "chunked":
        return await _read_chunked(reader)
    length = msg.header("Content-Length")
    if length is not None:
        return await reader.readexactly(int(length))
    return await reader.read() if to_eof else b""


def _encode(start: str, headers: list[tuple[str, str]]) -> bytes:
    lines = [start, *(f"{k}: {v}" for k, v in headers), "", ""]
    return "\r\n".join(lines).encode("latin-1")


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST (SO_LINGER 0) rather than a FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()


def _flipped(body: bytes) -> bytes:
    """``body`` with the lowest bit of its middle byte flipped."""
    out = bytearray(body)
    out[len(out) // 2] ^= 1
    return bytes(out)


def _has_response_body(method: str, status: int) -> bool:
    return method != "HEAD" and status >= 200 and status not in (204, 304)


class FaultProxy:
    """The proxy. Start it with ``with`` (or :meth:`start`/:meth:`stop`).

    Args:
        upstream_url: ``http://127.0.0.1:PORT`` of the real server (loopback only).
        schedule: the fault schedule (none by default); :meth:`reset` changes it.
    """

    def __init__(self, upstream_url: str, schedule: Schedule | None = None) -> None:
        parts = urlsplit(upstream_url)
        if parts.hostname not in ("127.0.0.1", "localhost") or parts.port is None:
            raise ValueError(f"upstream must be a loopback http URL with a port: {upstream_url}")
        self._upstream = ("127.0.0.1", parts.port)
        self.schedule = schedule or Schedule(seed=0)
        self.events: list[Event] = []
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._clients: set[asyncio.StreamWriter] = set()
        self.url = ""

    def start(self) -> FaultProxy:
        """Listen on 127.0.0.1 and a free port; :attr:`url` is then set."""
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(self._listen(), self._loop)
        self._server = future.result(timeout=10)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def _listen(self) -> asyncio.Server:
        return await asyncio.start_server(self._serve, "127.0.0.1", 0)

    def stop(self) -> None:
        """Stop listening, drop open connections and end the thread."""

        async def close() -> None:
            if self._server is not None:
                self._server.close()
            for writer in list(self._clients):
                writer.transport.abort()  # their tasks end on the connection error
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            if tasks:
                await asyncio.wait(tasks, timeout=5)

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def reset(self, schedule: Schedule) -> None:
        """Follow ``schedule`` from now on, with an empty log."""
        with self._lock:
            self.schedule = schedule
            self.events = []

    def faults(self) -> list[Event]:
        """The events that had a fault injected."""
        with self._lock:
            return [e for e in self.events if e.fault is not None]

    def _record(self, request: _Message, fault: str | None, status: int | None) -> None:
        method, target = request.start.split(" ")[:2]
        with self._lock:
            n = len(self.events)
            self.events.append(Event(n, method, target, request.header("Range"), fault, status))

    def _decide(self, method: str) -> tuple[str | None, float]:
        """The fault for this request, and the delay to add for ``latency``."""
        with self._lock:
            fault = self.schedule.decide(method)
            return fault, self.schedule.latency() if fault == "latency" else 0.0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._clients.add(writer)
        try:
            while await self._one_request(reader, writer):
                pass
        except (
            ConnectionError,
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
            ValueError,
        ):
            pass
        finally:
            self._clients.discard(writer)
            if not writer.transport.is_closing():
                writer.close()

    async def _one_request(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """Handle one request; False when the client connection is finished."""
        request = await _read_head(reader)
        if request is None:
            return False
        method = request.start.split(" ")[0]
        if (request.header("Expect") or "").lower() == "100-continue":
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await writer.drain()
        request.body = await _read_body(reader, request, to_eof=False)
        fault, delay = self._decide(method)
        if delay:
            await asyncio.sleep(delay)
        if fault == "slowdown":
            self._record(request, fault, None)
            await self._answer_slowdown(writer, with_body=method != "HEAD")
            return True
        if fault == HANG:
            self._record(request, fault, None)
            await reader.read()  # never answered: until the client closes (or the proxy stops)
            return False
        if fault == "reset" and request.body:
            await self._forward_half(request)
            self._record(request, fault, None)
            _reset(writer)
            return False
        flip_request = fault == FLIP and bool(request.body)
        if flip_request:
            request.body = _flipped(request.body)
        response = await self._forward(request)
        status = int(response.start.split(" ")[1])
        with_body = _has_response_body(method, status) and bool(response.body)
        if fault == "truncate" and not with_body:
            fault = None  # nothing to cut short
        if fault == FLIP and not flip_request:
            if with_body:
                response.body = _flipped(response.body)
            else:
                fault = None  # no body either way: nothing to flip
        self._record(request, fault, status)
        if fault == "lost_ack" or (fault == "reset" and not with_body):
            _reset(writer)
            return False
        headers = response.without("Transfer-Encoding", "Connection", "Content-Length")
        if _has_response_body(method, status):
            headers.append(("Content-Length", str(len(response.body))))
        else:
            length = response.header("Content-Length")
            if length is not None:
                headers.append(("Content-Length", length))
        writer.write(_encode(response.start, headers))
        if fault in ("reset", "truncate"):
            writer.write(response.body[: len(response.body) // 2])
            await writer.drain()
            if fault == "reset":
                _reset(writer)
            else:
                writer.close()
            return False
        if _has_response_body(method, status):
            writer.write(response.body)
        await writer.drain()
        return True

    async def _answer_slowdown(self, writer: asyncio.StreamWriter, with_body: bool) -> None:
        headers = [
            ("Content-Type", "application/xml"),
            ("Content-Length", str(len(_SLOWDOWN_BODY))),
        ]
        body = _SLOWDOWN_BODY if with_body else b""  # a HEAD answer has no body
        writer.write(_encode("HTTP/1.1 503 Slow Down", headers) + body)
        await writer.drain()

    def _upstream_head(self, request: _Message) -> bytes:
        headers = request.without("Expect", "Connection", "Transfer-Encoding", "Content-Length")
        if request.body or request.header("Content-Length") is not None:
            headers.append(("Content-Length", str(len(request.body))))
        headers.append(("Connection", "close"))
        return _encode(request.start, headers)

    async def _forward(self, request: _Message) -> _Message:
        """Send ``request`` upstream whole and read the whole response."""
        reader, writer = await asyncio.open_connection(*self._upstream)
        try:
            writer.write(self._upstream_head(request) + request.body)
            await writer.drain()
            while True:
                response = await _read_head(reader)
                if response is None:
                    raise ConnectionError("upstream closed without answering")
                if not response.start.split(" ")[1].startswith("1"):
                    break  # skip interim 1xx answers
            method = request.start.split(" ")[0]
            status = int(response.start.split(" ")[1])
            if _has_response_body(method, status):
                response.body = await _read_body(reader, response, to_eof=True)
            return response
        finally:
            writer.close()

    async def _forward_half(self, request: _Message) -> None:
        """Send ``request`` upstream with half its body, then reset that connection."""
        _, writer = await asyncio.open_connection(*self._upstream)
        writer.write(self._upstream_head(request) + request.body[: len(request.body) // 2])
        await writer.drain()
        await asyncio.sleep(0.01)
        _reset(writer)
