"""Where a store is and how it opens: local paths and URLs, the store's folder checked (or
made), its config read (or written once, create-only), its index opened and matched to it, and
read-only stores recognised. :func:`open_repository` returns the :class:`Repository`.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from .. import objects
from ..errors import (
    ConflictError,
    DestinationExistsError,
    InvalidInputError,
    NotFoundError,
    ObjectNotFoundError,
    StorageError,
)
from ..index.lite import LiteReads, recorded_store_id
from ..index.sqlite_paths import sqlite_url, unescaped_file
from .config import CONFIG_NAME, StoreConfig
from .one_folder import check_folder
from .repository import Repository

if TYPE_CHECKING:
    from ..index import Index


def is_local(url: str) -> bool:
    """True for plain paths, ``file://`` URLs and TorchSnapshot's ``fs://`` paths."""
    scheme = urlparse(url).scheme
    return scheme in ("", "file", "fs") or (len(scheme) == 1 and os.name == "nt")


def local_path(url: str) -> str:
    """The absolute filesystem path of a local store URL.

    ``fs://`` is TorchSnapshot's prefix for a file-system path: what follows it is the path
    (``fs:///abs/dir``, or ``fs://rel/dir`` relative to the working directory).
    """
    if url.startswith("fs://"):
        return os.path.abspath(url[len("fs://") :])
    return os.path.abspath(urlparse(url).path if url.startswith("file://") else url)


def default_index_url(url: str) -> str:
    """SQLite inside the store for local stores (``sqlite_url``: escaped where the path needs
    it); an in-memory SQLite for memory:// stores."""
    if is_local(url):
        return sqlite_url(os.path.join(local_path(url), "index.sqlite"))
    if url.startswith("memory://"):
        return "sqlite:///:memory:"
    raise InvalidInputError(
        f"store {url!r} is not on a local disk: pass index=<SQLAlchemy URL> (e.g. "
        "postgresql+psycopg://user@host/db) so several hosts share one index"
    )


def open_repository(
    url: str | os.PathLike[str],
    *,
    index: str | None = None,
    storage_options: dict[str, Any] | None = None,
    create: bool = False,
    chunk_bytes: int | None = None,
    pack_bytes: int | None = None,
    inline_bytes: int | None = None,
    create_index: bool | None = None,
    read_only: bool | None = None,
) -> Repository:
    """Open (with ``create``, also create) a store; see :func:`ckstore.open` for the arguments."""
    url = os.fspath(url)
    if read_only and create:
        raise InvalidInputError(f"cannot create a store read-only: {url!r} (pass create=False)")
    if is_local(url):
        url = local_path(url)
        prepare_local(url, create)
    index_url = index or default_index_url(url)
    why = read_only_reason(url, index_url, read_only)
    objs = objects.ObjectStore(objects.open_backend(url, storage_options))
    config = _load_config(objs.backend, url, create, chunk_bytes, pack_bytes, inline_bytes)
    if index is None and why is None and is_local(url):
        lite = LiteReads.open(os.path.join(url, "index.sqlite"), config.store_id)
        if lite is not None:  # this store's index at this code's schema: SQLAlchemy can wait
            return _opened(
                Repository(url, objs, lambda: _index(index_url), config, lite=lite),
                index,
                storage_options,
            )
    if index is None and is_local(url):
        _refuse_misplaced_index(url, config.store_id)
    from ..index import Index

    idx = Index.open(
        index_url, create=create if create_index is None else create_index, read_only=why
    )
    if idx.read_only is None:
        stored = idx.set_meta("store_id", config.store_id, only_if_absent=True)
    else:
        stored = idx.get_meta("store_id") or config.store_id
    if stored != config.store_id:
        idx.close()
        raise ConflictError(
            f"index {idx.url} belongs to another store (id {stored}) than {url} (id "
            f"{config.store_id}); point index= at this store's index"
        )
    if index is not None and is_local(url):
        try:
            check_folder(idx, url, config.store_id)
        except BaseException:
            idx.close()
            raise
    return _opened(Repository(url, objs, idx, config), index, storage_options)


def _opened(
    repo: Repository, index: str | None, storage_options: dict[str, Any] | None
) -> Repository:
    repo.opened_with = {
        "index": index,
        "storage_options": dict(storage_options) if storage_options else None,
    }
    return repo


def _refuse_misplaced_index(url: str, store_id: str) -> None:
    """A store whose path holds ``?`` or ``%``, made before its index URL was escaped
    (``index/sqlite_paths.py``), kept its index outside it, in the file the unescaped URL
    named: say where, rather than open an empty index here that hides every snapshot.

    Raises:
        ConflictError: that file holds this store's index and the store's own does not.
    """
    here = os.path.join(url, "index.sqlite")
    if not ("?" in here or "%" in here) or recorded_store_id(here) == store_id:
        return
    there = unescaped_file(here)  # what the unescaped URL opened
    if there != here and recorded_store_id(there) == store_id:
        raise ConflictError(
            f"the index of store {url} is the file {there}, outside it: ckstore before this "
            "version put it there for a path holding '?' or '%'. Move it (with its -wal and "
            f"-shm files, if any) to {here}, or rebuild it with `ckstore --store <store> reindex`"
        )


