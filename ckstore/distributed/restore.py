"""The distributed restore: every chunk the job needs is read once, by one rank, and sent.

A DTensor destination needs its shard's box of the global tensor (any placement, any world
size: the stored pieces are cut to that box); a plain tensor needs the whole tensor; a
per-rank entry gives each rank its own value. Phases (each closed by a bounded collective,
named in errors and in the ranks' progress):

0. **open** (``_open``): rank 0 reads the manifest object and sends it to every rank; of a
   manifest stored in parts each rank needs only the parts holding its regions, and the job
   reads each of those (and the nodes above them) once, as it reads chunks below. Nothing is
   listed: the manifest names every object, the index says where it is.
1. **plan**: every rank validates its destination (keys, dtypes, shapes; nothing read) and
   lists the chunks it needs as runs of the manifest's chunk numbering (``_readplan``); rank
   0 gathers the runs alone, gives every distinct chunk one reader (the ranks needing it,
   balanced by bytes over all ranks), schedules the transfers, and sends each rank only its
   part.
2. **read**: each rank reads and verifies (re-hashes) its chunks. With ``atomic`` and a
   *held* plan (every rank can keep what it receives within its staging budget), the whole
   exchange happens here too: readers send verified bytes, receivers check size and
   fingerprint and keep them. Otherwise this phase only verifies.
3. **broadcast** (atomic, streamed plan): readers read their chunks again and send them;
   receivers check them and put them in place as they arrive.
4. apply (local): kept chunks are copied into place, ``load_state_dict`` runs.

Atomic across ranks: nothing is written into any rank's destination before every chunk the
job needs has been read and verified by its reader and every rank agreed on it (the end of
phase 2); with a held plan, before every rank also holds all of its bytes (so a rank lost at
any point leaves every destination untouched). With a streamed plan, a rank lost during phase
3 makes every other rank raise naming it, their destinations then partly loaded. Pass a
``memory_budget`` of at least the bytes a rank receives to always get a held plan.

``replicated_read``: ``"once"`` (the default; ``"broadcast"`` means the same now) is the
above; ``"each"`` lets every rank read everything it needs itself, as before (no exchange; the
manifest's root still comes from rank 0, and each rank reads the parts it needs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..engine.config import restore_budget
from ..engine.devices import host_empty
from ..engine.progress import ProgressFn
from ..engine.restore.jobs import Job, Region
from ..engine.restore.phases import (
    Prepared,
    apply,
    destination_bytes,
    interrupts_held,
    prepare,
    validate,
)
from ..engine.restore.reader import Reader
from ..engine.restore.sources import Healer
from ..errors import DistributedError
from ..format.dtypes import dtype_from_name
from ..format.manifest import TensorEntry
from ..format.parts import Part as ManifestPart
from . import replicated_mode
from ._exchange import Exchange
from ._open import open_manifest
from ._progress import Progress, progress
from ._readplan import Part as ReadPart
from ._readplan import Table, plan_reads, runs_of, table_of
from .comm import Comm, phase

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from ..engine.view import SnapshotView


def restore(
    view: SnapshotView,
    app_state: Mapping[str, Any],
    strict: bool = True,
    pg: ProcessGroup | None = None,
    timeout: float | None = None,
    budget: int | None = None,
    replicated_read: str | None = None,
    atomic: bool = True,
    on_progress: ProgressFn | None = None,
    verify: str = "fast",
    heal: Healer | None = None,
) -> None:
    """Restore ``view``'s snapshot into ``app_state`` on every rank of ``pg`` (see the module
    docstring); every rank loads, or every rank raises DistributedError. ``on_progress`` is
    told each pass's bytes (as :meth:`StoredSnapshot.restore`'s ``progress``); ``verify`` is
    how each chunk read is checked (:class:`~ckstore.engine.restore.reader.Reader`: ``"fast"``
    its check, ``"full"`` BLAKE3 against its id as well); ``heal`` heals a chunk the rank
    reading it finds damaged or missing, before that rank sends it on."""
    mode = replicated_mode(replicated_read)
    comm = Comm(pg, timeout)
    what = f"distributed restore of snapshot {view.ref}"
    once = comm.world > 1 and mode != "each"
    with progress(comm.group if once else None, what) as prog:
        manifest, parts = open_manifest(comm, view, app_state, strict, once, prog, what)
        repo = view.repo
        reader = Reader(
            repo.objects,
            repo.index,
            manifest,
            f"snapshot {view.ref}",
            threads=repo.threads,
            rank=comm.rank,
            progress=on_progress,
            verify=verify,
            heal=heal,
        )
        if not once:
            with phase(comm, "read", what, collect="none"):
                prepared = prepare(reader, app_state, strict, budget, atomic=atomic)
            apply(prepared, reader)
            return
        _restore_once(comm, reader, parts, app_state, strict, budget, atomic, prog, what)


@dataclass
class _Targets:
    """Where the bytes of one rank's restore go: the caller's tensors, or new ones."""

    plans: list[Any]
    direct: dict[str, tuple[torch.Tensor, Region | None]]
    tensors: dict[str, torch.Tensor]
    jobs: list[Job]

    @property
    def nbytes(self) -> int:
        return destination_bytes(self.direct) + sum(
            t.numel() * t.element_size() for t in self.tensors.values()
        )


def _targets(reader: Reader, plans: list[Any]) -> _Targets:
    direct: dict[str, tuple[torch.Tensor, Region | None]] = {}
    rest: dict[str, tuple[torch.Tensor, Region | None]] = {}
    tensors: dict[str, torch.Tensor] = {}
    for p in plans:
        for k in p.keys:
            if not reader.is_tensor(k):
                continue
            if k in p.target:
                direct[k] = (p.target[k], p.region.get(k))
                continue
            entry = reader.entry(k)
            assert isinstance(entry, TensorEntry)
            tensors[k] = host_empty(entry.shape, dtype_from_name(entry.dtype))
            rest[k] = (tensors[k], None)
    reader.copy_inline(rest)  # new tensors, not the caller's: safe now
    return _Targets(plans, direct, tensors, reader.jobs(direct) + reader.jobs(rest))


def _restore_once(
    comm: Comm,
    reader: Reader,
    parts: Mapping[int, ManifestPart] | None,
    app_state: Mapping[str, Any],
    strict: bool,
    budget: int | None,
    atomic: bool,
    prog: Progress,
    what: str,
) -> None:
    table, targets, part, common = _plan(
        comm, reader, parts, app_state, strict, budget, atomic, what
    )
    cap = restore_budget(budget, targets.nbytes)
    held = atomic and bool(common["held"])
    fetcher = reader.fetcher()
    arena: Any = None  # verified chunks of this rank's own reads, until they are put in place
    placing = contextlib.ExitStack()
    try:
        x = Exchange(
            comm,
            fetcher,
            table,
            part,
            common,
            targets.jobs,
            prog,
            "read" if held or not atomic else "broadcast",
            held,
        )
        own = x.own_jobs()
        reads = x.sent() | {table.index[j.cid] for j in own}
        prog.total = sum(table.sizes[i] for i in reads) + sum(table.sizes[i] for i in x.received())
        with phase(comm, "read", what, collect="none"):
            if atomic:
                arena = fetcher.verify(own, max(0, cap - x.held_bytes()) if held else cap)
            if atomic and not held:
                fetcher.verify(x.sent_jobs(), 0)  # checked now; read again to be sent
            if held or not atomic:
                x.run()
            if not atomic and not x.stopped:
                fetcher.load(own)
            prog.add("read", sum(table.sizes[table.index[c]] for c in {j.cid for j in own}))
        # from here the caller's tensors are written: an interrupt is held until they are
        # whole, as phases.apply holds it for a restore of one process
        placing.enter_context(interrupts_held(atomic))
        if atomic and not held:
            with phase(comm, "broadcast", what, collect="none"):
                x.run()
                if not x.stopped:
                    fetcher.apply(own)
        elif atomic:  # every rank has all its bytes, verified: put them in place
            fetcher.load(x.jobs_of(x.received() | (x.sent() & x.need)), source=x.source())
            fetcher.apply(own)
    except BaseException:
        fetcher.close()
        placing.close()
        raise
    del arena
    with placing:
        apply(
            Prepared(
                targets.plans, targets.tensors, targets.direct, [], verified=True, fetcher=fetcher
            ),
            reader,
        )


def _plan(
    comm: Comm,
    reader: Reader,
    parts: Mapping[int, ManifestPart] | None,
    app_state: Mapping[str, Any],
    strict: bool,
    budget: int | None,
    atomic: bool,
    what: str,
) -> tuple[Table, _Targets, ReadPart, dict[str, Any]]:
    """Phase 1: validate here, plan on rank 0, each rank gets its part."""
    with phase(comm, "plan", what, collect="root") as ph:
        plans = validate(reader, app_state, strict)
        targets = _targets(reader, plans)
        table = table_of(reader.manifest, parts)
        needed = {table.index[j.cid] for j in targets.jobs}
        ph.send(
            {
                "needs": runs_of(needed),
                "sizes": table.part_sizes(needed),
                "cap": restore_budget(budget, targets.nbytes),
                "table": table.digest(),
            }
        )
    gathered = ph.received
    with phase(comm, "plan", what, root=0) as ph:
        shares: list[Any] | None = None
        if comm.rank == 0:
            odd = [r for r, g in enumerate(gathered) if g["table"] != gathered[0]["table"]]
            if odd:  # the plan numbers chunks alike on every rank: never send bytes on a mismatch
                raise DistributedError(
                    f"{what}: rank(s) {odd} read another manifest than rank 0", ranks=odd
                )
            sizes = {i: table.sizes[i] for i in range(table.shared)}
            sizes.update((int(i), int(n)) for g in gathered for i, n in g["sizes"])
            plan = plan_reads(
                [g["needs"] for g in gathered],
                [g["cap"] for g in gathered],
                sizes,
                atomic=atomic,
            )
            shares = [p.to_json() for p in plan.parts]
            ph.send(plan.common())
    common = ph.received
    part = ReadPart.from_json(comm.scatter_json(shares, "plan"))
    return table, targets, part, common
