"""Set up a two-tier store: which remote is the persistent tier, reads of evicted chunks, the
background uploader (:mod:`.uploader`), each attached to the repository's hooks."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from .. import objects
from ..errors import InvalidInputError, NotFoundError, ReadOnlyStoreError
from ..index import RemoteRecord
from . import config
from .evict import parse_size
from .tier import RemoteHandle, TierBackend
from .uploader import Uploader

if TYPE_CHECKING:
    from ..engine.interfaces import TierIndex
    from ..engine.repository import Repository

log = logging.getLogger("ckstore")

TIER_NAME = "tier"
"""The name a remote given to ``push_to`` by URL gets, when no remote has that URL yet."""


def attach_tier(
    repo: Repository,
    push_to: str,
    *,
    remote_index: str | None = None,
    remote_options: dict[str, Any] | None = None,
    local_budget: int | str | None = None,
) -> Uploader:
    """Make ``push_to`` (a remote's name, or a store URL) ``repo``'s persistent tier and start
    pushing every commit to it in the background; with ``local_budget`` (bytes, or ``"200GiB"``)
    evict pushed packs past it.

    Raises:
        NotFoundError: ``push_to`` is neither a remote's name nor a URL (a URL holds ``/`` or
            ``://``: write ``./name`` for a folder here).
        ReadOnlyStoreError: the store is open read-only.
        InvalidInputError: a bad budget, or a local path where no store can ever be (below a
            file), refused at once rather than retried.
    """
    index: TierIndex = repo.index
    if repo.read_only:
        raise ReadOnlyStoreError(f"cannot push from {repo.url}: {index.read_only}")
    budget = None if local_budget is None else parse_size(local_budget)
    remote, session_options = resolve(repo, push_to, remote_index, remote_options)
    index.set_remote_tier(remote.name, True)
    tier = install_reads(repo)
    handle = RemoteHandle(repo, remote, session_options)
    tier.use(handle)
    uploader = Uploader(repo, handle, tier, budget)
    repo.after_commit.append(lambda record: uploader.kick())
    repo.before_close.insert(0, uploader.close)  # pushes what is pending before anything closes
    if uploader.pending() or budget is not None:
        uploader.kick()  # what an earlier process left unpushed
    return uploader


def resolve(
    repo: Repository, push_to: str, remote_index: str | None, remote_options: dict[str, Any] | None
) -> tuple[RemoteRecord, dict[str, Any]]:
    """The remote ``push_to`` names: a remote's name, or a URL (a remote with that URL, else a
    new remote named :data:`TIER_NAME`); and the storage options for this process only. A new
    remote keeps ``remote_options`` but their credentials, which serve this process alone (the
    index is plain text); an existing one keeps what it has, and ``remote_options`` are laid
    over it for this process."""
    index: TierIndex = repo.index
    if not isinstance(push_to, str) or not push_to:
        raise InvalidInputError(f"push_to must be a remote's name or a store URL, got {push_to!r}")
    given = dict(remote_options or {})
    found = index.get_remote(push_to)
    if found is not None:
        return found, given
    if "/" not in push_to and "://" not in push_to:
        config.get(index, push_to)  # raises NotFoundError listing the remotes there are
    known = config.by_url(index, push_to)
    if known is not None:
        return known, given
    if index.get_remote(TIER_NAME) is not None:
        raise NotFoundError(
            f"no remote has the URL {push_to!r}, and the name {TIER_NAME!r} is taken: add it under a name "
            f"(`ckstore remote add NAME {push_to}`) and pass push_to=NAME"
        )
    kept, secret = config.split_credentials(given)
    if secret:
        log.info(
            "ckstore: remote %r keeps its storage options but the credentials (%s), which serve "
            "this process only: %s",
            TIER_NAME,
            ", ".join(config.credentials_in(secret)),
            config.HOW_TO_PASS_CREDENTIALS,
        )
    record = config.add(index, TIER_NAME, push_to, remote_index=remote_index, options=kept or None)
    return record, secret


def install_reads(repo: Repository) -> TierBackend:
    """Wrap ``repo``'s backend so reads of evicted chunks go to their remote (idempotent)."""
    backend = repo.objects.backend
    if isinstance(backend, TierBackend):
        return backend
    tier = TierBackend(backend, repo)
    repo.objects = objects.ObjectStore(tier)
    return tier
