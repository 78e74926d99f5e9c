"""Proof an export carries: BLAKE3 digests, and their check without a store (``ckstore verify``).

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

:func:`verify_path` checks a file or a folder: safetensors files against their own digests,
and every file the sidecar lists. Naming the tensor of a damaged torch file needs torch: the
caller passes ``torch_tensors`` (loading the file weights-only), else the file is named.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

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
_CHUNK = 8 << 20
MAX_HEADER_BYTES = 100_000_000

TensorDigests = Callable[[str], Mapping[str, str]]
"""Loads a torch file and gives key path -> digest of each tensor (needs torch; ImportError
without it, and the file is then named instead of its tensors)."""


def digest(data: Any) -> str:
    """BLAKE3 (hex) of a bytes-like object."""
    return blake3.blake3(data).hexdigest()


def file_digest(path: str) -> tuple[int, str]:
    """(size, BLAKE3) of a file, read in pieces."""
    h = blake3.blake3()
    size = 0
    with open(path, "rb") as f:
        while piece := f.read(_CHUNK):
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
    """One thing that does not match: the file, the tensor if known, what is wrong."""

    file: str
    problem: str
    tensor: str | None = None

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
    """Files no digest covers (not a failure; listed so nobody takes them as checked)."""

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
        problems of files checked against a digest (an unreadable file that may never have
        carried one is left to whoever reads it)."""
        problems = [p for p in self.problems if p.file in self.checked]
        if problems:
            shown = "; ".join(str(p) for p in problems[:5])
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            raise CorruptionError(f"{self.path} does not match its recorded digests: {shown}{more}")


def verify_path(path: str, torch_tensors: TensorDigests | None = None) -> VerifyReport:
    """Check a file or folder against the digests it carries (see the module docstring).

    A folder needs its sidecar, or safetensors files with their own digests; a file, its own
    digests or a sidecar beside it that lists it. Nothing to check against is a problem too
    (``no ckstore digests``): a verifier must not pass what it could not check.
    """
    report = VerifyReport(os.fspath(path))
    root = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    only = None if os.path.isdir(path) else os.path.basename(path)
    listed = _check_sidecar(root, only, report, torch_tensors)
    candidates = _files(root) if only is None else [only]
    sealed = []
    for rel in candidates:
        if rel == SIDECAR:
            continue
        full = os.path.join(root, rel)
        own = _is_safetensors(full) and _check_safetensors(full, rel, report)
        if own:
            sealed.append(rel)
        elif rel not in listed:
            report.unverified.append(rel)
    if only is None and sealed and not os.path.isfile(os.path.join(root, SIDECAR)):
        report.problems.append(
            Finding(
                SIDECAR,
                f"missing: the folder holds ckstore exports ({sealed[0]}) but not "
                "the digests of its other files",
            )
        )
    if report.files == 0 and not report.problems:
        report.problems.append(
            Finding(
                only or ".",
                f"no ckstore digests to check against (no {SIDECAR}, "
                f"no {METADATA_KEY!r} in safetensors metadata)",
            )
        )
    return report


def _files(root: str) -> list[str]:
    out = []
    for d, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            rel = os.path.relpath(os.path.join(d, name), root).replace(os.sep, "/")
            out.append(rel)
    return out


# --- the sidecar ----------------------------------------------------------------------------
def _check_sidecar(
    root: str, only: str | None, report: VerifyReport, torch_tensors: TensorDigests | None
) -> set[str]:
    """Check the files the sidecar lists (all, or ``only``); returns the names it lists."""
    where = os.path.join(root, SIDECAR)
    if not os.path.isfile(where):
        return set()
    doc = _read_sidecar(where, report)
    if doc is None:
        return set()
    files: dict[str, Any] = doc["files"]
    for rel, rec in sorted(files.items()):
        if only is not None and rel != only:
            continue
        report.checked.add(rel)
        full = os.path.join(root, *rel.split("/"))
        if not os.path.isfile(full):
            report.problems.append(Finding(rel, "listed in the digests but missing"))
            continue
        size, got = file_digest(full)
        if (size, got) == (rec.get("size"), rec.get("blake3")):
            report.tensors += len(doc["tensors"].get(rel, {}))
            continue
        named = _name_torch_tensors(full, rel, doc["tensors"].get(rel), torch_tensors, report)
        if not named:
            report.problems.append(
                Finding(
                    rel,
                    f"{size} bytes, BLAKE3 {got[:16]}…; recorded {rec.get('size')} "
                    f"bytes, {str(rec.get('blake3'))[:16]}…",
                )
            )
    return set(files)


def _read_sidecar(where: str, report: VerifyReport) -> dict[str, Any] | None:
    with open(where, "rb") as f:
        raw = f.read()
    try:
        doc = json.loads(raw)
        ok = (
            isinstance(doc, dict)
            and doc.get("format") == SIDECAR_FORMAT
            and isinstance(doc.get("files"), dict)
            and isinstance(doc.get("tensors", {}), dict)
            and isinstance(doc.get("digest"), str)
        )
    except ValueError as exc:
        report.problems.append(Finding(SIDECAR, f"not readable JSON ({exc})"))
        return None
    if not ok:
        report.problems.append(Finding(SIDECAR, "not a ckstore digests file"))
        return None
    if self_digest(raw, doc["digest"]) != doc["digest"]:
        report.problems.append(
            Finding(SIDECAR, "its own digest does not match: the digests file is damaged")
        )
        return None
    doc.setdefault("tensors", {})
    return doc


