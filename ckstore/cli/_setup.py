"""The setup commands: ``init`` creates a store, ``demo`` walks through one end to end.

Each command is one record (``cli/_command.py``) beside its handler. Neither leaves a surprise
behind: a failed ``init`` removes what it made, and the demo writes only into a new or empty
folder, or a store an earlier demo made (marked by :data:`DEMO_MARK`), never into anything else.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

from ..errors import CkstoreError, ConflictError, InvalidInputError
from . import _format as fmt
from ._args import size_arg
from ._command import Command
from ._common import CONFIG_NAME, EXIT_OK, STORE_ENV, emit_json, storage_options, usage_error

DEMO_STORE = "./demo-store"
"""Where ``ckstore demo`` puts its store unless ``--store`` says otherwise."""
DEMO_MARK = "CKSTORE-DEMO"
"""A file in the root of a store the demo made: the next demo may replace that store."""


# --- init ---------------------------------------------------------------------------------------
def cmd_init(args: argparse.Namespace) -> int:
    import ckstore

    from ..index import make_engine

    url = args.url or args.store or "."
    if args.index:
        make_engine(args.index).dispose()  # a malformed index URL fails before anything is made
    opts = storage_options(args)
    undo = _undo_init(url, opts)
    knobs = {
        "chunk_bytes": args.chunk_bytes,
        "pack_bytes": args.pack_bytes,
        "inline_bytes": args.inline_bytes,
    }
    try:
        with ckstore.open(
            url, index=args.index, storage_options=opts, create=True, **knobs
        ) as store:
            cfg = store.config
            info = {
                "url": store.url,
                "index": store.index_url,
                "store_id": cfg.store_id,
                "chunk_bytes": cfg.chunk_bytes,
                "pack_bytes": cfg.pack_bytes,
                "inline_bytes": cfg.inline_bytes,
            }
    except BaseException:
        try:
            undo()
        except (CkstoreError, OSError):  # best effort: the error that stopped init is the news
            pass
        raise
    if args.json:
        emit_json(info)
    else:
        sizes = f"chunks {fmt.size(cfg.chunk_bytes)}, packs {fmt.size(cfg.pack_bytes)}"
        sizes += f", inline up to {fmt.size(cfg.inline_bytes)}"
        print(f"initialized empty ckstore store at {info['url']} ({sizes})")
    return EXIT_OK


def _init_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "url",
        nargs="?",
        help="where to create it (default: --store, else the current directory)",
    )
    p.add_argument("--chunk-bytes", type=size_arg, help="target chunk size (default 4MiB)")
    p.add_argument("--pack-bytes", type=size_arg, help="target pack size (default 64MiB)")
    p.add_argument(
        "--inline-bytes",
        type=size_arg,
        help="tensors up to this size live in the manifest (default 2KiB)",
    )


INIT = Command(
    "init",
    "create a store",
    (
        "ckstore init ./ckpts",
        "ckstore init ./ckpts --chunk-bytes 8MiB",
        "ckstore init s3://bucket/ckpts --index postgresql+psycopg://user@host/db",
    ),
    cmd_init,
    _init_arguments,
    completes=("file",),
)


def _undo_init(url: str, opts: dict[str, Any]) -> Callable[[], None]:
    """Refuse an existing store; return what removes everything ``init`` is about to make."""
    import shutil  # here: it loads bz2 and lzma, which the read commands do without

    from .. import objects
    from ..engine.opening import is_local, local_path

    if not is_local(url):
        backend = objects.open_backend(url, opts)
        if backend.exists(CONFIG_NAME):
            backend.close()
            raise ConflictError(f"a ckstore store already exists at {url}")

        def undo_remote() -> None:
            try:
                if backend.exists(CONFIG_NAME):
                    backend.delete(CONFIG_NAME)
            finally:
                backend.close()

        return undo_remote
    path = local_path(url)
    if os.path.isfile(os.path.join(path, CONFIG_NAME)):
        raise ConflictError(f"a ckstore store already exists at {path}")
    if os.path.exists(path) and not os.path.isdir(path):
        raise InvalidInputError(f"{path} is a file: give init a folder (new or existing)")
    top = path  # the outermost folder init will create, if any
    while not os.path.exists(os.path.dirname(top)) and os.path.dirname(top) != top:
        top = os.path.dirname(top)
    if not os.path.exists(top):
        return lambda: shutil.rmtree(top, ignore_errors=True)
    before = set(os.listdir(path)) if os.path.isdir(path) else set()

    def undo_local() -> None:
        for name in set(os.listdir(path)) - before if os.path.isdir(path) else ():
            p = os.path.join(path, name)
            if os.path.isdir(p):
                shutil.rmtree(p, ignore_errors=True)
            else:
                os.remove(p)

    return undo_local


# --- demo ---------------------------------------------------------------------------------------
def cmd_demo(args: argparse.Namespace) -> int:
    """``ckstore demo``; ``args.cli`` (the command line's ``main``) runs the history phase's
    commands.

    With ``--json`` the transcript is left out and one JSON document says what happened.
    """
    if args.steps < 2 or not 1 <= args.every <= args.steps // 2:  # before any folder is touched
        usage_error(
            args,
            f"--steps must be at least 2 and --every from 1 to --steps/2 (the demo snapshots "
            f"during the first half and resumes from there), got --steps {args.steps} --every "
            f"{args.every}",
        )
    url = claim_demo_store(args.store or DEMO_STORE)
    from . import demo as demo_mod  # imports torch: only once the folder is known to be ours

    quiet: Callable[[str], None] = lambda _line: None  # noqa: E731
    result = demo_mod.main(
        url, args.cli, steps=args.steps, every=args.every, say=quiet if args.json else print,
        as_json=args.json,
    )  # fmt: skip
    if args.json:
        emit_json(result.to_dict())
    return result.exit_code


def _demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
    p.add_argument(
        "--every",
        type=int,
        default=5,
        metavar="N",
        help="snapshot every N steps of the first half (default 5)",
    )


DEMO = Command(
    "demo",
    "train a small model, snapshot it, resume bit-exactly in a fresh process",
    ("ckstore demo", "ckstore --store ./my-demo demo --steps 20 --every 2"),
    cmd_demo,
    _demo_arguments,
    description=f"Train a small model, snapshot it, resume bit-exactly in a fresh process. The demo "
    f"makes its own store in {DEMO_STORE} (or --store FOLDER): it writes only into a new or "
    "empty folder, or replaces a store an earlier demo made; it never touches another store.",
    store_help=f"folder for the demo's own store (default: {DEMO_STORE}; ${STORE_ENV} is not "
    "used); an existing store the demo did not make, or any other non-empty folder, is refused",
)


def claim_demo_store(url: str) -> str:
    """Make ``url`` an empty store that the demo owns, and return its path.

    A folder that does not exist or is empty becomes a new store; a store an earlier demo
    made (it holds :data:`DEMO_MARK` and only the demo's run) is replaced. Anything else is
    refused, before anything is written.

    Raises:
        ConflictError: ``url`` holds a store the demo did not make, or other files.
        InvalidInputError: ``url`` is not a local folder.
    """
    import shutil

    import ckstore

    from ..engine.opening import is_local, local_path

    if not is_local(url):
        raise InvalidInputError(
            f"the demo runs in a local folder, not {url!r}: pass --store NEW_FOLDER"
        )
    path = local_path(url)
    elsewhere = f"run it elsewhere: ckstore --store NEW_FOLDER demo (default {DEMO_STORE})"
    if os.path.isfile(os.path.join(path, CONFIG_NAME)):
        if not os.path.isfile(os.path.join(path, DEMO_MARK)):
            raise ConflictError(
                f"{path} holds a ckstore store that `ckstore demo` did not create; the demo "
                f"never writes into or deletes a store of yours: {elsewhere}"
            )
        with ckstore.open(path, create=False) as old:
            foreign = [r for r in old.runs() if r != "demo"]
        if foreign:
            raise ConflictError(
                f"{path} was made by `ckstore demo` but now also holds run(s) "
                f"{', '.join(foreign)}; the demo will not replace it: {elsewhere}"
            )
        shutil.rmtree(path)  # the previous demo's own store
    elif os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise ConflictError(
            f"{path} exists and is not empty; the demo writes only into a new or empty folder "
            f"(or a store an earlier demo made): {elsewhere}"
        )
    ckstore.open(path, create=True).close()
    with open(os.path.join(path, DEMO_MARK), "w") as f:
        f.write("made by `ckstore demo`: the next `ckstore demo` here replaces this store\n")
    return path
