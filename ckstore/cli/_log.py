"""What the store holds: ``log`` lists snapshots, ``show`` one snapshot, ``ls`` its entries.

Each command is one record (``cli/_command.py``) beside its handler.
"""

from __future__ import annotations

import argparse
import json
import textwrap
from typing import TYPE_CHECKING, Any

from ..errors import KeyNotFoundError
from ..format.health import Health, describe
from . import _format as fmt
from ._args import REF_HELP, nonneg_int
from ._command import Command
from ._common import EXIT_OK, check_runs, emit_json, open_store

if TYPE_CHECKING:
    from ..snapshot import StoredSnapshot
    from ..store import Store


def tags_by_snapshot(store: Store) -> dict[str, list[str]]:
    """Snapshot id -> the names of the tags at it."""
    out: dict[str, list[str]] = {}
    for name, sid in store.tags().items():
        out.setdefault(sid, []).append(name)
    return out


def snapshot_label(snap: StoredSnapshot) -> str:
    """How the tables name a snapshot: its name, else ``run@step``, else its run."""
    if snap.name:
        return snap.name
    return f"{snap.run}@{snap.step}" if snap.step is not None else snap.run


def _snap_dict(snap: StoredSnapshot, tags: list[str]) -> dict[str, Any]:
    return {
        "id": snap.id,
        "run": snap.run,
        "step": snap.step,
        "name": snap.name,
        "parent_id": snap.parent_id,
        "created_at": snap.created_at,
        "world_size": snap.record.world_size,
        "manifest_id": snap.record.manifest_id,
        "tags": sorted(tags),
        "metadata": snap.metadata,
        **snap.stats,
        "healthy": snap.healthy,
        "nonfinite": snap.record.nonfinite,
        "stale": snap.record.stale,
        "diverged": snap.record.diverged,
    }


def _health_cell(r: dict[str, Any]) -> str:
    """What a take found, in a few characters: ``ok``, ``NaN/Inf:3``, ``stale:2``,
    ``diverged:1`` (replicas that disagree between ranks), ``-`` (unknown)."""
    parts = []
    if r["nonfinite"]:
        parts.append(f"NaN/Inf:{r['nonfinite']}")
    if r["stale"]:
        parts.append(f"stale:{r['stale']}")
    if r["diverged"]:
        parts.append(f"diverged:{r['diverged']}")
    if parts:
        return " ".join(parts)
    return "ok" if r["healthy"] else "-"


