"""The setup commands: ``init`` creates a store, ``demo`` walks through one end to end.

Each ``cmd_*`` takes the parsed arguments and returns an exit code.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

from ..errors import ConflictError
from . import _format as fmt
from ._common import CONFIG_NAME, EXIT_OK, emit_json


def cmd_init(args: argparse.Namespace) -> int:
    import ckstore

    from ..engine.repository import is_local, local_path

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
        sizes = f"chunks {fmt.size(cfg.chunk_bytes)}, packs {fmt.size(cfg.pack_bytes)}"
        sizes += f", inline up to {fmt.size(cfg.inline_bytes)}"
        print(f"initialized empty ckstore store at {info['url']} ({sizes})")
    return EXIT_OK


def cmd_demo(args: argparse.Namespace, run_cli: Callable[[list[str]], int]) -> int:
    """``ckstore demo``; ``run_cli`` runs the history phase's commands (the CLI's ``main``)."""
    from . import demo as demo_mod

    return demo_mod.main(args.store or "./demo-store", run_cli, steps=args.steps, every=args.every)
