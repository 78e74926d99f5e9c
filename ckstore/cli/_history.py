"""The history commands: ``log``, ``show``, ``ls``, ``diff``, ``tag`` and ``rm``.

Each ``cmd_*`` takes the parsed arguments and returns an exit code.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from typing import TYPE_CHECKING, Any

from ..errors import ConflictError, KeyNotFoundError, NotFoundError
from ..format.health import Health, describe
from . import _format as fmt
from ._common import EXIT_OK, confirmed, emit_json, open_store, usage_error

if TYPE_CHECKING:
    from ..snapshot import StoredSnapshot
    from ..store import Store


# --- log, show, ls ----------------------------------------------------------------------------
def _tags_by_snapshot(store: Store) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name, sid in store.tags().items():
        out.setdefault(sid, []).append(name)
    return out


def _where(snap: StoredSnapshot) -> str:
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
    }


def _health_cell(r: dict[str, Any]) -> str:
    """What a take found, in a few characters: ``ok``, ``NaN/Inf:3``, ``stale:2``, ``-`` (unknown)."""
    parts = []
    if r["nonfinite"]:
        parts.append(f"NaN/Inf:{r['nonfinite']}")
    if r["stale"]:
        parts.append(f"stale:{r['stale']}")
    if parts:
        return " ".join(parts)
    return "ok" if r["healthy"] else "-"


def cmd_log(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        snaps = store.log(run=args.run, limit=args.n, healthy=args.healthy)
        if args.run is not None and not snaps and args.run not in store.runs():
            runs = store.runs()
            known = ", ".join(runs[:10]) + (", ..." if len(runs) > 10 else "") if runs else "(none)"
            raise NotFoundError(f"no run {args.run!r} in store {store.url} (runs: {known})")
        tags = _tags_by_snapshot(store)
        pushed = store.push_status() if store.remotes() else None
    rows = [_snap_dict(s, tags.get(s.id, [])) for s in snaps]
    if pushed is not None:  # a store with remotes: where each snapshot is
        for s, r in zip(snaps, rows):
            r["remote"] = pushed[s.id].to_dict() if s.id in pushed else None
    if args.json:
        emit_json(rows)
        return EXIT_OK
    table: list[tuple[Any, ...]] = [
        (
            s.id[:12],
            _where(s),
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
        table = [
            (*t[:-1], (r["remote"] or {}).get("state", "-"), t[-1]) for t, r in zip(table, rows)
        ]
    print(fmt.table(headers, table, right=(3, 4)))
    return EXIT_OK


def cmd_show(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        snap = store.get(args.ref)
        d = _snap_dict(snap, _tags_by_snapshot(store).get(snap.id, []))
        d["stored_bytes"] = snap.stored_bytes()
        entries = snap.entries()
        health = snap.health
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
        ("time", fmt.when(d["created_at"])),
        ("world size", d["world_size"]),
        ("tags", ", ".join(d["tags"]) or None),
        ("manifest", d["manifest_id"]),
        ("entries", f"{d['entries']['tensors']} tensors, {d['entries']['values']} values"),
        ("logical", fmt.size(d["logical_bytes"])),
        ("stored", fmt.size(d["stored_bytes"])),
        ("new", f"{fmt.size(d['new_bytes'])} in {d['new_chunks']} new chunks"),
        ("reused", f"{d['reused_chunks']} chunks"),
        *_health_lines(health),
        *_remote_lines(d.get("remote")),
    ]
    width = max(len(k) for k, _ in lines)
    print("\n".join(f"{k + ':':<{width + 1}} {fmt.cell(v)}" for k, v in lines))
    if d["metadata"]:
        print("metadata:")
        print(textwrap.indent(json.dumps(d["metadata"], indent=2, sort_keys=True), "  "))
    return EXIT_OK


def _remote_lines(remote: dict[str, Any] | None) -> list[tuple[str, Any]]:
    """``show``'s line on where the snapshot is (stores with remotes only)."""
    if remote is None:
        return []
    held = f" (held by {', '.join(remote['remotes'])})" if remote["remotes"] else ""
    return [("remote", f"{remote['state']}{held}")]


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
            f"{len(health.stale)} tensors unchanged since step {since}: {describe(health.stale)}"
            if health.stale
            else f"none (every tensor that should train changed since step {since})"
        )
        out.append(("stale", text))
    return out


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
    print(f"{len(rows)} entries, {fmt.size(sum(r['bytes'] for r in rows))}")
    return EXIT_OK


# --- diff ---------------------------------------------------------------------------------------
_MARK = {"added": "+", "removed": "-", "changed": "M", "unchanged": " "}


