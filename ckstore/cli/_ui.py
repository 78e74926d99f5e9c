"""The ``ui`` command: serve the local web view of a store (see ``ckstore.ui``)."""

from __future__ import annotations

import argparse
from typing import Any

from ..errors import InvalidInputError
from ._args import nonneg_int
from ._command import Command
from ._common import EXIT_OK, find_store, open_store


def cmd_ui(args: argparse.Namespace) -> int:
    try:
        from ..ui import serve  # Starlette and uvicorn load only for this command
        from ..ui.security import new_token
        from ..ui.server import DEFAULT_HOST
    except ImportError as exc:
        raise InvalidInputError(
            f"ckstore ui needs its extra ({exc.name} is missing): pip install 'ckstore[ui]'"
        ) from exc

    url = find_store(args.store)
    args.store = url
    open_store(args).close()  # a missing store fails here, as for every command

    def opener() -> Any:
        return open_store(args)

    serve(
        opener,
        new_token(args.token),
        label=url,
        host=args.host or DEFAULT_HOST,
        port=args.port,
        explicit_host=args.host is not None,
        open_browser=not args.no_open,
    )
    return EXIT_OK


def _ui_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--port", type=nonneg_int, default=8765, help="port (default 8765; 0: any free port)"
    )
    p.add_argument(
        "--host",
        help="address to bind (default 127.0.0.1); any other than loopback prints a warning: "
        "whoever reaches it can read the store",
    )
    p.add_argument(
        "--token",
        help="the token changes need (default: $CKSTORE_UI_TOKEN, else a random one, printed)",
    )
    p.add_argument("--no-open", action="store_true", help="do not open a browser")


UI = Command(
    "ui",
    "serve a local web view of runs, lineage, storage, changes and health",
    (
        "ckstore ui",
        "ckstore --store ./ckpts ui --port 0 --no-open",
        "CKSTORE_UI_TOKEN=secret ckstore ui --port 9000",
    ),
    cmd_ui,
    _ui_arguments,
    description=(
        "Serve a local web page of the store: runs and lineage, storage per snapshot, changes "
        "between two snapshots as a heat map over layers, recorded health, and a gc preview. It "
        "binds 127.0.0.1 unless --host says otherwise and prints its URL with a token; tagging and "
        "deleting from the page need that token."
    ),
)
