"""TorchSnapshot's logical paths over a ckstore manifest: ``<rank>/<key>``.

TorchSnapshot names every object by the rank that saved it: ``0/model/weight``. ckstore keeps
one key per leaf (``model/weight``) and, for a value that differed between the ranks of a
distributed take, one :class:`~ckstore.format.manifest.PerRankEntry` holding every rank's
value. The TorchSnapshot view lists:

* an entry that is the same for every rank (a replicated tensor, a DTensor as one global
  tensor, a value equal everywhere, anything from a single process) once, as ``0/<key>``
  (TorchSnapshot also lists replicated entries under rank 0 only);
* a per-rank entry as ``<r>/<key>`` for every rank ``r`` of the take.

Reading ``<r>/<key>`` gives rank ``r``'s value of a per-rank entry, and the shared value of
any other entry for every ``r`` (also ranks beyond the take's world size, as TorchSnapshot
serves replicated entries to new ranks).
"""

from __future__ import annotations

from ...errors import KeyNotFoundError
from ...format.manifest import Entry, Manifest, PerRankEntry


def ranked_manifest(manifest: Manifest) -> dict[str, Entry]:
    """``<rank>/<key>`` -> entry, rank 0's first (see the module docstring)."""
    out: dict[str, Entry] = {}
    later: dict[int, dict[str, Entry]] = {}
    for key, entry in manifest.entries.items():
        if isinstance(entry, PerRankEntry):
            out[f"0/{key}"] = entry.entries[0]
            for r, own in enumerate(entry.entries[1:], start=1):
                later.setdefault(r, {})[f"{r}/{key}"] = own
        else:
            out[f"0/{key}"] = entry
    for r in sorted(later):
        out.update(later[r])
    return out


def split_rank(path: str, where: str) -> tuple[int, str]:
    """``"3/model/weight"`` -> ``(3, "model/weight")``.

    Raises:
        KeyNotFoundError: ``path`` does not start with a rank.
    """
    head, sep, rest = path.partition("/")
    if not sep or not rest or not head.isdigit():
        raise KeyNotFoundError(
            f"{where}: {path!r} is not a TorchSnapshot logical path; on a Snapshot opened by path "
            "they start with the rank that saved the object, e.g. '0/model/weight' (see "
            "get_manifest()). A Snapshot from store.get() takes plain keys ('model/weight')"
        )
    return int(head), rest
