"""The ``ckstore`` command line (git-like subcommands).

Every command finds its store from ``--store URL``, then ``$CKSTORE_STORE``, then the nearest
directory upwards from the current one that holds ``ckstore.json``. Read commands print aligned
tables for people and, with ``--json``, one JSON document for scripts.

Exit codes: 0 success, 1 ``check`` found problems, 2 usage error (bad arguments or names),
3 not found (ref, key, tag or store), 4 conflict (tag exists, store exists, lease lost),
5 corruption (damaged or missing stored data), 6 any other ckstore error. Every ckstore error is
printed as one line, ``ckstore: error: <message>``, on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from . import _format as fmt
from .errors import (
    CkstoreError,
    ConflictError,
    CorruptionError,
    InvalidInputError,
    KeyNotFoundError,
    NotFoundError,
    ObjectNotFoundError,
)

EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_CONFLICT, EXIT_CORRUPT, EXIT_ERROR = range(
    7
)
STORE_ENV = "CKSTORE_STORE"
CONFIG_NAME = "ckstore.json"

Handler = Callable[[argparse.Namespace], int]


# --- finding and opening the store ------------------------------------------------------------
def find_store(explicit: str | None, cwd: str | None = None) -> str:
    """``--store``, then ``$CKSTORE_STORE``, then the nearest directory upwards with ckstore.json.

    Raises:
        NotFoundError: None of them names a store.
    """
    if explicit:
        return explicit
    if os.environ.get(STORE_ENV):
        return os.environ[STORE_ENV]
    d = os.path.abspath(cwd or os.getcwd())
    while True:
        if os.path.isfile(os.path.join(d, CONFIG_NAME)):
            return d
        parent = os.path.dirname(d)
        if parent == d:
            raise NotFoundError(
                f"no ckstore store here or in any parent directory: pass --store URL, set "
                f"${STORE_ENV}, or create one with `ckstore init`"
            )
        d = parent


def open_store(args: argparse.Namespace) -> Any:
    import ckstore

    return ckstore.open(find_store(args.store), index=args.index, create=False)


def emit_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=str))


# --- log, show, ls ----------------------------------------------------------------------------
def _tags_by_snapshot(store: Any) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name, sid in store.tags().items():
        out.setdefault(sid, []).append(name)
    return out


def _where(snap: Any) -> str:
    if snap.name:
        return snap.name
    return f"{snap.run}@{snap.step}" if snap.step is not None else snap.run


def _snap_dict(snap: Any, tags: list[str]) -> dict[str, Any]:
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
    }


def cmd_log(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        snaps = store.log(run=args.run, limit=args.n)
        tags = _tags_by_snapshot(store)
    rows = [_snap_dict(s, tags.get(s.id, [])) for s in snaps]
    if args.json:
        emit_json(rows)
        return EXIT_OK
    table = [
        (
            s.id[:12],
            _where(s),
            fmt.when(s.created_at),
            fmt.size(r["logical_bytes"]),
            fmt.size(r["new_bytes"]),
            ", ".join(r["tags"]),
        )
        for s, r in zip(snaps, rows)
    ]
    print(fmt.table(("id", "snapshot", "time", "logical", "new", "tags"), table, right=(3, 4)))
    return EXIT_OK


def cmd_show(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        snap = store.get(args.ref)
        d = _snap_dict(snap, _tags_by_snapshot(store).get(snap.id, []))
        d["stored_bytes"] = store.index.stored_bytes(snap.id)
        entries = _entries(snap)
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
    ]
    width = max(len(k) for k, _ in lines)
    print("\n".join(f"{k + ':':<{width + 1}} {fmt.cell(v)}" for k, v in lines))
    if d["metadata"]:
        print("metadata:")
        print(textwrap.indent(json.dumps(d["metadata"], indent=2, sort_keys=True), "  "))
    return EXIT_OK


def _entries(snap: Any) -> list[Any]:
    """The snapshot's entry records from the index (the manifest only if the index lacks them)."""
    records = snap.store.index.entries(snap.record.manifest_id)
    if records:
        return list(records)
    from .index import EntryRecord
    from .manifest import entry_digest

    return [
        EntryRecord(k, e.kind, e.dtype, e.shape, e.nbytes, entry_digest(e))
        for k, e in snap.get_manifest().items()
    ]


