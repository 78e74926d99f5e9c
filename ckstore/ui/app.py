"""The ASGI app: the page, its JSON API and its static files (Starlette).

Routes (all GET unless said; refs and keys reach the store only through its own resolver):

=====================  =====================================================================
``/``                  the page (an HTML error page when the store cannot be read)
``/api/overview``      every snapshot as columns, runs, tags (:func:`timeline.overview`)
``/api/forks``         fork edges between runs (:class:`timeline.ForkCache`)
``/api/runs``          per-run totals (:func:`storage.run_totals`)
``/api/usage``         ``ckstore du`` (unique stored bytes; scans references)
``/api/snapshot``      ``?ref=``: one snapshot, what it shares (:func:`storage.snapshot_detail`)
``/api/diff``          ``?a=&b=&numeric=1``: per-tensor and per-layer changes
``/api/health``        ``?run=&limit=&app=``: NaN/Inf/stale flags and norms per layer of an app
``/api/gc/preview``    ``?keep_last=&...``: what gc would drop and reclaim (changes nothing)
``POST /api/tag``      ``{"ref", "name", "force"}`` with the token
``POST /api/untag``    ``{"name"}`` with the token
``POST /api/delete``   ``{"ref", "force"}`` with the token
=====================  =====================================================================
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable
from importlib import resources
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from ..errors import InvalidInputError
from ..store import Store
from . import changes, health, maintenance, storage, timeline
from .errors import html_error, json_error, plain_error
from .middleware import HostGuard
from .security import TOKEN_HEADER, Guard
from .state import UiState

STATIC = resources.files("ckstore.ui") / "static"
MAX_BODY = 64 * 1024
MAX_PARAM = 1024

Handler = Callable[[Request], Any]


def make_app(
    opener: Callable[[], Store],
    token: str,
    *,
    label: str = "",
    extra_hosts: tuple[str, ...] = (),
    workdir: str | None = None,
) -> Starlette:
    """The app for one store.

    Args:
        opener: Opens the store (lazily; called again after a failure).
        token: What actions must carry in the ``X-Ckstore-Token`` header.
        label: The store's URL, for error pages.
        extra_hosts: Host names besides loopback that requests may address (``--host``).
        workdir: The folder the page's header names a local store relative to (default: the
            current one, where ``ckstore ui`` was started).
    """
    state = UiState(opener, label)
    guard = Guard(token, extra_hosts)

    def read(view: Callable[[Request, UiState], Any]) -> Handler:
        def endpoint(request: Request) -> Response:
            try:
                return JSONResponse(view(request, state))
            except Exception as exc:  # noqa: BLE001 - every error becomes a JSON error
                return json_error(exc)

        return endpoint

    def act(action: Callable[[Store, dict[str, Any]], dict[str, Any]]) -> Handler:
        async def endpoint(request: Request) -> Response:
            if not guard.origin_ok(request.headers.get("origin"), request.headers.get("host")):
                return plain_error(403, "cross-origin request refused: only this page may change")
            if not guard.token_ok(request.headers.get(TOKEN_HEADER)):
                return plain_error(
                    403, "this action needs the token: open the URL `ckstore ui` printed"
                )
            if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
                return plain_error(415, "send the action as application/json")
            raw = await _body(request)
            if raw is None:
                return plain_error(413, f"request body too large (at most {MAX_BODY} bytes)")
            try:
                body = json.loads(raw)
                if not isinstance(body, dict):
                    raise InvalidInputError("the request body must be a JSON object")
            except ValueError as exc:
                return json_error(InvalidInputError(f"the request body is not JSON: {exc}"))
            except RecursionError:
                return json_error(InvalidInputError("the request body is nested too deeply"))
            try:
                result = await run_in_threadpool(action, state.store(), body)
            except Exception as exc:  # noqa: BLE001
                return json_error(exc)
            finally:
                state.changed()
            return JSONResponse(result)

        return endpoint

    def page(request: Request) -> Response:
        try:
            state.store().runs()  # the store opens and its index answers
        except Exception as exc:  # noqa: BLE001 - an error page, never a traceback
            return html_error(exc, state.label)
        return FileResponse(str(STATIC / "index.html"), media_type="text/html")

    routes = [
        Route("/", page),
        Route(
            "/api/overview",
            read(lambda r, s: timeline.overview(s.store(), s.history(), workdir)),
        ),
        Route("/api/forks", read(lambda r, s: {"edges": s.forks.edges(s.store(), s.history())})),
        Route("/api/runs", read(lambda r, s: {"runs": storage.run_totals(s.history())})),
        Route("/api/usage", read(lambda r, s: storage.exact_usage(s.store()))),
        Route(
            "/api/snapshot",
            read(lambda r, s: storage.snapshot_detail(s.store(), s.history(), param(r, "ref"))),
        ),
        Route("/api/diff", read(_diff)),
        Route("/api/health", read(_health)),
        Route("/api/gc/preview", read(_gc_preview)),
        Route("/api/tag", act(maintenance.do_tag), methods=["POST"]),
        Route("/api/untag", act(maintenance.do_untag), methods=["POST"]),
        Route("/api/delete", act(maintenance.do_delete), methods=["POST"]),
        Mount("/static", app=StaticFiles(directory=str(STATIC)), name="static"),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        state.close()

    app = Starlette(routes=routes, middleware=[HostGuard.middleware(guard)], lifespan=lifespan)
    app.state.ui = state
    return app


async def _body(request: Request) -> bytes | None:
    """The request's body, or None past :data:`MAX_BODY` bytes: refused on its announced
    ``Content-Length`` before a byte is read, and a body without one is read only up to the
    limit."""
    length = request.headers.get("content-length")
    if length is not None and (not length.strip().isdigit() or int(length) > MAX_BODY):
        return None
    raw = bytearray()
    async for piece in request.stream():
        raw += piece
        if len(raw) > MAX_BODY:
            return None
    return bytes(raw)


def param(request: Request, name: str, required: bool = True) -> str:
    """A query parameter, at most 1,024 characters.

    Raises:
        InvalidInputError: it is missing (when ``required``) or too long.
    """
    value = request.query_params.get(name, "")
    if len(value) > MAX_PARAM:
        raise InvalidInputError(f"parameter {name} is longer than {MAX_PARAM} characters")
    if required and not value:
        raise InvalidInputError(f"parameter {name} is required")
    return value


def _diff(request: Request, state: UiState) -> dict[str, Any]:
    numeric = param(request, "numeric", required=False) in ("1", "true")
    return changes.compare(state.store(), param(request, "a"), param(request, "b"), numeric)


def _health(request: Request, state: UiState) -> dict[str, Any]:
    text = param(request, "limit", required=False) or str(health.DEFAULT_LIMIT)
    if not text.isdigit():
        raise InvalidInputError(f"limit must be a positive integer, got {text[:40]!r}")
    return health.run_health(
        state.store(),
        state.history(),
        state.health,
        param(request, "run"),
        int(text),
        param(request, "app", required=False) or None,
    )


def _gc_preview(request: Request, state: UiState) -> dict[str, Any]:
    fields = {k: param(request, k, required=False) for k in request.query_params}
    return maintenance.gc_preview(
        state.store(), state.history(), maintenance.GcRequest.parse(fields)
    )
