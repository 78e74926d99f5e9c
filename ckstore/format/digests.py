"""Proof an export carries: BLAKE3 digests, how they are made, and what a check found.

Two places hold them (docs/FORMAT.md, section 11):

* **Inside a safetensors file**, ``__metadata__["ckstore.digests"]``: one JSON string
  ``{"algorithm": "blake3", "header": H, "tensors": {name: D}}``. ``D`` is the BLAKE3 of the
  tensor's raw bytes as the file stores them (little-endian, C order: what chunk ids hash).
  ``H`` is the BLAKE3 of the file's first ``8 + N`` bytes (length prefix, header JSON and its
  padding) with every occurrence of ``H``'s own 64 hex characters replaced by ``0``s: every
  header byte is covered, the digests included. So a file checks alone, with the
  ``safetensors`` format and ``blake3`` only.
* **Beside the files**, ``ckstore-digests.json`` in the export's directory: every other file's
  size and BLAKE3 (the torch and DCP files, the index, kept files), per-tensor digests of the
  torch files (key paths as in a ckstore manifest: ``model/layer.weight``), and ``"digest"``:
  the BLAKE3 of the sidecar's own bytes with that value's 64 hex characters zeroed.

Their check without a store (``ckstore verify``, an import's check) is
:func:`ckstore.format.verify.verify_path`; it reports :class:`Finding` s in a
:class:`VerifyReport`. Files are read through :func:`open_regular`, which opens nothing but a
regular file.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import blake3

from ..errors import CorruptionError

ALGORITHM = "blake3"
METADATA_KEY = "ckstore.digests"
"""The safetensors ``__metadata__`` key of a file's own digests."""
SIDECAR = "ckstore-digests.json"
"""The digests of a folder's files, written beside them."""
SIDECAR_FORMAT = "ckstore/digests"
ZERO = "0" * 64
_HEX64 = re.compile(r"[0-9a-f]{64}")
READ_BYTES = 8 << 20
"""How much a check reads at a time."""
MAX_HEADER_BYTES = 100_000_000

TensorDigests = Callable[[str], Mapping[str, str]]
"""Loads a torch file and gives key path -> digest of each tensor (needs torch; ImportError
without it, and the file is then named instead of its tensors)."""


def digest(data: Any) -> str:
    """BLAKE3 (hex) of a bytes-like object."""
    return blake3.blake3(data).hexdigest()


class NotRegularFileError(OSError):
    """A path that is not a regular file (a FIFO, device, socket, link or folder): never read."""


def open_regular(path: str) -> BinaryIO:
    """Open ``path`` for reading only if it is a regular file, without following a final link
    and without blocking on a FIFO (``O_NONBLOCK``, then checked with ``fstat``).

    Raises:
        NotRegularFileError: it is something else.
        OSError: it cannot be opened.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        if os.path.islink(path):
            raise NotRegularFileError(f"{path} is a link") from exc
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise NotRegularFileError(f"{path} is not a regular file")
    return os.fdopen(fd, "rb")


def file_digest(path: str) -> tuple[int, str]:
    """(size, BLAKE3) of a regular file, read in pieces (:func:`open_regular`)."""
    h = blake3.blake3()
    size = 0
    with open_regular(path) as f:
        while piece := f.read(READ_BYTES):
            h.update(piece)
            size += len(piece)
    return size, h.hexdigest()


def self_digest(raw: bytes, claimed: str) -> str:
    """BLAKE3 of ``raw`` with every occurrence of the 64 hex characters ``claimed`` zeroed."""
    return digest(
        raw.replace(claimed.encode(), ZERO.encode()) if _HEX64.fullmatch(claimed) else raw
    )


def metadata_value(tensors: Mapping[str, str], header: str = ZERO) -> str:
    """The ``ckstore.digests`` metadata string (fixed length for fixed names: hex digests)."""
    return json.dumps(
        {"algorithm": ALGORITHM, "header": header, "tensors": dict(tensors)},
        sort_keys=True,
        separators=(",", ":"),
    )


def sidecar_bytes(
    files: Mapping[str, tuple[int, str]],
    tensors: Mapping[str, Mapping[str, str]],
    about: Mapping[str, Any],
) -> bytes:
    """The sidecar: ``files`` (name -> (size, digest)), per-file tensor digests, ``about``
    (snapshot, run, step), sealed by its own digest."""
    doc = {
        "format": SIDECAR_FORMAT,
        "version": 1,
        "algorithm": ALGORITHM,
        "digest": ZERO,
        **about,
        "files": {n: {"size": s, "blake3": d} for n, (s, d) in sorted(files.items())},
        "tensors": {n: dict(sorted(t.items())) for n, t in sorted(tensors.items()) if t},
    }
    raw = json.dumps(doc, sort_keys=True, indent=1).encode() + b"\n"
    return raw.replace(ZERO.encode(), digest(raw).encode(), 1)


@dataclass
class Finding:
    """One thing that does not match: the file, the tensor if known, what is wrong.

    ``binding``: whether it refuses an import (:meth:`VerifyReport.raise_for_problems`).
    False where it is unknown whether the file ever carried digests (a file unreadable as
    safetensors is then refused by the format's reader) or nothing could be checked.
    """

    file: str
    problem: str
    tensor: str | None = None
    binding: bool = True

    def __str__(self) -> str:
        return f"{self.file}: {f'tensor {self.tensor!r}: ' if self.tensor else ''}{self.problem}"


@dataclass
class VerifyReport:
    """What :func:`verify_path` checked and found."""

    path: str
    checked: set[str] = field(default_factory=set)
    """Files checked against a digest."""
    tensors: int = 0
    problems: list[Finding] = field(default_factory=list)
    unverified: list[str] = field(default_factory=list)
    """Files no digest covers where no sidecar exists (not a failure; listed so nobody takes
    them as checked)."""
    nothing_to_check: bool = False
    """Nothing carried digests and nothing was found wrong: the only problem says so."""

    @property
    def files(self) -> int:
        """How many files were checked."""
        return len(self.checked)

    @property
    def ok(self) -> bool:
        return not self.problems and self.files > 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "ok": self.ok,
            "files": self.files,
            "tensors": self.tensors,
            "problems": [
                {"file": p.file, "tensor": p.tensor, "problem": p.problem} for p in self.problems
            ],
            "unverified": self.unverified,
        }

    def raise_for_problems(self) -> None:
        """CorruptionError naming what does not match its digests (the first few), if anything:
        the binding problems (files checked against a digest, the sidecar, files and names it
        does not account for, things that are not regular files; an unreadable file that may
        never have carried digests is left to whoever reads it)."""
        problems = [p for p in self.problems if p.binding]
        if problems:
            shown = "; ".join(str(p) for p in problems[:5])
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            raise CorruptionError(f"{self.path} does not match its recorded digests: {shown}{more}")


def tensor_digests(pairs: Iterable[tuple[str, Any]]) -> dict[str, str]:
    """Key -> BLAKE3 of each raw byte buffer in ``pairs``."""
    return {k: digest(v) for k, v in pairs}
