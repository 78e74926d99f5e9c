"""The store's usage verbs: what it holds and who holds it, read from the index (``ckstore du``
and the web view's storage and lineage).

:class:`UsageVerbs` is mixed into :class:`ckstore.Store`; every verb here only reads. The
snapshot-sized questions (a snapshot's stored size, what only it uses, what it shares) are on
:class:`ckstore.StoredSnapshot`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .engine.repository import Repository
    from .history.du import UsageRow
    from .index.sessions import HeldSession
    from .index.sharing import Shared


class UsageVerbs:
    """Disk usage, write sessions and forks of a store (docs/USAGE.md, "Disk usage")."""

    _repo: Repository

    def du(
        self, progress: Callable[[Iterable[str]], Iterable[str]] | None = None
    ) -> list[UsageRow]:
        """Disk usage: one row per run in run order, then the store-wide total (``run`` None).

        Each row has the snapshots' logical bytes, the stored bytes of the unique chunks they
        reference, the deltas among those, and (per run) the bytes only that run uses, what
        :meth:`delete_run` then :meth:`gc` free. The total row also has the bytes and number
        of packs on the backend, which include chunks nothing references any more.
        ``progress`` wraps the iteration over the packs (e.g. a progress bar). Cost: a scan of
        the chunk references and one size query per pack.
        """
        from .history.du import du as history_du  # on call: a resume does not load it

        return history_du(self._repo, progress=progress)

    def exclusive_bytes(self) -> dict[str, int]:
        """Run -> stored bytes of the chunks only that run uses (runs with none are left out):
        what deleting it (:meth:`delete_run`) and a :meth:`gc` free. A chunk another run's
        delta is stored against is not exclusive. Reads the index only (no pack sizes)."""
        return self._repo.index.exclusive_by_run()

    def sessions(self) -> list[HeldSession]:
        """The write sessions still marked active, oldest first: takes, imports and compactions
        in progress, and crashed ones whose lease has not been expired by a gc yet. Each says
        how many chunks it pins and the stored bytes it keeps from gc (chunks it pins that no
        snapshot references)."""
        return self._repo.index.held_sessions()

    def fork_sources(
        self, snapshot_ids: Sequence[str], sample: int = 32
    ) -> dict[str, list[Shared]]:
        """Where snapshots (the first of their runs, typically) forked from: for each, the
        earlier snapshots of other runs holding the ``sample`` chunks of it with the smallest
        ids (a fixed pseudo-random sample) or their delta bases, most held first
        (``Shared.chunks``; ``stored_bytes`` is 0). A snapshot with no holder maps to ``[]``.
        Cost: one bounded query per snapshot, whatever the store's size.

        Raises:
            InvalidInputError: ``sample`` is not an int from 1 to 1024.
        """
        return self._repo.index.fork_sources(snapshot_ids, sample=sample)
