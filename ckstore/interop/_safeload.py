"""Loading pickled checkpoint files without running code from them (I6 at the import boundary).

``torch.save`` files load with ``torch.load(weights_only=True)``: PyTorch's restricted
unpickler, which builds tensors, plain containers and scalars and refuses every other global.
NumPy arrays of numeric dtypes are allowed too (RNG states hold them). There is no fallback: a
file that needs anything else raises :class:`UnsafePickleError` naming the globals it needs,
which are listed without unpickling anything.

DCP's ``.metadata`` is a plain pickle of DCP's metadata dataclasses; :func:`load_dcp_metadata`
reads it with an unpickler that resolves only those classes and a few torch values.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from typing import Any

import numpy as np
import torch

from ..errors import InvalidInputError, UnsafePickleError

_NUMPY_GLOBALS: list[Any] = [np.ndarray, np.dtype]
for _mod in ("numpy._core.multiarray", "numpy.core.multiarray"):
    try:
        _NUMPY_GLOBALS.append(__import__(_mod, fromlist=["_reconstruct"])._reconstruct)
    except (ImportError, AttributeError):  # pragma: no cover - depends on the NumPy version
        pass
_NUMPY_GLOBALS += sorted(
    {type(np.dtype(c)) for c in "?bhilqBHILQefdgFDG"}, key=lambda t: t.__name__
)


def trust_hint(path: str) -> str:
    return (
        "If you trust the file, load it yourself and take the result: "
        f"obj = torch.load({path!r}, weights_only=False); "
        "store.take(ckstore.interop.app_state_of(obj), run=..., step=...)"
    )


def load_torch(path: str) -> Any:
    """``torch.load`` a file with ``weights_only=True`` (memory-mapped when the format allows).

    Raises:
        UnsafePickleError: the file needs arbitrary unpickling; nothing of it ran.
        InvalidInputError: the file is not a ``torch.save`` file.
    """
    zipped = is_zip(path)
    try:
        with torch.serialization.safe_globals(_NUMPY_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=zipped)
    except pickle.UnpicklingError as exc:
        needs = _unsafe_globals(path) if zipped else []
        what = (
            f"it needs {', '.join(needs)}"
            if needs
            else f"the restricted unpickler refused it ({_first_line(exc)})"
        )
        raise UnsafePickleError(
            f"{path}: refused to load: this torch.save file can only be loaded by unpickling "
            f"arbitrary objects, which can run code ({what}). ckstore loads checkpoint files "
            f"with weights_only=True only and ran nothing from it. {trust_hint(path)}"
        ) from None
    except Exception as exc:  # noqa: BLE001 - a damaged file makes the loader raise anything
        # (IndexError, TypeError, AssertionError, BadZipFile...): at this trust boundary every
        # one of them means the same, a file that is not a readable torch.save file
        raise InvalidInputError(
            f"{path}: not a readable torch.save file ({type(exc).__name__}: {_first_line(exc)}); "
            "pass --format if it is another format"
        ) from exc


def is_zip(path: str) -> bool:
    """Whether ``path`` looks like a zip archive (the torch.save format since torch 1.6).

    ``zipfile.is_zipfile`` raises ``BadZipFile`` on some damaged end records instead of
    answering False; such a file is no readable zip either.
    """
    try:
        return zipfile.is_zipfile(path)
    except (zipfile.BadZipFile, OSError, ValueError):
        return False


def _unsafe_globals(path: str) -> list[str]:
    try:
        allowed = {f"{g.__module__}.{g.__qualname__}" for g in _NUMPY_GLOBALS}
        return [
            g
            for g in torch.serialization.get_unsafe_globals_in_checkpoint(path)
            if g not in allowed
        ]
    except Exception:  # noqa: BLE001 - the list only improves the message
        return []


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def _dcp_allowed() -> dict[tuple[str, str], Any]:
    from torch.distributed.checkpoint import filesystem, metadata

    allowed: dict[tuple[str, str], Any] = {}
    for cls in (
        metadata.Metadata,
        metadata.TensorStorageMetadata,
        metadata.BytesStorageMetadata,
        metadata.ChunkStorageMetadata,
        metadata.TensorProperties,
        metadata.MetadataIndex,
        metadata.StorageMeta,
        metadata._MEM_FORMAT_ENCODING,
        filesystem._StorageInfo,
    ):
        allowed[(cls.__module__, cls.__qualname__)] = cls
    allowed[("torch", "Size")] = torch.Size
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            allowed[("torch", name)] = value
    allowed[("torch.serialization", "_get_layout")] = _layout_by_name
    allowed[("collections", "OrderedDict")] = __import__("collections").OrderedDict
    for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"):
        allowed[("pathlib", name)] = getattr(__import__("pathlib"), name)
    return allowed


def _layout_by_name(name: str) -> torch.layout:
    """``torch.serialization._get_layout`` without its cache: a layout from its repr only."""
    for value in vars(torch).values():
        if isinstance(value, torch.layout) and str(value) == name:
            return value
    raise pickle.UnpicklingError(f"unknown torch layout {name!r}")


class _Refused(pickle.UnpicklingError):
    """A global outside the allowed set."""


class _DcpUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, allowed: dict[tuple[str, str], Any]) -> None:
        super().__init__(io.BytesIO(data))
        self.allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self.allowed[(module, name)]
        except KeyError:
            raise _Refused(f"it needs {module}.{name}, which is not DCP metadata") from None


def load_dcp_metadata(path: str) -> Any:
    """DCP's ``Metadata`` from a ``.metadata`` file, resolving only DCP's metadata classes.

    Raises:
        UnsafePickleError: the file references anything else (nothing of it ran).
        InvalidInputError: the file is not a pickle of DCP metadata.
    """
    from torch.distributed.checkpoint.metadata import Metadata

    with open(path, "rb") as f:
        data = f.read()
    try:
        md = _DcpUnpickler(data, _dcp_allowed()).load()
    except _Refused as exc:
        raise UnsafePickleError(
            f"{path}: refused to load DCP metadata: {exc}; it could run code when unpickled, and "
            "ckstore ran nothing from it. If you trust it, dcp.load it yourself and store.take the state"
        ) from None
    except Exception as exc:  # noqa: BLE001 - any other malformed pickle
        raise InvalidInputError(f"{path}: not readable DCP metadata ({_first_line(exc)})") from exc
    if not isinstance(md, Metadata):
        raise InvalidInputError(f"{path}: holds a {type(md).__name__}, not DCP metadata")
    return md


def load_dcp_value(data: io.BytesIO, fqn: str, where: str) -> Any:
    """A DCP ``BYTE_IO`` item (a ``torch.save`` of a plain value), loaded weights-only."""
    try:
        with torch.serialization.safe_globals(_NUMPY_GLOBALS):
            return torch.load(data, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise UnsafePickleError(
            f"{where}: value {fqn!r} can only be loaded by unpickling arbitrary objects, which can "
            "run code; ckstore ran nothing from it. If you trust the checkpoint, dcp.load it "
            "yourself and store.take the state"
        ) from None
    except Exception as exc:  # noqa: BLE001 - damaged bytes make the loader raise anything
        raise InvalidInputError(
            f"{where}: value {fqn!r} is not a readable torch.save value "
            f"({type(exc).__name__}: {_first_line(exc)})"
        ) from exc
