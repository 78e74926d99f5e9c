"""A SQLite file's path as an index URL that names that file and no other (no SQLAlchemy
here: opening a store builds one before anything imports it)."""

from __future__ import annotations

from urllib.parse import quote, unquote


def sqlite_url(path: str) -> str:
    """The SQLAlchemy URL of the SQLite file ``path``.

    A path holding ``?`` or ``%`` becomes a ``file:`` URI escaped twice, once for SQLite's URI
    and once for the URL around it: in a plain ``sqlite:///`` URL its ``?`` would start the
    URL's query and a ``%xx`` be decoded, naming another file (``/data/a?b/index.sqlite``
    named ``/data/a``)."""
    if "?" in path or "%" in path:
        return f"sqlite:///file:{quote(quote(path, safe='/'), safe='/')}?uri=true"
    return f"sqlite:///{path}"


def unescaped_file(path: str) -> str:
    """The file ``sqlite:///{path}``, unescaped, named: what ckstore before ``sqlite_url``
    opened for the SQLite file ``path`` (SQLAlchemy's reading of that URL; imported here,
    only for a path that needs escaping)."""
    from sqlalchemy.engine import make_url

    return make_url(f"sqlite:///{path}").database or ""


def file_of(url: str) -> str | None:
    """The SQLite file an index URL names (what :func:`sqlite_url` built it from), or None
    for any other database (PostgreSQL, SQLite in memory)."""
    if not url.startswith("sqlite:///"):
        return None
    rest = url[len("sqlite:///") :]
    if rest.startswith("file:"):
        rest = unquote(unquote(rest[len("file:") :].split("?", 1)[0]))
    else:
        rest = rest.split("?", 1)[0]
    return None if rest in ("", ":memory:") else rest
