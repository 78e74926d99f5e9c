"""A SQLite file's path as an index URL that names that file and no other (no SQLAlchemy
here: opening a store builds one before anything imports it)."""

from __future__ import annotations

from urllib.parse import quote


def sqlite_url(path: str) -> str:
    """The SQLAlchemy URL of the SQLite file ``path``.

    A path holding ``?`` or ``%`` becomes a ``file:`` URI escaped twice, once for SQLite's URI
    and once for the URL around it: in a plain ``sqlite:///`` URL its ``?`` would start the
    URL's query and a ``%xx`` be decoded, naming another file (``/data/a?b/index.sqlite``
    named ``/data/a``)."""
    if "?" in path or "%" in path:
        return f"sqlite:///file:{quote(quote(path, safe='/'), safe='/')}?uri=true"
    return f"sqlite:///{path}"
