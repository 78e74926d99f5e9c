"""``ckstore ui``: a local web view of a store's runs, lineage, storage, changes and health.

A Starlette app served by uvicorn on 127.0.0.1, a page of plain JavaScript modules and a
vendored chart library (``static/``, shipped in the wheel; nothing is fetched at run time).
It reads the SQL index for lists and lineage and a manifest only when one snapshot's keys are
needed; it never unpickles anything. Changes (tag, untag, delete) need the token printed on
the terminal. Modules, one job each:

- ``timeline``: snapshots as columns, fork edges (index only);
- ``storage``: per-run totals, one snapshot's sharing;
- ``changes``: a two-snapshot diff as per-tensor rows and per-layer groups;
- ``health``: the one adapter to recorded health (:func:`health.health_of`) and its series;
- ``maintenance``: the gc preview and the actions;
- ``security`` / ``middleware``: token, Host and Origin checks, response headers;
- ``errors``: JSON and HTML errors, never a traceback;
- ``state``: the lazily opened store and its caches;
- ``app`` / ``server``: routes, and serving them.
"""

from __future__ import annotations

from .app import make_app
from .health import health_of
from .server import serve

__all__ = ["health_of", "make_app", "serve"]
