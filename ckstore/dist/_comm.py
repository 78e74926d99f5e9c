"""JSON messages between ranks over a dedicated gloo group (no pickle, bounded waits)."""

from __future__ import annotations

import json
import os
from datetime import timedelta
from typing import Any

import torch

from ..errors import DistributedError, InvalidInputError
from ..format.limits import check_number

DEFAULT_TIMEOUT = 600.0
BROADCAST_BATCH = 64 << 20  # default bytes per broadcast call when sending tensors
MAX_TIMEOUT = 7 * 86400.0
_GROUPS: list[tuple[Any, float, Any]] = []  # (default group, timeout, gloo group): one per pair


def dist_timeout(timeout: float | None) -> float:
    """The timeout in seconds: the argument, else ``CKSTORE_DIST_TIMEOUT``, else 600.

    Raises:
        InvalidInputError: not a finite number of seconds > 0 (at most a week).
    """
    if timeout is not None:
        return check_number("dist_timeout", timeout, 0.0, MAX_TIMEOUT, lo_open=True)
    env = os.environ.get("CKSTORE_DIST_TIMEOUT")
    if not env:
        return float(DEFAULT_TIMEOUT)
    try:
        value = float(env)
    except ValueError:
        raise InvalidInputError(f"$CKSTORE_DIST_TIMEOUT must be a number of seconds, got {env!r}") from None
    return check_number("$CKSTORE_DIST_TIMEOUT", value, 0.0, MAX_TIMEOUT, lo_open=True)


class Comm:
    """This rank's view of the job: rank, world size and JSON collectives.

    Every collective either returns or raises :class:`DistributedError` within the timeout
    (gloo enforces it), so a rank that died cannot hang the others forever.
    """

    def __init__(self, pg: Any = None, timeout: float | None = None) -> None:
        import torch.distributed as dist

        self.timeout = dist_timeout(timeout)
        if pg is not None and pg is not dist.group.WORLD and dist.get_world_size(pg) != dist.get_world_size():
            raise DistributedError("ckstore supports only process groups that span every rank (pg=None)")
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.group = _gloo_group(self.timeout)

    def all_gather_json(self, obj: Any, what: str) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        import torch.distributed as dist

        raw = json.dumps(obj, separators=(",", ":")).encode()
        try:
            n = torch.tensor([len(raw)], dtype=torch.int64)
            sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
            dist.all_gather(sizes, n, group=self.group)
            longest = max(int(s) for s in sizes)
            mine = torch.zeros(longest, dtype=torch.uint8)
            if raw:
                mine[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            bufs = [torch.zeros(longest, dtype=torch.uint8) for _ in range(self.world)]
            dist.all_gather(bufs, mine, group=self.group)
        except Exception as exc:  # gloo: peer gone or timeout
            raise self._lost(what, exc) from exc
        return [json.loads(b[: int(s)].numpy().tobytes()) for b, s in zip(bufs, sizes)]

    def broadcast_json(self, obj: Any, what: str, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank."""
        import torch.distributed as dist

        try:
            raw = json.dumps(obj, separators=(",", ":")).encode() if self.rank == src else b""
            n = torch.tensor([len(raw)], dtype=torch.int64)
            dist.broadcast(n, src, group=self.group)
            buf = torch.zeros(int(n), dtype=torch.uint8)
            if self.rank == src and raw:
                buf[:] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            dist.broadcast(buf, src, group=self.group)
        except Exception as exc:
            raise self._lost(what, exc) from exc
        return json.loads(buf.numpy().tobytes())

    def broadcast_tensors(self, tensors: list[torch.Tensor], what: str, src: int = 0, batch_bytes: int | None = None) -> None:
        """Copy rank ``src``'s contiguous CPU ``tensors`` into the same-shaped ones elsewhere.

        Bytes travel in batches of at most ``batch_bytes``: small tensors are packed together
        into one buffer, large ones are sent in slices of their own storage (no copy).
        """
        import torch.distributed as dist

        batch_bytes = batch_bytes or BROADCAST_BATCH
        pending: list[torch.Tensor] = []
        filled = 0

        def flush() -> None:
            nonlocal filled
            if len(pending) == 1:
                dist.broadcast(pending[0], src, group=self.group)
            elif pending:
                buf = torch.cat(pending) if self.rank == src else torch.empty(filled, dtype=torch.uint8)
                dist.broadcast(buf, src, group=self.group)
                if self.rank != src:
                    at = 0
                    for piece in pending:
                        piece.copy_(buf[at : at + piece.numel()])
                        at += piece.numel()
            pending.clear()
            filled = 0

        try:
            for t in tensors:
                if t.numel() == 0:
                    continue
                flat = t.reshape(-1).view(torch.uint8)
                for start in range(0, flat.numel(), batch_bytes):
                    piece = flat[start : start + batch_bytes]
                    if filled + piece.numel() > batch_bytes:
                        flush()
                    pending.append(piece)
                    filled += piece.numel()
            flush()
        except Exception as exc:
            raise self._lost(what, exc) from exc

    def _lost(self, what: str, exc: BaseException) -> DistributedError:
        return DistributedError(
            f"rank {self.rank}: lost contact with the other ranks during {what} (a rank died, "
            f"hung or called something else; timeout {self.timeout:g} s): {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}"
        )


def _gloo_group(timeout: float) -> Any:
    """A gloo group over all ranks with ``timeout``, made once per default group (collective)."""
    import torch.distributed as dist

    default = dist.distributed_c10d._get_default_group()
    for pg, t, group in _GROUPS:
        if pg is default and t == timeout:
            return group
    _GROUPS[:] = [g for g in _GROUPS if g[0] is default]  # drop groups of destroyed defaults
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
    _GROUPS.append((default, timeout, group))
    return group


def failure(exc: BaseException) -> dict[str, Any]:
    """A JSON status for a rank that failed with ``exc``."""
    return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


def raise_failed(statuses: list[dict[str, Any]], what: str) -> None:
    """Raise DistributedError naming every failed rank and its cause, if any failed."""
    failed = [(r, s.get("error", "?")) for r, s in enumerate(statuses) if not s.get("ok")]
    if failed:
        causes = "; ".join(f"rank {r}: {e}" for r, e in failed)
        ranks = [r for r, _ in failed]
        err = DistributedError(f"{what} failed on rank(s) {ranks}: {causes}")
        err.ranks = ranks  # type: ignore[attr-defined]
        err.causes = dict(failed)  # type: ignore[attr-defined]
        raise err
