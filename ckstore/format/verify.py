"""``ckstore verify``: a file or folder checked against the digests it carries, without a store.

:func:`verify_path` checks safetensors files against their own digests and every file the
sidecar (``ckstore-digests.json``) lists, byte for byte (the digests themselves are
:mod:`ckstore.format.digests`). Naming the tensor of a damaged torch file needs torch: the
caller passes ``torch_tensors`` (loading the file weights-only), else the file is named.

The folder is not trusted: where a sidecar exists, a file it does not list is a finding and is
not read (a sealed file from another export beside this one would otherwise pass, and a loader
may pick it up first); a name in the sidecar that is not a plain relative path inside the folder
(``..``, absolute, through a link to a folder elsewhere) is a finding and never read; only
regular files are opened (a FIFO would block the reader forever; links are not followed); JSON
nested too deeply, and offsets that are not integers (``1e999``), are findings, never a
RecursionError or OverflowError.
"""

from __future__ import annotations

import json
import os
import stat
import struct
from collections.abc import Mapping
from typing import Any

import blake3

from .digests import (
    ALGORITHM,
    MAX_HEADER_BYTES,
    METADATA_KEY,
    READ_BYTES,
    SIDECAR,
    SIDECAR_FORMAT,
    Finding,
    TensorDigests,
    VerifyReport,
    file_digest,
    open_regular,
    self_digest,
)


def verify_path(
    path: str, torch_tensors: TensorDigests | None = None, *, strict: bool = False
) -> VerifyReport:
    """Check a file or folder against the digests it carries (see the module docstring).

    A folder needs its sidecar, or safetensors files with their own digests; a file, its own
    digests or a sidecar beside it that lists it. Nothing to check against is a problem too
    (``no ckstore digests``, :attr:`VerifyReport.nothing_to_check`): a verifier must not pass
    what it could not check. Where a sidecar is readable, every file it does not list is a
    problem, and is not read. Without a sidecar, files no digest covers (a
    ``pytorch_model.bin`` dropped beside sealed safetensors files) are listed as
    ``unverified``; ``strict`` makes each of them a problem too.
    """
    report = VerifyReport(os.fspath(path))
    root = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    only = None if os.path.isdir(path) else os.path.basename(path)
    listed = _check_sidecar(root, only, report, torch_tensors)
    candidates = _files(root) if only is None else [only]
    sealed = []
    for rel in candidates:
        full = os.path.join(root, rel)
        if rel == SIDECAR:
            continue
        if listed is not None and rel not in listed:
            report.problems.append(Finding(rel, f"not listed in {SIDECAR}: {_FOREIGN}"))
        elif listed is not None:  # checked byte for byte; a safetensors file names its tensors
            if _is_file(full) and _is_safetensors(full):
                _check_safetensors(full, rel, report)
        elif not _regular(full, rel, report):
            continue
        elif _is_safetensors(full) and _check_safetensors(full, rel, report):
            sealed.append(rel)
        else:
            report.unverified.append(rel)
    if only is None and sealed and not os.path.lexists(os.path.join(root, SIDECAR)):
        report.problems.append(
            Finding(
                SIDECAR,
                f"missing: the folder holds ckstore exports ({sealed[0]}) but not "
                "the digests of its other files",
                binding=False,
            )
        )
    if strict:
        for rel in report.unverified:
            report.problems.append(Finding(rel, f"no digest covers it (--strict): {_FOREIGN}"))
    if report.files == 0 and not report.problems:
        report.nothing_to_check = True
        report.problems.append(
            Finding(
                only or ".",
                f"no ckstore digests to check against (no {SIDECAR}, "
                f"no {METADATA_KEY!r} in safetensors metadata)",
                binding=False,
            )
        )
    return report


_FOREIGN = (
    "the export did not write it (a file from elsewhere, which a loader may pick up first); "
    "remove it, or check it on its own somewhere else"
)


def _files(root: str) -> list[str]:
    """Every entry under ``root`` that is not a folder (links, FIFOs included; links to
    folders are not followed), as ``/``-separated paths, sorted."""
    out = []
    stack = [""]
    while stack:
        rel_dir = stack.pop()
        with os.scandir(os.path.join(root, rel_dir)) as it:
            entries = sorted(it, key=lambda e: e.name)
        for e in entries:
            rel = f"{rel_dir}/{e.name}" if rel_dir else e.name
            if e.is_dir(follow_symlinks=False):
                stack.append(rel)
            else:
                out.append(rel)
    return sorted(out)


def _is_file(full: str) -> bool:
    """Whether ``full`` is a regular file (a link is not)."""
    try:
        return stat.S_ISREG(os.lstat(full).st_mode)
    except OSError:
        return False


def _regular(full: str, rel: str, report: VerifyReport) -> bool:
    """Whether ``full`` is a regular file; else a finding (it is never opened)."""
    try:
        mode = os.lstat(full).st_mode
    except FileNotFoundError:
        return False
    if stat.S_ISREG(mode):
        return True
    kinds = ((stat.S_ISLNK, "a link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a folder"))
    kind = next((name for test, name in kinds if test(mode)), "a device or socket")
    report.problems.append(Finding(rel, f"not a regular file ({kind}): not read"))
    return False


