"""Pick a backend from a URL: local paths, ``memory://``, ``s3://`` and any other fsspec URL."""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import unquote, urlsplit

from ckstore.errors import InvalidInputError, StorageError
from ckstore.objects.backend import Backend
from ckstore.objects.local import LocalBackend


def _s3_backend(url: str, options: dict[str, Any]) -> Backend:
    try:
        import s3fs
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise InvalidInputError(f"{url} needs the s3 extra: pip install 'ckstore[s3]'") from exc
    from ckstore.objects.s3 import S3Backend

    root = url[len("s3://") :].strip("/")
    if not root:
        raise InvalidInputError(f"S3 URL needs a bucket: {url!r}")
    opts = {"skip_instance_cache": True, "use_listings_cache": False, **options}
    try:
        fs = s3fs.S3FileSystem(**opts)
    except Exception as exc:
        raise StorageError(f"cannot open {url}: {exc}") from exc
    return S3Backend(fs, root)


def open_backend(
    url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None
) -> Backend:
    """Open the backend that serves ``url``.

    Args:
        url: a local path or ``file://`` URL (:class:`LocalBackend`); ``memory://[path]``
            (fsspec's memory filesystem; an empty path gives a fresh private root);
            ``s3://bucket[/prefix]`` (:class:`S3Backend`; needs s3fs); or any other URL
            fsspec knows (:class:`FsspecBackend`).
        storage_options: keyword arguments for the fsspec filesystem (for S3 e.g. ``key``,
            ``secret``, ``client_kwargs={"endpoint_url": ...}``). Ignored for local paths.

    Returns:
        The backend.

    Raises:
        InvalidInputError: the URL's protocol is unknown or malformed.
        StorageError: the filesystem could not be opened.
    """
    text = os.fspath(url)
    options = dict(storage_options or {})
    if "://" not in text:
        return LocalBackend(text)
    protocol = text.split("://", 1)[0].lower()
    if protocol in ("file", "local"):
        return LocalBackend(unquote(urlsplit(text).path))
    if protocol == "memory":
        from ckstore.objects.fsspec_backend import memory_backend

        return memory_backend(text[len("memory://") :])
    if protocol in ("s3", "s3a"):
        return _s3_backend("s3://" + text.split("://", 1)[1], options)
    import fsspec  # here, not at the top: local stores never pay for importing it

    from ckstore.objects.fsspec_backend import FsspecBackend

    try:
        fs, root = fsspec.core.url_to_fs(text, **options)
    except (ValueError, ImportError) as exc:
        raise InvalidInputError(f"no storage backend for {text!r}: {exc}") from exc
    return FsspecBackend(fs, root)