def cmd_diff(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        result = store.diff(args.a, args.b, numeric=args.numeric)
    if args.json:
        emit_json(result.to_dict())
        return EXIT_OK
    d = result.to_dict()
    print(f"a: {args.a} ({d['a']['id'][:12]})  b: {args.b} ({d['b']['id'][:12]})")
    for side in ("a", "b"):
        print(f"health {side}: {_side_health(d[side]['health'])}")
    shown = [k for k in d["keys"] if args.all or k["status"] != "unchanged" or _key_health(k)]
    if shown:
        print(
            fmt.table(
                _diff_headers(args.numeric),
                [_diff_row(k, args.numeric) for k in shown],
                right=(3, 4),
            )
        )
    c, b = d["counts"], d["bytes"]
    changed = f"{fmt.size(b['changed'])}; {fmt.size(b['changed_chunk_bytes'])} in changed chunks"
    parts = [f"{c['changed']} changed ({changed})"]
    parts += [f"{c[k]} {k} ({fmt.size(b[k])})" for k in ("added", "removed", "unchanged")]
    print(", ".join(parts))
    dl = d["b_deltas"]
    if dl["chunks"]:
        print(
            f"b stores {dl['new_chunks']} chunks beyond a in {fmt.size(dl['new_stored_bytes'])}; "
            f"{dl['chunks']} are deltas: {fmt.size(dl['raw_bytes'])} raw in {fmt.size(dl['stored_bytes'])} "
            f"({fmt.size(dl['saved_bytes'])} saved)"
        )
    return EXIT_OK


def _side_health(h: dict[str, Any] | None) -> str:
    if h is None:
        return "not recorded"
    if h["nonfinite"] is None:
        out = "not measured"
    else:
        out = "ok" if h["nonfinite"] == 0 else f"UNHEALTHY: {h['nonfinite']} NaN/Inf"
    if h["stale"]:
        out += f"; stale: {describe(h['stale'])}"
    return out


def _key_health(k: dict[str, Any]) -> str:
    """The note a tensor's recorded health adds: NaN/Inf on side B, its norm a -> b."""
    a, b = k.get("health_a"), k.get("health_b")
    notes = []
    if b and (b["nan"] or b["inf"]):
        notes.append(f"NaN {b['nan']} Inf {b['inf']}")
    if k["status"] == "changed" and a and b and a["norm"] is not None and b["norm"] is not None:
        notes.append(f"norm {a['norm']:.4g} -> {b['norm']:.4g}")
    return ", ".join(notes)


def _diff_headers(numeric: bool) -> tuple[str, ...]:
    base = ("", "key", "dtype/shape", "bytes", "chunks", "note")
    return base + ("max|b-a|", "l2(b-a)", "l2(a)", "l2(b)") if numeric else base


def _diff_row(k: dict[str, Any], numeric: bool) -> tuple[Any, ...]:
    side = "a" if k["status"] == "removed" else "b"
    dtype, shape = k[f"dtype_{side}"], k[f"shape_{side}"]
    what = f"{dtype} {fmt.cell(shape)}" if dtype else k["kind"]
    chunks = ""
    if k.get("total_chunks"):
        chunks = f"{k['changed_chunks']}/{k['total_chunks']} ({k['chunk_fraction']:.0%})"
    elif k.get("chunk_fraction") is not None:
        chunks = f"{k['chunk_fraction']:.0%}"
    row: tuple[Any, ...] = (
        _MARK[k["status"]],
        k["key"],
        what,
        fmt.size(k[f"bytes_{side}"]),
        chunks,
        "; ".join(x for x in (k.get("reason"), _key_health(k)) if x),
    )
    if numeric:
        n = k.get("numeric") or {}
        row += tuple(n.get(f) for f in ("max_abs_diff", "l2_diff", "l2_a", "l2_b"))
    return row


# --- tag, rm ------------------------------------------------------------------------------------
def cmd_tag(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        if args.delete:
            return _tag_delete(store, args)
        if args.ref is None:
            return _tag_list(store, args)
        if args.name is None:
            usage_error(args, "tag needs REF and NAME (or --list, or --delete NAME)")
        from ..index import validate_name

        validate_name(args.name, "tag")
        try:
            snap = store.tag(args.ref, args.name, force=args.force)
        except ConflictError as exc:
            raise ConflictError(str(exc).replace("pass force=True", "use --force")) from exc
    if args.json:
        emit_json({"tag": args.name, "snapshot_id": snap.id, "run": snap.run, "step": snap.step})
    else:
        print(f"tagged {_where(snap)} ({snap.id[:12]}) as {args.name}")
    return EXIT_OK


def _tag_delete(store: Store, args: argparse.Namespace) -> int:
    store.untag(args.delete)
    if args.json:
        emit_json({"deleted": args.delete})
    else:
        print(f"deleted tag {args.delete}")
    return EXIT_OK


def _tag_list(store: Store, args: argparse.Namespace) -> int:
    rows: list[dict[str, Any]] = []
    for t in store.tag_records():
        snap = store.get(t.snapshot_id)
        rows.append(
            {
                "name": t.name,
                "snapshot_id": t.snapshot_id,
                "run": snap.run,
                "step": snap.step,
                "version": t.version,
                "updated_at": t.updated_at,
                "where": _where(snap),
            }
        )
    if args.json:
        emit_json([{k: v for k, v in r.items() if k != "where"} for r in rows])
    elif rows:
        print(
            fmt.table(
                ("tag", "id", "snapshot", "moved"),
                [
                    (r["name"], r["snapshot_id"][:12], r["where"], fmt.when(r["updated_at"]))
                    for r in rows
                ],
            )
        )
    return EXIT_OK


def cmd_rm(args: argparse.Namespace) -> int:
    if not args.refs and not args.runs:
        usage_error(args, "rm needs snapshots (REF ...) or --run NAME")
    if args.runs:
        if args.refs:
            usage_error(args, "give snapshots (REF ...) or --run NAME, not both")
        return _rm_runs(args)
    with open_store(args) as store:
        snaps = [store.get(ref) for ref in args.refs]  # resolve all before deleting any
        tags = _tags_by_snapshot(store)
        tagged = [(s, sorted(tags[s.id])) for s in snaps if s.id in tags]
        if tagged and not args.force:  # refuse before deleting any
            which = "; ".join(
                f"{_where(s)} ({s.id[:12]}) is tagged {', '.join(t)}" for s, t in tagged
            )
            raise ConflictError(
                f"{which}: use --force to delete tagged snapshots with their tags, or remove "
                "the tags first (`ckstore tag --delete NAME`)"
            )
        for snap in snaps:
            try:
                store.delete(snap.id, force=args.force)
            except ConflictError as exc:  # tagged since the check above
                raise ConflictError(str(exc).replace("pass force=True", "use --force")) from exc
    if args.json:
        emit_json(
            {"deleted": [s.id for s in snaps], "tags_deleted": [n for _, t in tagged for n in t]}
        )
        return EXIT_OK
    for s in snaps:
        gone = tags.get(s.id)
        also = f" and its tags {', '.join(sorted(gone))}" if gone else ""
        print(f"deleted snapshot {_where(s)} ({s.id[:12]}){also}")
    print("run `ckstore gc` to reclaim the bytes no snapshot uses any more")
    return EXIT_OK


def _rm_runs(args: argparse.Namespace) -> int:
    """``rm --run NAME``: every snapshot of each run, one transaction per run."""
    with open_store(args) as store:
        snaps = {run: store.log(run=run) for run in args.runs}
        for run, found in snaps.items():
            if not found:
                raise NotFoundError(
                    f"no run {run!r} in store {store.url} (runs: {', '.join(store.runs()) or '(none)'})"
                )
        tags = _tags_by_snapshot(store)
        tagged = {
            run: sorted(n for s in found for n in tags.get(s.id, []))
            for run, found in snaps.items()
        }
        if any(tagged.values()) and not args.force:
            which = "; ".join(f"run {r} has tags {', '.join(t)}" for r, t in tagged.items() if t)
            raise ConflictError(
                f"{which}: use --force to delete tagged snapshots with their tags, or remove the "
                "tags first (`ckstore tag --delete NAME`)"
            )
        frees = store.exclusive_bytes()
        what = ", ".join(
            f"run {r} ({len(found)} snapshots, {fmt.size(frees.get(r, 0))} only it uses"
            + (f"; tags {', '.join(tagged[r])}" if tagged[r] else "")
            + ")"
            for r, found in snaps.items()
        )
        if not confirmed(args, f"delete {what}?"):
            print("nothing deleted", file=sys.stderr)
            return EXIT_OK
        deleted = {run: store.delete_run(run, force=args.force) for run in args.runs}
    if args.json:
        emit_json({
            "runs": {r: [s.id for s in d] for r, d in deleted.items()},
            "tags_deleted": sorted(n for t in tagged.values() for n in t),
            "exclusive_bytes": {r: frees.get(r, 0) for r in deleted},
        })  # fmt: skip
        return EXIT_OK
    for run, gone in deleted.items():
        also = f" and their tags {', '.join(tagged[run])}" if tagged[run] else ""
        print(f"deleted run {run}: {len(gone)} snapshots{also}")
    print(
        f"run `ckstore gc` to reclaim the {fmt.size(sum(frees.get(r, 0) for r in deleted))} no other run uses"
    )
    return EXIT_OK