def _inside(root: str, rel: Any) -> str | None:
    """The path of sidecar name ``rel`` under ``root``, or None if it is not a plain relative
    path that stays inside ``root`` (no ``..``, ``.``, empty or absolute part, no link to a
    folder elsewhere)."""
    if not isinstance(rel, str) or not rel or "\0" in rel or "\\" in rel:
        return None
    parts = rel.split("/")
    if any(p in ("", ".", "..") for p in parts) or os.path.isabs(rel):
        return None
    full = os.path.join(root, *parts)
    real_root = os.path.realpath(root)
    if os.path.commonpath([real_root, os.path.realpath(os.path.dirname(full))]) != real_root:
        return None
    return full


def _loads(raw: bytes | str) -> Any:
    """``json.loads``, with nesting too deep for the parser a ValueError like any other."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("nested too deeply to be read") from None


# --- the sidecar ----------------------------------------------------------------------------
def _check_sidecar(
    root: str, only: str | None, report: VerifyReport, torch_tensors: TensorDigests | None
) -> set[str] | None:
    """Check the files the sidecar lists (all, or ``only``); returns the names it lists, or
    None without a readable sidecar."""
    where = os.path.join(root, SIDECAR)
    if not os.path.lexists(where) or not _regular(where, SIDECAR, report):
        return None
    doc = _read_sidecar(where, report)
    if doc is None:
        return None
    files: dict[str, Any] = doc["files"]
    for rel, rec in sorted(files.items()):
        if only is not None and rel != only:
            continue
        full = _inside(root, rel)
        if full is None:
            report.problems.append(Finding(rel, "not a path inside the folder: not read"))
            continue
        report.checked.add(rel)
        if not os.path.lexists(full):
            report.problems.append(Finding(rel, "listed in the digests but missing"))
            continue
        if not _regular(full, rel, report):
            continue
        size, got = file_digest(full)
        if (size, got) == (rec["size"], rec["blake3"]):
            report.tensors += len(doc["tensors"].get(rel, {}))
            continue
        named = _name_torch_tensors(full, rel, doc["tensors"].get(rel), torch_tensors, report)
        if not named:
            report.problems.append(
                Finding(
                    rel,
                    f"{size} bytes, BLAKE3 {got[:16]}…; recorded {rec['size']} "
                    f"bytes, {str(rec['blake3'])[:16]}…",
                )
            )
    return set(files)


def _read_sidecar(where: str, report: VerifyReport) -> dict[str, Any] | None:
    with open_regular(where) as f:
        raw = f.read()
    try:
        doc = _loads(raw)
    except ValueError as exc:
        report.problems.append(Finding(SIDECAR, f"not readable JSON ({exc})"))
        return None
    if not _sidecar_shape(doc):
        report.problems.append(Finding(SIDECAR, "not a ckstore digests file"))
        return None
    if self_digest(raw, doc["digest"]) != doc["digest"]:
        report.problems.append(
            Finding(SIDECAR, "its own digest does not match: the digests file is damaged")
        )
        return None
    doc.setdefault("tensors", {})
    return doc


def _sidecar_shape(doc: Any) -> bool:
    """Whether ``doc`` has the sidecar's shape: ``files`` name -> {size: int, blake3: str},
    ``tensors`` name -> {key: str}, a str ``digest``."""
    if not isinstance(doc, dict) or doc.get("format") != SIDECAR_FORMAT:
        return False
    files, tensors = doc.get("files"), doc.get("tensors", {})
    if not isinstance(doc.get("digest"), str) or not isinstance(files, dict):
        return False
    if not isinstance(tensors, dict):
        return False
    for rec in files.values():
        if not isinstance(rec, dict) or not isinstance(rec.get("blake3"), str):
            return False
        size = rec.get("size")
        if type(size) is not int or size < 0:
            return False
    return all(
        isinstance(t, dict) and all(isinstance(d, str) for d in t.values())
        for t in tensors.values()
    )


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
        with open_regular(path) as f:
            head = f.read(9)
            size = os.fstat(f.fileno()).st_size
    except OSError:
        return False
    return len(head) == 9 and head[8:9] == b"{" and struct.unpack("<Q", head[:8])[0] < size


def _check_safetensors(path: str, rel: str, report: VerifyReport) -> bool:
    """Check a safetensors file against its own digests; False if it carries none."""
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            raw = head + f.read(n) if 0 <= n <= min(MAX_HEADER_BYTES, size - 8) else b""
    except OSError as exc:
        return _unreadable(report, rel, f"cannot be read ({exc})")
    if not raw:
        return _unreadable(
            report, rel, f"not a safetensors file (header length {n} for {size} bytes)"
        )
    try:
        header = _loads(raw[8:])
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
        rec = _loads(value)
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
    report.problems.append(Finding(rel, problem, binding=False))
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
        offsets = _offsets(header[name])
        if offsets is None:
            report.problems.append(Finding(rel, "malformed data_offsets", name))
            continue
        spans.append((*offsets, name))
    covered = 0
    with open_regular(path) as f:
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
                piece = f.read(min(left, READ_BYTES))
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


def _offsets(entry: Any) -> tuple[int, int] | None:
    """A tensor entry's ``data_offsets`` as two ints, or None (not a pair of non-negative
    integers: ``1e999``, ``4.5`` and ``true`` are not offsets)."""
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    if not isinstance(offsets, list) or len(offsets) != 2:
        return None
    if not all(type(x) is int and x >= 0 for x in offsets):
        return None
    return offsets[0], offsets[1]
