"""Fault scenarios on the wire: the object layer (and one store) through :mod:`tests.support.faultproxy`.

Each scenario puts and reads content-named objects (real packs, and one multipart object)
through an :class:`S3Backend` whose endpoint is the fault proxy, then audits the server
directly, past the proxy, and returns a :class:`FaultRow` of figures. The tests in
``tests/objects/test_s3_faults.py`` assert on the rows; run this file to print the table::

    python -m tests.support.fault_report [seaweedfs] [moto]     # default: both, on loopback

Figures: ``ops`` logical backend calls; ``attempts`` HTTP requests the proxy saw; ``faults``
injected; ``retries`` = attempts minus distinct requests (a retry repeats method, target and
range); ``max_try`` the most attempts one distinct request took; ``committed`` objects whole
on the server out of ``expected``; ``partial`` objects on the server that are not exactly what
was written; ``wrong`` reads that returned other bytes than were written; ``typed``/``raw``
errors raised (ckstore errors / anything else).
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ckstore.errors import CkstoreError, CorruptionError
from ckstore.objects import (
    Backend,
    ObjectStore,
    S3Backend,
    WrappingBackend,
    chunk_id,
    open_backend,
    pack_id_from_name,
    verify_pack,
)
from ckstore.objects.backend import PutData, as_buffers
from tests.support.faultproxy import FAULTS, FaultProxy, Schedule
from tests.support.s3server import storage_options

RECOVER_MAX_ATTEMPTS = 3
"""botocore ``max_attempts`` while faults come at a rate that retries can get through."""
RECOVER_S3FS_RETRIES = 3
EXHAUST_MAX_ATTEMPTS = 1
"""botocore ``max_attempts`` when every request fails: retries run out quickly."""
EXHAUST_S3FS_RETRIES = 2
EXHAUSTIBLE = tuple(f for f in FAULTS if f != "latency")
"""Faults that make every request fail when injected into all of them."""
PART = 5 << 20
"""Multipart threshold and part size of the scenario backends (S3's minimum part)."""


BACKOFF_SCALE = 0.05
"""Factor on botocore's retry backoff, in these scenarios only.

botocore waits a random 0-1 s, 0-2 s, 0-4 s... before each retry; the scenarios test that
retries are bounded and correct, not how long they wait, so :func:`fast_retry_backoff` scales
those waits down (the number of attempts is unchanged)."""


@contextmanager
def fast_retry_backoff() -> Iterator[None]:
    """Scale botocore's standard-mode retry backoff by :data:`BACKOFF_SCALE` meanwhile."""
    from botocore.retries.standard import ExponentialBackoff

    original = ExponentialBackoff.delay_amount

    def scaled(self: Any, context: Any) -> float:
        return float(original(self, context)) * BACKOFF_SCALE

    ExponentialBackoff.delay_amount = scaled  # type: ignore[method-assign]
    try:
        yield
    finally:
        ExponentialBackoff.delay_amount = original  # type: ignore[method-assign]


def attempt_bound(max_attempts: int, s3fs_retries: int) -> int:
    """Most times one request (same method, target and range) may be sent by one backend call:
    botocore sends it up to ``max_attempts + 1`` times (as measured; twice that when the
    connection is reset), and s3fs repeats the whole call up to ``retries`` times, nested twice
    for reads."""
    return 2 * (max_attempts + 1) * s3fs_retries**2


@dataclass
class FaultRow:
    """The figures of one scenario (see the module docstring)."""

    scenario: str
    fault: str
    server: str
    ops: int = 0
    attempts: int = 0
    faults: int = 0
    retries: int = 0
    max_try: int = 0
    committed: int = 0
    expected: int = 0
    partial: int = 0
    wrong: int = 0
    typed: int = 0
    raw: int = 0
    seconds: float = 0.0
    errors: tuple[str, ...] = ()

    def count(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run one backend call; count it and any error (None on error)."""
        self.ops += 1
        try:
            return fn(*args)
        except CkstoreError as exc:
            self.typed += 1
            self.errors += (f"{type(exc).__name__}: {exc}",)
        except Exception as exc:  # a raw error escaping the backend: a bug
            self.raw += 1
            self.errors += (f"RAW {type(exc).__module__}.{type(exc).__name__}: {exc}",)
        return None

    def check(self, got: Any, want: Any) -> None:
        """Count a read result that is not what was written (None: the call raised)."""
        if got is not None and bytes(got) != want:
            self.wrong += 1

    def take_traffic(self, proxy: FaultProxy) -> None:
        """Fill attempts, faults, retries and max_try from the proxy's log."""
        per_key = Counter(e.key for e in proxy.events)
        self.attempts = len(proxy.events)
        self.faults = len(proxy.faults())
        self.retries = self.attempts - len(per_key)
        self.max_try = max(per_key.values(), default=0)


class RecordingBackend(WrappingBackend):
    """Remembers the bytes of every put, to audit the server against."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.written: dict[str, bytes] = {}

    def put(self, name: str, data: PutData) -> bool:
        views = as_buffers(data)
        self.written[name] = b"".join(views)
        return self.inner.put(name, views)


class FaultBench:
    """One fault proxy in front of one server, and s3fs clients through it and past it, reused
    by every scenario (a new s3fs instance costs a new botocore session, about 0.5 s).

    Args:
        server: the S3 server (``endpoint_url``, ``storage_options()``, ``create_bucket``).
        name: its name in the report.
    """

    def __init__(self, server: Any, name: str) -> None:
        self.server = server
        self.name = name
        self.bucket = f"faults-{uuid.uuid4().hex[:12]}"
        server.create_bucket(self.bucket)
        self.proxy = FaultProxy(server.endpoint_url).start()
        self._through: dict[int, Any] = {}
        self._direct: Any = None

    def close(self) -> None:
        """Stop the proxy."""
        self.proxy.stop()

    def fresh_url(self) -> str:
        """A new, empty ``s3://bucket/prefix`` for one scenario."""
        return f"s3://{self.bucket}/fault-{uuid.uuid4().hex[:12]}"

    def options(self, max_attempts: int) -> dict[str, Any]:
        """Storage options through the proxy, with botocore's ``max_attempts`` set."""
        options = storage_options(self.proxy.url)
        options["config_kwargs"] = {"retries": {"max_attempts": max_attempts, "mode": "standard"}}
        return options

    def through(self, url: str, max_attempts: int, s3fs_retries: int) -> S3Backend:
        """A backend on ``url`` through the proxy, with small multipart parts."""
        fs = self._through.get(max_attempts)
        if fs is None:
            fs = self._through[max_attempts] = _s3fs(url, self.options(max_attempts))
        fs.retries = s3fs_retries  # s3fs has no constructor argument for it
        return S3Backend(fs, url[len("s3://") :], multipart_threshold=PART, part_size=PART)

    def direct(self, url: str) -> S3Backend:
        """A backend on ``url`` that talks to the server itself, past the proxy."""
        if self._direct is None:
            self._direct = _s3fs(url, self.server.storage_options())
        return S3Backend(self._direct, url[len("s3://") :])

    @contextmanager
    def faults(self, schedule: Schedule, row: FaultRow) -> Iterator[None]:
        """Inject ``schedule`` meanwhile; then fill ``row``'s traffic figures and time."""
        self.proxy.reset(schedule)
        start = time.monotonic()
        try:
            yield
        finally:
            row.seconds = time.monotonic() - start
            row.take_traffic(self.proxy)
            self.proxy.reset(Schedule(seed=0))

    def audit(self, url: str, written: dict[str, bytes], row: FaultRow) -> None:
        """Compare every object under ``url`` on the server (past the proxy) with ``written``."""
        direct = self.direct(url)
        for name in direct.list():
            if written.get(name) == direct.get(name):
                row.committed += 1
            else:
                row.partial += 1
        row.expected = len(written)


def _s3fs(url: str, options: dict[str, Any]) -> Any:
    backend = open_backend(url, options)
    assert isinstance(backend, S3Backend)
    return backend.fs


def _pack_workload(backend: RecordingBackend, rng: random.Random, row: FaultRow) -> None:
    """Four packs of three chunks, one multipart object; read all back; list the packs."""
    store = ObjectStore(backend)
    chunks: dict[str, tuple[Any, bytes]] = {}
    packs = []
    for _ in range(4):
        writer = store.new_pack_writer()
        raws = [rng.randbytes(rng.randrange(2000, 9000)) for _ in range(3)]
        for raw in raws:
            writer.add(chunk_id(raw), "none", raw, len(raw))
        done = row.count(writer.finish)
        if done is not None:
            packs.append(done[0])
            for loc, raw in zip(done[2], raws):
                chunks[loc.chunk_id] = (loc, raw)
    big = rng.randbytes(PART + (1 << 20))
    big_name = f"big/{chunk_id(big)}"
    row.count(backend.put, big_name, [big[: 3 << 20], big[3 << 20 :]])
    for name in [n for n in backend.written if pack_id_from_name(n) in packs]:
        row.check(row.count(backend.get, name), backend.written[name])
    for loc, raw in chunks.values():
        row.check(row.count(store.read_chunk, loc), raw)
    if big_name in backend.written:
        row.check(row.count(backend.get, big_name, PART - 100, 200), big[PART - 100 : PART + 100])
        row.check(row.count(backend.get, big_name), big)
    listed = row.count(lambda: list(backend.list("packs/")))
    if listed is not None and sorted(pack_id_from_name(n) for n in listed) != sorted(packs):
        row.wrong += 1


def run_recover(bench: FaultBench, fault: str, seed: int = 1) -> FaultRow:
    """Faults at rate 0.3, at most two in a row: every call must succeed after retries."""
    row = FaultRow("recover", fault, bench.name)
    url = bench.fresh_url()
    backend = RecordingBackend(bench.through(url, RECOVER_MAX_ATTEMPTS, RECOVER_S3FS_RETRIES))
    with bench.faults(Schedule(seed=seed, faults=(fault,), rate=0.3, max_in_a_row=2), row):
        _pack_workload(backend, random.Random(seed), row)
    bench.audit(url, backend.written, row)
    return row


def run_exhaust(bench: FaultBench, fault: str) -> FaultRow:
    """Every request faulted: each call must end in a typed error (or settle correctly)."""
    row = FaultRow("exhaust", fault, bench.name)
    url = bench.fresh_url()
    old = random.Random(2).randbytes(5000)
    old_name = f"blob/{chunk_id(old)}"
    bench.direct(url).put(old_name, old)
    backend = RecordingBackend(bench.through(url, EXHAUST_MAX_ATTEMPTS, EXHAUST_S3FS_RETRIES))
    new = random.Random(3).randbytes(6000)
    with bench.faults(Schedule(seed=2, faults=(fault,), rate=1.0, max_in_a_row=None), row):
        row.count(backend.put, f"blob/{chunk_id(new)}", new)
        row.check(row.count(backend.get, old_name), old)
        row.check(row.count(backend.get, old_name, 10, 100), old[10:110])
        row.count(lambda: list(backend.list("blob/")))
    bench.audit(url, {**backend.written, old_name: old}, row)
    row.expected -= 1  # the object written beforehand, past the proxy
    row.committed -= 1
    return row


def run_lost_completion(bench: FaultBench) -> FaultRow:
    """A multipart put whose completion is acknowledged to nobody: the first POST (creating
    the upload) and the first completion are lost after the server acted on them."""
    row = FaultRow("mpu-ack", "lost_ack", bench.name)
    url = bench.fresh_url()
    backend = RecordingBackend(bench.through(url, RECOVER_MAX_ATTEMPTS, RECOVER_S3FS_RETRIES))
    big = random.Random(6).randbytes(PART + 4096)
    schedule = Schedule(
        seed=4, faults=("lost_ack",), rate=1.0, methods=frozenset({"POST"}), max_in_a_row=1
    )
    with bench.faults(schedule, row):
        row.count(backend.put, f"big/{chunk_id(big)}", big)
        row.check(row.count(backend.get, f"big/{chunk_id(big)}"), big)
    bench.audit(url, backend.written, row)
    return row


def run_store(bench: FaultBench, index_dir: Path, seed: int = 5) -> FaultRow:
    """A take and a restore through ``ckstore.open`` with every fault kind mixed in."""
    import torch

    import ckstore

    row = FaultRow("store", "+".join(FAULTS), bench.name)
    url = bench.fresh_url()
    index = f"sqlite:///{index_dir / f'index-{uuid.uuid4().hex[:8]}.db'}"
    gen = torch.Generator().manual_seed(seed)
    state = {f"w{i}": torch.randn(40, 30, generator=gen) for i in range(4)}
    tiny = {"chunk_bytes": 1024, "pack_bytes": 8192, "inline_bytes": 64}
    options = bench.options(RECOVER_MAX_ATTEMPTS)
    with bench.faults(Schedule(seed=seed, faults=FAULTS, rate=0.15, max_in_a_row=2), row):
        store = row.count(
            lambda: ckstore.open(url, index=index, storage_options=options, **tiny, create=True)
        )
        if store is not None:
            row.count(store.take, {"m": ckstore.StateDict(state)}, "r", 1)
            dest = ckstore.StateDict({k: torch.zeros_like(v) for k, v in state.items()})
            row.count(lambda: store.get("r@1").restore({"m": dest}))
            row.wrong += sum(not torch.equal(dest[k], v) for k, v in state.items())
            store.close()
    _audit_store(bench, url, index, row)
    return row


def _audit_store(bench: FaultBench, url: str, index: str, row: FaultRow) -> None:
    """Every object of the store must verify against its name; the store must check clean."""
    import ckstore

    direct = bench.direct(url)
    for name in direct.list():
        row.expected += 1
        try:
            _verify_store_object(direct, name)
            row.committed += 1
        except CkstoreError:
            row.partial += 1
    options = bench.server.storage_options()
    with ckstore.open(url, index=index, storage_options=options, create=False) as store:
        row.partial += len(store.check(read_data=True).problems)


def _verify_store_object(backend: Backend, name: str) -> None:
    pack_id = pack_id_from_name(name)
    if pack_id is not None:
        verify_pack(backend, pack_id)
        return
    data = backend.get(name)
    stem = name.rsplit("/", 1)[-1]
    if "/" not in name:
        json.loads(data)  # the store's config
    elif chunk_id(data) != stem:
        raise CorruptionError(f"{name} does not match its id")


def format_table(rows: list[FaultRow]) -> str:
    """The rows as a fixed-width text table."""
    cols = [f.name for f in fields(FaultRow) if f.name != "errors"]
    cells = [
        [f"{getattr(r, c):.1f}" if c == "seconds" else str(getattr(r, c)) for c in cols]
        for r in rows
    ]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """Start the servers named in ``argv`` (default: seaweedfs and moto) on loopback, run
    every scenario on each, print the table."""
    import logging

    from tests.support.s3server import S3Server
    from tests.support.seaweed import SeaweedServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's request log
    starts = {"seaweedfs": SeaweedServer.start, "moto": S3Server.start}
    rows = []
    for name in argv or list(starts):
        server = starts[name]()
        bench = FaultBench(server, name)
        try:
            with fast_retry_backoff(), tempfile.TemporaryDirectory() as tmp:
                rows += [run_recover(bench, fault) for fault in FAULTS]
                rows += [run_exhaust(bench, fault) for fault in EXHAUSTIBLE]
                rows.append(run_lost_completion(bench))
                rows.append(run_store(bench, Path(tmp)))
        finally:
            bench.close()
            server.stop()
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
