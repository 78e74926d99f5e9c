"""Errors as the page shows them: a JSON body for API routes, an HTML page for the others.

Never a traceback: a ckstore error becomes its message and an HTTP status that fits it; any
other exception becomes a 500 naming its type and message, and its traceback goes to the
server's log only.
"""

from __future__ import annotations

import html
import logging

from starlette.responses import HTMLResponse, JSONResponse, Response

from ..errors import CkstoreError, kind_of

log = logging.getLogger("ckstore.ui")


def status_of(exc: BaseException) -> int:
    """The HTTP status of an error, its kind's (``ckstore.errors.ERROR_KINDS``): 404 not found,
    400 bad input, 409 conflict, 500 for damaged or missing stored data and anything else."""
    return kind_of(exc).http_status


def describe(exc: BaseException) -> str:
    """One line saying what went wrong (a ckstore error's own message)."""
    message = " ".join(str(exc).split()) or type(exc).__name__
    if not isinstance(exc, CkstoreError):
        log.error("ckstore ui: unexpected error", exc_info=exc)
        message = f"internal error ({type(exc).__name__}): {message}"
    return message[:2000]


def json_error(exc: BaseException) -> JSONResponse:
    """An API error: ``{"error": message, "type": class name, "status": code}``."""
    status = status_of(exc)
    return JSONResponse(
        {"error": describe(exc), "type": type(exc).__name__, "status": status}, status_code=status
    )


def plain_error(status: int, message: str) -> JSONResponse:
    """An API refusal that is no exception (403 no token, 415 not JSON, ...)."""
    return JSONResponse({"error": message, "type": "Refused", "status": status}, status_code=status)


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>ckstore: {title}</title>
<link rel="stylesheet" href="/static/style.css"></head>
<body class="error-page"><main class="error-box">
<h1>ckstore ui: {title}</h1>
<p class="error-message" id="error-message">{message}</p>
<p class="hint">{hint}</p>
<p><a href="/">Try again</a></p>
</main></body></html>
"""


def html_error(exc: BaseException, store: str) -> HTMLResponse:
    """The page shown instead of the UI when the store cannot be read."""
    status = status_of(exc)
    title = "store not found" if status == 404 else "cannot read the store"
    hint = (
        f"Store: {html.escape(store)}. Check it with <code>ckstore check</code>; a damaged index can be "
        "rebuilt with <code>ckstore reindex</code>."
    )
    body = PAGE.format(title=title, message=html.escape(describe(exc)), hint=hint)
    return HTMLResponse(body, status_code=status)


def refused(status: int, message: str) -> Response:
    """A plain-text refusal for requests that never reach the app (bad Host header)."""
    return Response(message + "\n", status_code=status, media_type="text/plain")
