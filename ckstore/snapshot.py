"""Snapshot handles: restore a committed snapshot, read single objects, inspect its manifest.

:class:`StoredSnapshot` is what ``store.take``, ``store.get`` and ``store.log`` return; it
names entries by their plain keys (``model/weight``). TorchSnapshot's ``Snapshot``, which names
them ``<rank>/<key>`` and is made from a path, is the thin adapter in
:mod:`ckstore.torchsnapshot`. :class:`PendingSnapshot` is a take finishing in the background,
for both.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from . import _takes
from ._heal_verbs import healing, with_healing
from .distributed import is_distributed, replicated_mode
from .engine.progress import ProgressFn
from .engine.view import SnapshotFields, SnapshotView
from .errors import CorruptionError, InvalidInputError
from .format.limits import check_int, check_number
from .format.manifest import Entry, Manifest, TensorEntry
from .index import EntryRecord, SnapshotRecord

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

    from .engine.restore.jobs import Region
    from .engine.restore.verify_live import LiveCheck
    from .format.health import Health
    from .index.sharing import Shared
    from .interop import ExportReport


class StoredSnapshot(SnapshotFields):
    """One committed snapshot of a store: restore it, read single objects, inspect its manifest.

    Made by the store (``store.take``, ``store.get``, ``store.log``); entries are named by
    their plain keys (``"model/weight"``). ``ckstore.Snapshot.of(snap)`` gives the same
    snapshot as TorchSnapshot's ``Snapshot``, whose paths are ``<rank>/<key>``.
    """

    ranked_paths = False
    """Whether :meth:`read_object` and :meth:`get_manifest` use TorchSnapshot's ``<rank>/<key>``
    paths (only :class:`ckstore.Snapshot` does)."""
    pg: ProcessGroup | None = None
    """The process group :meth:`restore` uses by default (None: every rank)."""

    _bound_view: SnapshotView | None

    def __init__(self, view: SnapshotView) -> None:
        self._bound_view = view

    def _view(self) -> SnapshotView:
        """The engine's view of this snapshot (a subclass may resolve it on first use)."""
        assert self._bound_view is not None
        return self._bound_view

    @property
    def view(self) -> SnapshotView:
        """The plumbing under the handle: the snapshot's record and manifest bound to its
        repository, with a verifying chunk reader (for maintenance tools and tests; the
        methods here are what users call)."""
        return self._view()

    # --- what it is ------------------------------------------------------------------------
    @property
    def record(self) -> SnapshotRecord:
        """The index row: id, run, step, parent, time, metadata, sizes."""
        return self._view().record

    @property
    def manifest(self) -> Manifest:
        """The parsed manifest (read from the store on first use, validated). Every handle of
        this snapshot on this store handle shares it (reads build their values anew from
        it): read it, never change it."""
        return self._view().manifest

    @property
    def path(self) -> str:
        """Where the snapshot lives: its store's URL (TorchSnapshot's path for ``Snapshot``)."""
        return self._view().repo.url

    @property
    def health(self) -> Health | None:
        """What its take found (NaN/Inf counts and norms per tensor, stale tensors), from the
        manifest header; None if it recorded nothing (taken before ckstore did). For the
        summary without reading the manifest, see :attr:`healthy`."""
        from .format.health import of_header  # its patterns are compiled on first use

        return of_header(self._view().header)

    @property
    def forked_from(self) -> str | None:
        """The id of the snapshot its take's state was loaded from, when that was not the
        run's previous snapshot: ``take(..., forked_from=ref)``, or the snapshot a restore of
        the taking process loaded (a fine-tune's base). None when none was recorded (the
        lineage then infers the fork from shared chunks); from the manifest header."""
        value = self._view().header.get("forked_from")
        return value if isinstance(value, str) and value else None

    # --- what it stores and shares (from the index) --------------------------------------------
    def entries(self) -> list[EntryRecord]:
        """Every entry's key, kind, dtype, shape and size (and digest), in the order of the
        take, from the index: no manifest is read (only for a snapshot whose index has no
        entry rows, e.g. one rebuilt by an older ckstore)."""
        view = self._view()
        records = view.repo.index.entries(view.record.manifest_id)
        if records:
            return records
        from .engine.take.commit import entry_records  # as a commit makes them

        return entry_records(self.manifest)

    def stored_bytes(self) -> int:
        """The stored (compressed) length of the chunks it references, each counted once,
        whoever else references them."""
        return self._view().repo.index.stored_bytes(self.id)

    def exclusive_usage(self) -> tuple[int, int]:
        """``(chunks, stored bytes)`` of the chunks no other snapshot references: what
        forgetting it alone would let ``gc`` reclaim (chunks that deltas are stored against
        aside)."""
        return self._view().repo.index.exclusive_usage(self.id)

    def shared_with(self, others: Sequence[str]) -> list[Shared]:
        """The chunks it has in common with each of the snapshots ``others`` (ids; unknown ones
        share nothing): one :class:`~ckstore.index.sharing.Shared` per snapshot sharing any,
        most chunks first. Cost: its chunks times ``len(others)`` index lookups."""
        return self._view().repo.index.shared_with(self.id, others)

    def verify_live(self, app_state: Mapping[str, Any]) -> LiveCheck:
        """Whether the live ``app_state`` holds exactly this snapshot's state.

        Each live tensor is hashed on the snapshot's chunk grid and compared with the chunk
        ids (nothing is read from the store); values are compared with the manifest. The
        report names every key that differs, is missing or is extra (``.ok``, ``.differs``).
        DTensors are skipped (named in ``.skipped``); per-rank values are compared with this
        rank's (rank 0 outside torch.distributed).
        """
        from .engine.restore.verify_live import verify_live
        from .engine.stateful import check_app_state

        check_app_state(app_state, restoring=False)
        rank = 0
        if is_distributed():
            import torch.distributed as dist

            rank = dist.get_rank(self.pg) if self.pg is not None else dist.get_rank()
        return verify_live(
            self.manifest, dict(app_state), rank=max(rank, 0), threads=self._view().repo.threads
        )

    # --- reading ---------------------------------------------------------------------------
    def restore(
        self,
        app_state: Mapping[str, Any],
        strict: bool = True,
        *,
        memory_budget: int | None = None,
        pg: ProcessGroup | None = None,
        dist_timeout: float | None = None,
        replicated_read: str | None = None,
        atomic: bool = True,
        verify: bool | str = False,
        progress: ProgressFn | None = None,
        cast: bool = False,
    ) -> None:
        """Load this snapshot into ``app_state`` in place.

        Validates keys, dtypes and shapes, then reads and checks every chunk, and only then
        writes into the caller's tensors and calls ``load_state_dict``: on any error the
        app_state is left untouched. Chunks that must be decoded (and, on a store that does not
        map its files, every chunk) are decoded and checked into staging memory of up to
        ``memory_budget`` bytes (default: ``$CKSTORE_MEMORY_BUDGET``, else 3% of what is
        restored, at most 512 MiB) and copied into place. A local store's raw chunks, and the
        others past the budget, stay mapped where they were checked (packs are immutable) and
        those very bytes are copied or decoded into place; elsewhere a chunk past the budget is
        read again (from a spill file where reading again would fetch it from the store),
        compared with a fingerprint taken when it was checked (verifying by id: with the
        digests its payloads were written with) and decoded into place. Memory above the live
        state stays near the budget. CUDA destinations are filled through pinned
        host buffers, counted in the budget.

        ``atomic=False`` gives up that guarantee for speed: every tensor is decoded straight
        into place in one pass (every chunk is still checked, and a damaged one still raises
        CorruptionError naming the key, but the destination is then partly loaded) and
        nothing is staged. Use it to load into a freshly built model at start-up, where a
        failed restore ends the process anyway.

        Destination tensors on the meta device (a model built under ``torch.device("meta")``)
        have no storage: they are read as new CPU tensors and handed over with ``assign``
        semantics (``load_state_dict(assign=True)`` for a module: its meta parameters are
        replaced, the others loaded in place); move the model with ``.to(device)`` after. An
        optimizer over meta parameters is refused before anything loads (restore the model,
        then build and restore the optimizer), and a stateful whose tensors are still on meta
        after its ``load_state_dict()`` raises MismatchError naming them.

        With ``torch.distributed`` initialised, call it on every rank: each rank gets the part
        its destination needs (its DTensor shard, whatever the world size and placement at take
        time; whole plain tensors; its own rank's per-rank values), every distinct chunk is
        read once in the whole job by one rank (balanced by bytes) and sent to the ranks that
        need it, and either every rank loads or every rank raises DistributedError. Atomic
        across ranks: nothing is written anywhere before every chunk has been verified by its
        reader and every rank agreed; when what a rank receives fits ``memory_budget``, before
        every rank also holds all its bytes. ``pg`` (default: the ``pg`` this handle was
        opened with, else every rank) limits the restore to a group's members; ranks are then
        ranks within ``pg``.
        With ``strict=False``, a rank that has no stored value for a per-rank entry (the take
        had fewer ranks, e.g. 2 -> 3) keeps its destination as it is and logs the skipped keys
        (logger ``"ckstore"``); an app with nothing left to load (an :class:`RNGState` on such
        a rank) is not loaded at all. ``RNGState`` entries are loaded after every other one.
        A snapshot written by ``dcp.save`` is restored by mapping each app's state dict onto
        DCP's keys (see :mod:`ckstore.engine.restore.dcp_keys`).
        ``replicated_read`` (default ``$CKSTORE_REPLICATED_READ`` or ``"once"``): ``"once"``
        reads each chunk once in the job as above (``"broadcast"`` means the same); ``"each"``
        lets every rank read everything it needs itself (no exchange).
        A chunk that fails its check on a store with remotes (a two-tier store's tier remote,
        or any remote that holds it) is fetched from the remote, verified against its id,
        written into a new local pack, read there, and the restore goes on, bit-exact; a
        :class:`~ckstore.HealedWarning` names the chunks and the remote (under torch.distributed,
        on the rank that read them). Without a remote holding a sound copy, CorruptionError
        names the snapshot and offers the run's previous healthy snapshot.
        Every chunk read is checked by default against the fast check its manifest records
        beside its id (XXH3-64 of its raw bytes: it covers the stored bytes and the decoder;
        docs/RELIABILITY.md, I3). ``verify="full"`` re-hashes every chunk read with BLAKE3
        against its id instead, as bytes crossing a trust boundary are (a store whose files
        someone else could have written). ``verify=True`` then checks what landed
        (:meth:`verify_live`: one more hashing pass over the restored tensors) and raises
        CorruptionError naming any key that differs: a ``load_state_dict`` that transformed or
        dropped a value, a hook that changed one.
        ``progress``: ``fn(what, done, total)`` told the raw bytes of each pass as it advances
        (``"verify"`` then ``"restore"``; one ``"restore"`` pass with ``atomic=False``), from the
        restore's threads, at most ten times a second and at the end of each pass.
        ``cast=True`` converts a tensor stored in one floating-point dtype into a destination
        of another (a float32 snapshot into a bfloat16 model): it is read as stored into new
        memory, verified, and copied into place with ``Tensor.copy_``'s rounding. Integer,
        bool and complex tensors must still match. Single-process restores only, without
        ``verify`` (a converted tensor never hashes as stored).

        A later :meth:`Store.take` of this process into the same store records this snapshot
        as the one it forked from (unless it is the run's latest: a resume), so the lineage
        shows where a fine-tune came from. After a training job's single-process restore (one
        that loads an optimizer's state) of a snapshot that ``async_take`` took, the staging
        memory of this process's next ``async_take`` is made ready behind training (knob
        ``stage_after_restore``): a restarted job's first checkpoint blocks about as long as
        its later ones.

        Raises:
            UnsupportedValueError: an app_state value is not stateful (also a TypeError).
            MismatchError: keys, dtypes or shapes differ (named in the message; a
                ``torch.compile``'d module's ``_orig_mod.`` keys get the fix), or meta tensors
                were not materialised (see above).
            InvalidInputError: ``cast=True`` with ``verify=True``, or under torch.distributed.
            CorruptionError: stored bytes are damaged and no remote holds a sound copy (the
                key, or the snapshot and the chunks, are named).
            DistributedError: a rank failed (distributed restore; names ranks and causes);
                RankLostError when a rank never answered within ``dist_timeout``.
        """
        from .engine.restore.dcp_keys import dcp_overlay, is_dcp_manifest
        from .engine.restore.phases import restore
        from .engine.restore.reader import Reader
        from .engine.stateful import check_app_state

        check_app_state(app_state, restoring=True)
        if verify not in (False, True, "full"):
            raise InvalidInputError(
                f"verify must be False, True or 'full', got {verify!r}: 'full' re-hashes every "
                "chunk read with BLAKE3, True checks what landed after the restore"
            )
        if cast and (verify is True or is_distributed()):
            raise InvalidInputError(
                "restore(cast=True) converts dtypes in a single-process restore without "
                "verify=True (a converted tensor never hashes as stored); under torch.distributed "
                "restore into a model of the stored dtypes, then convert"
            )
        mode = replicated_mode(replicated_read)
        if memory_budget is not None:
            check_int("memory_budget", memory_budget)
        if dist_timeout is not None:
            check_number("dist_timeout", dist_timeout, lo_open=True)
        budget = self._view().repo.memory_budget if memory_budget is None else memory_budget
        checking = "full" if verify == "full" else "fast"
        with healing(self._view(), budget) as view, view.repo.activity():  # compaction waits
            if is_distributed():  # the job reads the manifest (each rank: what it needs) once
                from .distributed.restore import restore as dist_restore

                dist_restore(
                    view,
                    app_state,
                    strict=strict,
                    pg=pg if pg is not None else self.pg,
                    timeout=dist_timeout,
                    budget=budget,
                    replicated_read=mode,
                    atomic=atomic,
                    on_progress=progress,
                    verify=checking,
                    heal=view.heal,
                )
            else:

                def once() -> None:
                    reader = Reader.of(view, progress=progress, verify=checking)
                    if is_dcp_manifest(reader.manifest):
                        overlay = dcp_overlay(reader.manifest, app_state, strict)
                        reader = replace(reader, manifest=overlay)
                    restore(
                        reader, app_state, strict=strict, budget=budget, atomic=atomic, cast=cast
                    )

                with_healing(view, once)
        _takes.loaded(view.repo, view.record.id)
        if verify is True:
            self._check_restored(app_state, strict)
        if not is_distributed():  # each rank's state_dict() may be a collective: not here
            _takes.stage_after_restore(view.repo, view.header, app_state)

    def _check_restored(self, app_state: Mapping[str, Any], strict: bool) -> None:
        found = self.verify_live(app_state)
        wrong = found.differs + (found.missing + found.extra if strict else [])
        if wrong:
            raise CorruptionError(
                f"snapshot {self.ref}: after the restore, {len(wrong)} key(s) of app_state do not hold the "
                f"snapshot's state: {', '.join(wrong[:8])}{' ...' if len(wrong) > 8 else ''} (load_state_dict "
                "or a hook changed or left them out)"
            )

    def read_object(
        self, path: str, obj_out: Any = None, memory_budget_bytes: int | None = None
    ) -> Any:
        """Read one entry (or a subtree such as ``"optim"``) without reading anything else.

        ``path`` is a plain key of :meth:`get_manifest` (``"model/weight"``); a per-rank entry
        comes back as a list with one value per rank. A tensor comes back as a new CPU tensor,
        or is copied into ``obj_out`` if given (and returned). A damaged chunk a remote holds
        is healed from it, as :meth:`restore` does (:class:`HealedWarning`).

        Raises:
            KeyNotFoundError: no such path (the message suggests near matches).
            CorruptionError: a chunk read is damaged and no remote holds a sound copy.
        """
        from .engine.restore.read import read_object
        from .engine.restore.reader import Reader

        with healing(self._view()) as view:
            return read_object(Reader.of(view), path, obj_out)

    def get_manifest(self) -> dict[str, Entry]:
        """Every leaf's key -> its entry (``kind``, ``dtype``, ``shape``, ``nbytes``); a per-rank
        entry is one entry of kind ``"per_rank"``."""
        return dict(self.manifest.entries)

    def get_state_dict_for_key(self, key: str, replicate_from_rank0: bool = False) -> Any:
        """The state dict stored for app_state name ``key``, without loading it anywhere.

        Under torch.distributed each rank gets its own per-rank values (rank within this
        handle's ``pg``); with ``replicate_from_rank0`` every rank gets rank 0's. A rank beyond
        the take's world size gets the shared values only (per-rank ones are left out). Reads
        only ``key``'s entries; no collective. A damaged chunk a remote holds is healed from
        it, as :meth:`restore` does (:class:`HealedWarning`).

        Raises:
            KeyNotFoundError: the snapshot has no app_state name ``key``.
            CorruptionError: a chunk read is damaged and no remote holds a sound copy.
        """
        rank = 0
        if not replicate_from_rank0 and is_distributed():
            import torch.distributed as dist

            rank = dist.get_rank(self.pg) if self.pg is not None else dist.get_rank()
            if rank < 0:
                raise InvalidInputError("this rank is not a member of the snapshot handle's pg")
        from .engine.restore.read import read_state
        from .engine.restore.reader import Reader

        with healing(self._view()) as view:
            return read_state(Reader.of(view, rank=rank), key)

    def read_regions(
        self,
        tensors: Mapping[str, TensorEntry],
        regions: Mapping[str, Region],
        *,
        where: str | None = None,
    ) -> dict[str, torch.Tensor]:
        """Read regions of tensors laid out by ``tensors``, entries whose chunks this snapshot
        references but which its manifest may not name as such (a DCP save's pieces, rebuilt
        from the DCP metadata it stores).

        Returns, per key of ``regions``, a new CPU tensor of the region ``(offsets, sizes)``
        (in the entry's global coordinates). Only the chunks overlapping a region are read,
        each verified against its id. ``where`` names what is read in error messages
        (default: this snapshot). A chunk found damaged is healed from a remote that holds
        it, as a restore heals (:meth:`restore`).

        Raises:
            CorruptionError: a chunk read is damaged and no remote gives it back (the key is
                named).
        """
        from .engine.restore.reader import Reader

        with healing(self._view()) as view:
            repo = view.repo
            reader = Reader(
                repo.objects,
                repo.index,
                Manifest({}, dict(tensors)),
                where or f"snapshot {self.ref}",
                threads=repo.threads,
                heal=view.heal,
            )
            return reader.read_regions(regions)

    def export(
        self,
        path: str | os.PathLike[str],
        format: str = "safetensors",  # noqa: A002 - the option users type
        *,
        keys: Sequence[str] | str | None = None,
        force: bool = False,
        shard_bytes: int | None = None,
        memory_budget: int | None = None,
        progress: ProgressFn | None = None,
    ) -> ExportReport:
        """Write this snapshot to directory ``path`` in another checkpoint format.

        ``format``:

        - ``"safetensors"`` (or ``"hf"``): the Hugging Face layout: shards of at most
          ``shard_bytes`` (default 5 GB, as ``save_pretrained``) named ``model.safetensors``
          or ``model-00001-of-0000N.safetensors``, ``model.safetensors.index.json``, each
          shard's ``__metadata__`` naming the snapshot (``ckstore.snapshot``, ``ckstore.run``,
          ``ckstore.step``), and the files an import kept (``config.json``...) written back.
          Tensor names are the keys relative to their app when one app is exported
          (``model/encoder.weight`` -> ``encoder.weight``), else the whole key with '.' for
          '/'. Plain values are left out (listed in ``skipped_values``).
        - ``"torch"``: one ``torch.save`` file of ``{app: state_dict}`` (the flat dict itself
          for a snapshot imported from one), loadable with ``weights_only=True``.
        - ``"dcp"``: a ``torch.distributed.checkpoint`` directory written by DCP's own
          FileSystemWriter, which ``dcp.load`` reads at any world size; tensors imported from
          DCP keep their original shards.

        ``keys``: glob(s) of keys to export, e.g. ``"model/**"`` (a key also matches when a
        path above it does, so ``"model"`` works too). Every chunk is verified as it is read,
        tensors are read in pieces of about ``memory_budget`` bytes (default: the store's
        restore budget), and the directory appears only once complete. A non-empty ``path``
        is refused unless ``force=True`` (then it is replaced; never a folder that is, holds
        or lies inside a store, nor one holding the store's index file). ``progress``:
        ``fn(what, done, total)`` told the bytes read as each piece is read (``what``:
        ``"restore"``), as for :meth:`restore`.

        Raises:
            DestinationExistsError: ``path`` is not empty and ``force`` is False.
            UnsupportedValueError: a key cannot go to the format (a dtype safetensors lacks,
                a per-rank value); the message says which and what to do.
            CorruptionError: stored bytes are damaged and no remote holds a sound copy (one
                that does heals them, as :meth:`restore` does); nothing is published.
        """
        from .interop import DEFAULT_SHARD_BYTES, export_snapshot

        globs = [keys] if isinstance(keys, str) else keys
        with healing(self._view()) as view:
            view.progress = progress
            return export_snapshot(
                view, path, format=format, keys=globs, force=force,
                shard_bytes=DEFAULT_SHARD_BYTES if shard_bytes is None else shard_bytes,
                memory_budget=memory_budget,
            )  # fmt: skip

    def __repr__(self) -> str:
        return f"Snapshot({self.ref}, store={self._view().repo.url!r})"