def _index(url: str) -> Index:
    """The full index of a store whose open checked it with :class:`LiteReads` (its schema
    revision and store id), opened on first use."""
    from ..index import Index

    return Index.open(url, create=False)


def read_only_reason(url: str, index_url: str, asked: bool | None) -> str | None:
    """Why a store opens read-only, or None: asked for (``read_only=True``), or (``None``, the
    default) a local store whose folder or SQLite index file is not writable (a read-only
    mount, a shared folder of someone else's); ``False`` insists on writable."""
    where = f"the store {url} is open read-only"
    if asked:
        return f"{where} (it was opened with read_only=True, or --read-only)"
    if asked is False or not is_local(url):
        return None
    path = local_path(url)
    db = os.path.join(path, "index.sqlite")
    if not os.access(path, os.W_OK) or (
        index_url == default_index_url(url) and os.path.exists(db) and not os.access(db, os.W_OK)
    ):
        return f"{where}: its folder {path} is not writable (a read-only mount or share); work on a writable copy to change it"
    return None


def how_to_create(url: str) -> str:
    """The advice that ends a "no store here" error."""
    return f"create it with `ckstore init {url}` or ckstore.open({url!r}, create=True)"


def prepare_local(path: str, create: bool) -> None:
    """Check that local ``path`` can be (or become) a store; with ``create``, make its folder.

    A store is a folder holding ``ckstore.json``. Without ``create`` anything else is refused
    (a typo must not become an empty store). With it, a missing or empty folder becomes one,
    and so does a folder holding only what ckstore itself writes into a store (another
    process creating the same store); a non-empty folder of anything else is refused by name.

    Raises:
        NotFoundError: no store at ``path`` and ``create`` is False.
        InvalidInputError: ``path``, or a folder above it, is a file.
        DestinationExistsError: ``create`` is True and ``path`` is a non-empty folder that is
            not a store.
        StorageError: the folder cannot be created (permissions, a read-only file system).
    """
    if os.path.isfile(os.path.join(path, CONFIG_NAME)):
        return
    if os.path.exists(path) and not os.path.isdir(path):
        raise InvalidInputError(f"{path} is a file, not a ckstore store (a store is a folder)")
    if not create:
        held = " (the folder exists but holds no ckstore.json)" if os.path.isdir(path) else ""
        raise NotFoundError(f"no ckstore store at {path!r}{held}; {how_to_create(path)}")
    if os.path.isdir(path):
        foreign = sorted(n for n in os.listdir(path) if not _made_by_ckstore(path, n))
        if foreign:
            shown = ", ".join(foreign[:5]) + (
                f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
            )
            raise DestinationExistsError(
                f"{path} is not empty and is not a ckstore store (it holds {shown}): create the "
                "store in a new or empty folder"
            )
        return
    blocker = _file_above(path)
    if blocker is not None:
        raise InvalidInputError(
            f"cannot create a store at {path}: {blocker} is a file, not a folder"
        )
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise StorageError(f"cannot create the store folder {path}: {exc.strerror or exc}") from exc


_STORE_NAMES = (CONFIG_NAME, "packs", "manifests")


def _made_by_ckstore(folder: str, name: str) -> bool:
    """True for what a store's own creation puts in its folder (config, index, object dirs),
    and for other stores inside it (TorchSnapshot-style steps, each a store of its own)."""
    return (
        name in _STORE_NAMES
        or name.startswith("index.sqlite")
        or name.startswith(f".{CONFIG_NAME}.tmp-")
        or os.path.isfile(os.path.join(folder, name, CONFIG_NAME))
    )


def _file_above(path: str) -> str | None:
    """The nearest existing ancestor of ``path`` if it is a file (so no folder can go below)."""
    d = os.path.dirname(path)
    while d and not os.path.exists(d):
        parent = os.path.dirname(d)
        if parent == d:
            return None
        d = parent
    return d if d and not os.path.isdir(d) else None


def _load_config(
    backend: objects.Backend,
    url: str,
    create: bool,
    chunk: int | None,
    pack: int | None,
    inline: int | None,
) -> StoreConfig:
    try:
        return StoreConfig.from_json(backend.get(CONFIG_NAME), url)
    except ObjectNotFoundError:
        if not create:
            raise NotFoundError(f"no ckstore store at {url!r}; {how_to_create(url)}") from None
    if not is_local(url):
        _refuse_foreign_prefix(backend, url)
    try:
        backend.put(CONFIG_NAME, StoreConfig.new(chunk, pack, inline).to_json())
    except StorageError as exc:  # another creator's config in place, of another size (S3)
        try:
            return StoreConfig.from_json(backend.get(CONFIG_NAME), url)
        except ObjectNotFoundError:
            raise exc from None
    return StoreConfig.from_json(backend.get(CONFIG_NAME), url)  # whoever created it first wins


def _refuse_foreign_prefix(backend: objects.Backend, url: str) -> None:
    """A new remote store goes under an empty prefix (or one another creator just claimed)."""
    names = []
    for name in backend.list():
        if name == CONFIG_NAME:
            return  # created meanwhile: the create-only put below keeps the first config
        names.append(name)
        if len(names) == 3:
            break
    if names:
        raise DestinationExistsError(
            f"{url} is not empty and is not a ckstore store (it holds {', '.join(names)}{', ...' if len(names) == 3 else ''}): "
            "create the store under a new or empty prefix"
        )