def cmd_log(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        snaps = store.log(run=args.run, limit=args.n, healthy=args.healthy)
        if args.run is not None and not snaps:
            check_runs(store, [args.run])
        tags = tags_by_snapshot(store)
        pushed = store.push_status() if store.remotes() else None
    rows = [_snap_dict(s, tags.get(s.id, [])) for s in snaps]
    seen: set[tuple[str, int]] = set()
    for s, r in zip(reversed(snaps), reversed(rows)):  # oldest first: the later ones re-save
        r["resave"] = s.step is not None and (s.run, s.step) in seen
        if s.step is not None:
            seen.add((s.run, s.step))
    if pushed is not None:  # a store with remotes: where each snapshot is
        for s, r in zip(snaps, rows):
            r["remote"] = pushed[s.id].to_dict() if s.id in pushed else None
    if args.json:
        emit_json(rows)
        return EXIT_OK
    table: list[tuple[Any, ...]] = [
        (
            s.id[:12],
            snapshot_label(s) + (" (re-save)" if r["resave"] else ""),
            fmt.when(s.created_at),
            fmt.size(r["logical_bytes"]),
            fmt.size(r["new_bytes"]),
            _health_cell(r),
            ", ".join(r["tags"]),
        )
        for s, r in zip(snaps, rows)
    ]
    headers: tuple[str, ...] = ("id", "snapshot", "time", "logical", "new", "health", "tags")
    if pushed is not None:
        headers = (*headers[:-1], "remote", headers[-1])
        table = [(*t[:-1], where(r["remote"]), t[-1]) for t, r in zip(table, rows)]
    print(fmt.table(headers, table, right=(3, 4)))
    return EXIT_OK


def _log_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", help="only this run")
    p.add_argument("-n", type=nonneg_int, metavar="N", help="at most N snapshots")
    p.add_argument(
        "--healthy",
        action="store_true",
        help="only healthy snapshots: no NaN or Inf, no stale tensor, no replicas that disagree "
        "(those without a health record are left out)",
    )


LOG = Command(
    "log",
    "list snapshots, newest first, with what their takes found (health)",
    (
        "ckstore log",
        "ckstore log --run sft -n 5",
        "ckstore log --run sft --healthy",
        "ckstore log --json",
    ),
    cmd_log,
    _log_arguments,
)


def cmd_show(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        snap = store.get(args.ref)
        d = _snap_dict(snap, tags_by_snapshot(store).get(snap.id, []))
        d["stored_bytes"] = snap.stored_bytes()
        entries = snap.entries()
        health = snap.health
        fork = snap.forked_from
        d["forked_from"] = fork
        source = store.get(fork, None) if fork else None
        if store.remotes():
            status = store.push_status().get(snap.id)
            d["remote"] = None if status is None else status.to_dict()
    d["health"] = None if health is None else health.to_dict()
    d["entries"] = {
        "tensors": sum(e.kind == "tensor" for e in entries),
        "values": sum(e.kind != "tensor" for e in entries),
    }
    if args.json:
        emit_json(d)
        return EXIT_OK
    lines = [
        ("snapshot", d["id"]),
        ("run", d["run"]),
        ("step", d["step"]),
        ("name", d["name"]),
        ("parent", d["parent_id"]),
        *(
            [("forked from", f"{source.ref}" if source else f"{fork} (no longer in the store)")]
            if fork
            else []
        ),
        ("time", fmt.when(d["created_at"])),
        ("world size", d["world_size"]),
        ("tags", ", ".join(d["tags"]) or None),
        ("manifest", d["manifest_id"]),
        (
            "entries",
            f"{fmt.count(d['entries']['tensors'], 'tensor')}, "
            f"{fmt.count(d['entries']['values'], 'value')}",
        ),
        ("logical", fmt.size(d["logical_bytes"])),
        ("stored", fmt.size(d["stored_bytes"])),
        ("new", f"{fmt.size(d['new_bytes'])} in {fmt.count(d['new_chunks'], 'new chunk')}"),
        ("reused", fmt.count(d["reused_chunks"], "chunk")),
        *_health_lines(health),
        *_remote_lines(d.get("remote")),
    ]
    width = max(len(k) for k, _ in lines)
    print("\n".join(f"{k + ':':<{width + 1}} {fmt.cell(v)}" for k, v in lines))
    if d["metadata"]:
        print("metadata:")
        print(textwrap.indent(json.dumps(d["metadata"], indent=2, sort_keys=True), "  "))
    return EXIT_OK


def _show_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("ref", help=REF_HELP)


SHOW = Command(
    "show",
    "show one snapshot: ids, metadata, stats, health",
    (
        "ckstore show sft",
        "ckstore show sft@100 --json",
        "ckstore show best",
        "ckstore show sft@healthy",
    ),
    cmd_show,
    _show_arguments,
    completes=("ref",),
)


def _remote_lines(remote: dict[str, Any] | None) -> list[tuple[str, Any]]:
    """``show``'s line on where the snapshot is (stores with remotes only)."""
    if remote is None:
        return []
    return [("remote", where(remote))]


def where(remote: dict[str, Any] | None) -> str:
    """Where a snapshot is, as people read it: ``at origin`` (held by those remotes, whether
    this store pushed it there or pulled it from there: a clone's snapshots are not
    "pushed"), ``pushing`` (its tier does not hold it yet), ``local``; ``--json`` keeps the
    state's name (``pushed``, ``pushing``, ``local``)."""
    if remote is None:
        return "-"
    if remote["state"] == "pushing":
        held = f"; at {', '.join(remote['remotes'])}" if remote["remotes"] else ""
        return f"pushing{held}"
    if remote["remotes"]:
        return f"at {', '.join(remote['remotes'])}"
    return str(remote["state"])


def _health_lines(health: Health | None) -> list[tuple[str, Any]]:
    """``show``'s lines on what the take found."""
    if health is None:
        return [("health", "not recorded (taken before ckstore recorded health)")]
    out: list[tuple[str, Any]] = []
    if health.tensors is None:
        out.append(("health", "not measured (health=False)"))
    elif health.nonfinite:
        out.append(
            ("health", f"UNHEALTHY: {health.nonfinite} NaN/Inf in {describe(health.bad_keys)}")
        )
    else:
        out.append(("health", f"ok: no NaN or Inf in {len(health.tensors)} floating-point tensors"))
    if health.stale is not None:
        since = (health.stale_base or {}).get("step")
        text = (
            f"{fmt.count(len(health.stale), 'tensor')} unchanged since step {since}: "
            f"{describe(health.stale)}"
            if health.stale
            else f"none (every tensor that should train changed since step {since})"
        )
        out.append(("stale", text))
    if health.replicas is not None:
        out.append(("replicas", _replica_text(health)))
    return out


def _replica_text(health: Health) -> str:
    """``show``'s line on the replicated tensors the take compared between ranks."""
    assert health.replicas is not None
    diverged = health.diverged
    if not diverged:
        return f"ok: {health.replicas.checked} replicated tensors equal on every rank holding them"
    parts = []
    for key, d in list(diverged.items())[:6]:
        where = ", ".join(f"{list(o)}+{list(s)}" for o, s in d.regions[:2])
        more = f" and {d.region_count - 2} more" if d.region_count > 2 else ""
        parts.append(f"{key} (rank {', '.join(map(str, d.ranks))} at {where}{more})")
    rest = f"; and {len(diverged) - 6} more" if len(diverged) > 6 else ""
    return (
        f"DIVERGED: {len(diverged)} of {health.replicas.checked} replicated tensors differ "
        f"between ranks: {'; '.join(parts)}{rest}"
    )


def cmd_ls(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        snap = store.get(args.ref)
        entries = [e for e in snap.entries() if e.key.startswith(args.prefix or "")]
    if args.prefix and not entries:
        raise KeyNotFoundError(f"no key starts with {args.prefix!r} in snapshot {snap.ref}")
    rows: list[dict[str, Any]] = [
        {
            "key": e.key,
            "kind": e.kind,
            "dtype": e.dtype,
            "shape": None if e.shape is None else list(e.shape),
            "bytes": e.nbytes,
        }
        for e in entries
    ]
    if args.json:
        emit_json(rows)
        return EXIT_OK
    table = [(r["key"], r["kind"], r["dtype"], r["shape"], fmt.size(r["bytes"])) for r in rows]
    print(fmt.table(("key", "kind", "dtype", "shape", "bytes"), table, right=(4,)))
    print(f"{fmt.count(len(rows), 'entry', 'entries')}, {fmt.size(sum(r['bytes'] for r in rows))}")
    return EXIT_OK


def _ls_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("ref", help=REF_HELP)
    p.add_argument("prefix", nargs="?", help="only keys starting with this")


LS = Command(
    "ls",
    "list a snapshot's entries (kind, dtype, shape, bytes)",
    ("ckstore ls sft@100", "ckstore ls best model/ --json"),
    cmd_ls,
    _ls_arguments,
    completes=("ref", "key"),
)
