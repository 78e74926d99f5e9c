"""The defaults of the maintenance verbs, apart from the verbs: ``Store``'s signatures need
them when ``ckstore`` opens a store, and a resume should not import gc and compaction for them."""

from __future__ import annotations

DEFAULT_KEEP_LOOSE = 1
"""Newest snapshots of each run whose chunks stay loose (a resume reads the fast form)."""

DEFAULT_GRACE_SECONDS = 6 * 3600.0
"""How old an unreferenced object must be before gc deletes it (a take may still be writing)."""

DEFAULT_REPACK_BELOW = 0.5
"""gc rewrites a pack whose live bytes are below this share of it."""