def _name_torch_tensors(
    full: str,
    rel: str,
    recorded: Mapping[str, str] | None,
    torch_tensors: TensorDigests | None,
    report: VerifyReport,
) -> bool:
    """For a damaged torch file: name the tensors that differ (needs ``torch_tensors``)."""
    if not recorded or torch_tensors is None:
        return False
    try:
        live = torch_tensors(full)
    except ImportError:
        return False  # no torch here: the file is named, not its tensors
    except Exception as exc:  # noqa: BLE001 - a damaged file may not load at all: named below
        report.problems.append(
            Finding(rel, f"does not match its digest and does not load ({type(exc).__name__})")
        )
        return True
    wrong = sorted(k for k, d in recorded.items() if live.get(k) != d)
    for key in wrong:
        report.problems.append(Finding(rel, "bytes differ from the recorded digest", key))
    if not wrong:
        report.problems.append(
            Finding(
                rel,
                "does not match its digest (its tensors do: the damage is elsewhere in the file)",
            )
        )
    return True


# --- safetensors files ------------------------------------------------------------------------
def _is_safetensors(path: str) -> bool:
    if path.lower().endswith(".safetensors"):
        return True
    try:
        with open(path, "rb") as f:
            head = f.read(9)
    except OSError:
        return False
    return (
        len(head) == 9
        and head[8:9] == b"{"
        and struct.unpack("<Q", head[:8])[0] < os.path.getsize(path)
    )


def _check_safetensors(path: str, rel: str, report: VerifyReport) -> bool:
    """Check a safetensors file against its own digests; False if it carries none."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        raw = head + f.read(n) if 0 <= n <= min(MAX_HEADER_BYTES, size - 8) else b""
    if not raw:
        return _unreadable(
            report, rel, f"not a safetensors file (header length {n} for {size} bytes)"
        )
    try:
        header = json.loads(raw[8:])
        meta = header.get("__metadata__") or {}
        value = meta.get(METADATA_KEY)
    except (ValueError, AttributeError) as exc:
        return _unreadable(
            report, rel, f"header is not readable JSON ({type(exc).__name__}: {exc})"
        )
    if value is None:
        if any(str(k).startswith("ckstore.") for k in meta):
            return _damaged(
                report,
                rel,
                f"a ckstore export whose {METADATA_KEY!r} is missing (damaged metadata)",
            )
        return False
    try:
        rec = json.loads(value)
        claimed, tensors = rec["header"], rec["tensors"]
        assert (
            rec["algorithm"] == ALGORITHM and isinstance(tensors, dict) and isinstance(claimed, str)
        )
    except (ValueError, KeyError, TypeError, AssertionError):
        return _damaged(report, rel, f"its {METADATA_KEY!r} metadata is malformed")
    report.checked.add(rel)
    if self_digest(raw, claimed) != claimed:
        report.problems.append(Finding(rel, "header bytes differ from the recorded header digest"))
        return True
    _check_tensors(path, rel, header, tensors, 8 + n, size, report)
    return True


def _unreadable(report: VerifyReport, rel: str, problem: str) -> bool:
    """A file that cannot be read as safetensors: a problem for a verifier, but whether it
    ever carried digests is unknown (an import leaves the refusal to the format's reader)."""
    report.problems.append(Finding(rel, problem))
    return True


def _damaged(report: VerifyReport, rel: str, problem: str) -> bool:
    report.checked.add(rel)
    report.problems.append(Finding(rel, problem))
    return True


def _check_tensors(
    path: str,
    rel: str,
    header: dict[str, Any],
    tensors: Mapping[str, str],
    start: int,
    size: int,
    report: VerifyReport,
) -> None:
    names = [k for k in header if k != "__metadata__"]
    if set(names) != set(tensors):
        report.problems.append(
            Finding(rel, f"header lists {len(names)} tensors, the digests {len(tensors)}")
        )
        return
    spans = []
    for name in names:
        try:
            begin, end = (int(x) for x in header[name]["data_offsets"])
        except (KeyError, TypeError, ValueError):
            report.problems.append(Finding(rel, "malformed data_offsets", name))
            continue
        spans.append((begin, end, name))
    covered = 0
    with open(path, "rb") as f:
        for begin, end, name in sorted(spans):
            if begin != covered or end < begin or start + end > size:
                report.problems.append(
                    Finding(rel, f"bytes [{begin}, {end}) do not follow the data before them", name)
                )
                covered = max(covered, end)
                continue
            f.seek(start + begin)
            h = blake3.blake3()
            left = end - begin
            while left:
                piece = f.read(min(left, _CHUNK))
                if not piece:
                    break
                h.update(piece)
                left -= len(piece)
            report.tensors += 1
            if left or h.hexdigest() != tensors[name]:
                report.problems.append(Finding(rel, "bytes differ from the recorded digest", name))
            covered = end
    if start + covered != size:
        report.problems.append(Finding(rel, f"{size - start - covered} bytes past the last tensor"))


def tensor_digests(pairs: Iterable[tuple[str, Any]]) -> dict[str, str]:
    """Key -> BLAKE3 of each raw byte buffer in ``pairs``."""
    return {k: digest(v) for k, v in pairs}