def cmd_ls(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        snap = store.get(args.ref)
        entries = [e for e in _entries(snap) if e.key.startswith(args.prefix or "")]
    if args.prefix and not entries:
        raise KeyNotFoundError(f"no key starts with {args.prefix!r} in snapshot {snap.ref}")
    rows = [
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
    shown = [k for k in d["keys"] if args.all or k["status"] != "unchanged"]
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
    return EXIT_OK


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
        k.get("reason") or "",
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
        from .index import validate_name

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


def _tag_delete(store: Any, args: argparse.Namespace) -> int:
    store.untag(args.delete)
    if args.json:
        emit_json({"deleted": args.delete})
    else:
        print(f"deleted tag {args.delete}")
    return EXIT_OK


def _tag_list(store: Any, args: argparse.Namespace) -> int:
    rows = []
    for t in store.index.list_tags():
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
    with open_store(args) as store:
        snaps = [store.get(ref) for ref in args.refs]  # resolve all before deleting any
        for snap in snaps:
            store.delete(snap.id)
    if args.json:
        emit_json({"deleted": [s.id for s in snaps]})
    else:
        for s in snaps:
            print(f"deleted snapshot {_where(s)} ({s.id[:12]})")
        print("run `ckstore gc` to reclaim the bytes no snapshot uses any more")
    return EXIT_OK


# --- gc, check, du ------------------------------------------------------------------------------
def gc_policy(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of ``store.gc`` that the options given ask for."""
    policy: dict[str, Any] = {"dry_run": args.dry_run, "keep_tagged": not args.no_keep_tagged}
    for opt, key in (
        ("keep_last", "keep_last"),
        ("keep_every_steps", "keep_every_steps"),
        ("older_than", "older_than"),
        ("runs", "runs"),
        ("grace", "grace_seconds"),
        ("repack_below", "repack_below"),
    ):
        value = getattr(args, opt)
        if value is not None:
            policy[key] = value
    return policy


def cmd_gc(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        report = store.gc(**gc_policy(args))
    print_report(report.to_dict(), args.json)
    return EXIT_OK


def cmd_check(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        report = store.check(read_data=args.read_data, progress=lambda it: fmt.progress(it, "packs"))
    print_report(report.to_dict(), args.json)
    return EXIT_OK if report.ok else EXIT_PROBLEMS


def print_report(d: dict[str, Any], as_json: bool) -> None:
    """A report's ``to_dict()``: JSON, or ``key: value`` lines (sizes made human)."""
    if as_json:
        emit_json(d)
    else:
        print("\n".join(_report_lines(d, "")))


def _report_lines(d: dict[str, Any], indent: str) -> list[str]:
    lines = []
    for key, value in d.items():
        if isinstance(value, dict):
            lines += [f"{indent}{key}:"] + _report_lines(value, indent + "  ")
        elif (
            isinstance(value, (list, tuple))
            and value
            and not all(isinstance(v, (int, float, str)) for v in value)
        ):
            lines.append(f"{indent}{key}: {len(value)}")
            lines += [f"{indent}  - {json.dumps(v, default=str)}" for v in value[:50]]
        elif isinstance(value, (list, tuple)):
            more = ", ..." if len(value) > 10 else ""
            lines.append(
                f"{indent}{key}: {len(value)}"
                + (f" ({', '.join(str(v)[:12] for v in value[:10])}{more})" if value else "")
            )
        elif "bytes" in key and isinstance(value, int):
            lines.append(f"{indent}{key}: {fmt.size(value)}")
        else:
            lines.append(f"{indent}{key}: {fmt.cell(value)}")
    return lines


def cmd_reindex(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        report = store.reindex()
    print_report(report.to_dict(), args.json)
    return EXIT_OK if not report.skipped else EXIT_PROBLEMS


def cmd_du(args: argparse.Namespace) -> int:
    from ._du import du

    with open_store(args) as store:
        rows = du(store, progress=lambda it: fmt.progress(it, "packs"))
    if args.json:
        emit_json({"runs": [r.to_dict() for r in rows[:-1]], "total": rows[-1].to_dict()})
        return EXIT_OK
    table = [
        (
            r.run if r.run is not None else "(total)",
            r.snapshots,
            fmt.size(r.logical_bytes),
            fmt.size(r.stored_bytes),
            r.chunks,
            fmt.ratio(r.dedup_ratio),
        )
        for r in rows
    ]
    print(
        fmt.table(
            ("run", "snapshots", "logical", "stored", "chunks", "ratio"),
            table,
            right=(1, 2, 3, 4, 5),
        )
    )
    total = rows[-1]
    print(f"packs on the backend: {total.packs}, {fmt.size(total.pack_bytes)}")
    return EXIT_OK


# --- init, migrate, demo ------------------------------------------------------------------------
def cmd_init(args: argparse.Namespace) -> int:
    import ckstore

    from .store import is_local, local_path

    url = args.url or args.store or "."
    if is_local(url) and os.path.isfile(os.path.join(local_path(url), CONFIG_NAME)):
        raise ConflictError(f"a ckstore store already exists at {local_path(url)}")
    knobs = {
        "chunk_bytes": args.chunk_bytes,
        "pack_bytes": args.pack_bytes,
        "inline_bytes": args.inline_bytes,
    }
    with ckstore.open(url, index=args.index, **knobs) as store:
        cfg = store.config
        info = {
            "url": store.url,
            "index": store.index.url,
            "store_id": cfg.store_id,
            "chunk_bytes": cfg.chunk_bytes,
            "pack_bytes": cfg.pack_bytes,
            "inline_bytes": cfg.inline_bytes,
        }
    if args.json:
        emit_json(info)
    else:
        knobs = f"chunks {fmt.size(cfg.chunk_bytes)}, packs {fmt.size(cfg.pack_bytes)}"
        knobs += f", inline up to {fmt.size(cfg.inline_bytes)}"
        print(f"initialized empty ckstore store at {info['url']} ({knobs})")
    return EXIT_OK


def cmd_migrate(args: argparse.Namespace) -> int:
    from .index import upgrade
    from .store import default_index_url

    url = args.index or default_index_url(find_store(args.store))
    revision = upgrade(url)
    if args.json:
        emit_json({"index": url, "revision": revision})
    else:
        print(f"index {url} is at schema revision {revision}")
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    from . import demo as demo_mod

    return demo_mod.main(args.store or "./demo-store", steps=args.steps, every=args.every)


# --- the parser ---------------------------------------------------------------------------------
class Parser(argparse.ArgumentParser):
    """argparse that reports usage errors as ONE line and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"ckstore: error: {message} (see `{self.prog} --help`)\n")


def usage_error(args: argparse.Namespace, message: str) -> NoReturn:
    args.parser.error(message)


def _size_arg(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    mult = units.get(t[-1:], 1)
    try:
        return int(float(t[:-1] if t[-1:] in units else t) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a size: {text!r} (use e.g. 4MiB, 512KiB, 1048576)"
        ) from None


def _duration_arg(text: str) -> float:
    try:
        return fmt.parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _fraction(zero_ok: bool) -> Callable[[str], float]:
    """An argparse type for a fraction in (0, 1], or [0, 1] when ``zero_ok``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = -1.0
        if not (0 <= value <= 1 and (zero_ok or value > 0)):
            raise argparse.ArgumentTypeError(f"fraction must be in {'[' if zero_ok else '('}0, 1], got {text!r}")
        return value

    return parse


_fraction_arg = _fraction(zero_ok=False)
_unit_fraction = _fraction(zero_ok=True)


def _nonneg_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


def _common(suppress: bool) -> argparse.ArgumentParser:
    """Options every command takes, before or after its name."""
    p = argparse.ArgumentParser(add_help=False)
    kw: dict[str, Any] = {"default": argparse.SUPPRESS} if suppress else {}
    p.add_argument(
        "--store",
        metavar="URL",
        help=f"store URL (default: ${STORE_ENV}, then the nearest store upwards)",
        **kw,
    )
    p.add_argument(
        "--index",
        metavar="URL",
        help="SQLAlchemy URL of the index (needed for remote stores)",
        **kw,
    )
    p.add_argument("--json", action="store_true", help="print machine-readable JSON", **kw)
    return p


COMMANDS: list[tuple[str, str, tuple[str, ...], Handler]] = [
    ("init", "create a store", (
        "ckstore init ./ckpts",
        "ckstore init ./ckpts --chunk-bytes 8MiB",
        "ckstore init s3://bucket/ckpts --index postgresql+psycopg://user@host/db",
    ), cmd_init),
    ("log", "list snapshots, newest first", (
        "ckstore log", "ckstore log --run sft -n 5", "ckstore log --json",
    ), cmd_log),
    ("show", "show one snapshot: ids, metadata, stats", (
        "ckstore show sft", "ckstore show sft@100 --json", "ckstore show best",
    ), cmd_show),
    ("ls", "list a snapshot's entries (kind, dtype, shape, bytes)", (
        "ckstore ls sft@100", "ckstore ls best model/ --json",
    ), cmd_ls),
    ("diff", "compare two snapshots key by key", (
        "ckstore diff sft@100 sft@200",
        "ckstore diff base best --numeric",
        "ckstore diff sft@100 best --json",
    ), cmd_diff),
    ("tag", "create, move, list or delete tags", (
        "ckstore tag sft@100 best",
        "ckstore tag sft best --force",
        "ckstore tag --list",
        "ckstore tag --delete best",
    ), cmd_tag),
    ("rm", "delete snapshots (gc reclaims their bytes)", (
        "ckstore rm sft@100", "ckstore rm sft@100 sft@200",
    ), cmd_rm),
    ("gc", "apply a retention policy and reclaim unreferenced data", (
        "ckstore gc --dry-run",
        "ckstore gc --keep-last 3 --older-than 7d",
        "ckstore gc --run sft --keep-every-steps 1000 --json",
    ), cmd_gc),
    ("check", "verify the store's integrity (exit 1 on problems)", (
        "ckstore check", "ckstore check --read-data", "ckstore check --read-data 0.1 --json",
    ), cmd_check),
    ("du", "disk usage per run: logical vs stored bytes", (
        "ckstore du", "ckstore du --json",
    ), cmd_du),
    ("reindex", "rebuild an empty index from the store's packs and manifests", (
        "ckstore reindex", "ckstore --store s3://bucket/ckpts --index postgresql+psycopg://u@h/new reindex",
    ), cmd_reindex),
    ("migrate", "upgrade the index schema to this ckstore's version", (
        "ckstore migrate", "ckstore migrate --index postgresql+psycopg://user@host/db",
    ), cmd_migrate),
    ("demo", "train a small model, snapshot it, resume bit-exactly in a fresh process", (
        "ckstore --store ./demo-store demo", "ckstore demo --steps 20 --every 2",
    ), cmd_demo),
]  # fmt: skip


def _add_arguments(name: str, p: argparse.ArgumentParser) -> None:
    if name == "init":
        p.add_argument(
            "url",
            nargs="?",
            help="where to create it (default: --store, else the current directory)",
        )
        p.add_argument("--chunk-bytes", type=_size_arg, help="target chunk size (default 4MiB)")
        p.add_argument("--pack-bytes", type=_size_arg, help="target pack size (default 64MiB)")
        p.add_argument(
            "--inline-bytes",
            type=_size_arg,
            help="tensors up to this size live in the manifest (default 2KiB)",
        )
    elif name == "log":
        p.add_argument("--run", help="only this run")
        p.add_argument("-n", type=_nonneg_int, metavar="N", help="at most N snapshots")
    elif name == "show":
        p.add_argument("ref", help="tag, run (its latest), run@step, snapshot name or id prefix")
    elif name == "ls":
        p.add_argument("ref", help="tag, run (its latest), run@step, snapshot name or id prefix")
        p.add_argument("prefix", nargs="?", help="only keys starting with this")
    elif name == "diff":
        p.add_argument("a", help="the old snapshot (a ref)")
        p.add_argument("b", help="the new snapshot (a ref)")
        p.add_argument(
            "--numeric",
            action="store_true",
            help="read changed chunks and report value differences",
        )
        p.add_argument("--all", action="store_true", help="also list unchanged keys")
    elif name == "tag":
        p.add_argument("ref", nargs="?", help="snapshot to tag")
        p.add_argument("name", nargs="?", help="tag name")
        p.add_argument("--force", "-f", action="store_true", help="move the tag if it exists")
        g = p.add_mutually_exclusive_group()
        g.add_argument(
            "--list", "-l", action="store_true", help="list tags (the default without arguments)"
        )
        g.add_argument("--delete", "-d", metavar="NAME", help="delete a tag")
    elif name == "rm":
        p.add_argument("refs", nargs="+", metavar="REF", help="snapshots to delete")
    elif name == "gc":
        p.add_argument(
            "--keep-last",
            type=_nonneg_int,
            metavar="N",
            help="keep the newest N snapshots of each run",
        )
        p.add_argument(
            "--keep-every-steps",
            type=_nonneg_int,
            metavar="N",
            help="keep snapshots whose step is a multiple of N",
        )
        p.add_argument(
            "--older-than",
            type=_duration_arg,
            metavar="DURATION",
            help="only delete snapshots older than this (e.g. 7d, 12h)",
        )
        p.add_argument(
            "--run",
            dest="runs",
            action="append",
            metavar="R",
            help="apply the policy to this run only (repeatable)",
        )
        p.add_argument(
            "--no-keep-tagged",
            action="store_true",
            help="tagged snapshots are not kept automatically",
        )
        p.add_argument(
            "--grace",
            type=_duration_arg,
            metavar="DURATION",
            help="leave unreferenced data younger than this",
        )
        p.add_argument(
            "--repack-below",
            type=_unit_fraction,
            metavar="FRACTION",
            help="rewrite packs whose live bytes fell below this fraction (0 disables)",
        )
        p.add_argument(
            "--dry-run", "-n", action="store_true", help="say what would be deleted, delete nothing"
        )
    elif name == "check":
        p.add_argument(
            "--read-data",
            nargs="?",
            const=True,
            default=False,
            type=_fraction_arg,
            metavar="FRACTION",
            help="also read and re-hash chunks (all, or this random fraction)",
        )
    elif name == "demo":
        p.add_argument("--steps", type=int, default=40)
        p.add_argument("--every", type=int, default=5)


def build_parser() -> argparse.ArgumentParser:
    fmt_cls = argparse.RawDescriptionHelpFormatter
    p = Parser(
        prog="ckstore",
        parents=[_common(False)],
        formatter_class=fmt_cls,
        description="Content-addressed, versioned, deduplicating checkpoint store for PyTorch.",
        epilog=textwrap.dedent((__doc__ or "\n\n").split("\n\n", 1)[1])
        + "\nexamples:\n  ckstore init ./ckpts\n  ckstore log --run sft\n"
        "  ckstore diff sft@100 best --numeric\n  ckstore gc --keep-last 3 --dry-run",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)
    for name, help_, examples, func in COMMANDS:
        sp = sub.add_parser(
            name,
            help=help_,
            description=help_[0].upper() + help_[1:] + ".",
            epilog="examples:\n" + "\n".join(f"  {e}" for e in examples),
            formatter_class=fmt_cls,
            parents=[_common(True)],
        )
        _add_arguments(name, sp)
        sp.set_defaults(func=func, parser=sp)
    return p


def exit_code(exc: CkstoreError) -> int:
    """The process exit code for a ckstore error."""
    if isinstance(exc, (CorruptionError, ObjectNotFoundError)):
        return EXIT_CORRUPT
    if isinstance(exc, NotFoundError):
        return EXIT_NOT_FOUND
    if isinstance(exc, ConflictError):
        return EXIT_CONFLICT
    if isinstance(exc, InvalidInputError):
        return EXIT_USAGE
    return EXIT_ERROR


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except CkstoreError as exc:
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"ckstore: error: {message}", file=sys.stderr)
        return exit_code(exc)
    except BrokenPipeError:  # e.g. `ckstore log | head`
        sys.stderr.close()
        return EXIT_OK
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
