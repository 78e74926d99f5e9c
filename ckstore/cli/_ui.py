"""The ``ui`` command: serve the local web view of a store (see ``ckstore.ui``)."""

from __future__ import annotations

import argparse
from typing import Any

from ..errors import InvalidInputError
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
