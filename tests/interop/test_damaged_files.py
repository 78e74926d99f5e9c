"""A damaged checkpoint file is refused with a typed error, whatever byte is damaged.

``torch.load`` (weights-only) and ``zipfile`` raise IndexError, TypeError, AssertionError or
BadZipFile on some damaged bytes; the import boundary turns every one of them into
InvalidInputError (or UnsafePickleError), never an untyped exception.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import ckstore
from ckstore.errors import CkstoreError, InvalidInputError
from ckstore.interop import detect_format
from ckstore.interop._safeload import load_torch


def _saved(tmp_path: Path) -> bytes:
    path = tmp_path / "a.pt"
    torch.save({"w": torch.arange(100.0).reshape(10, 10), "n": 3, "l": [1, 2]}, path)
    return path.read_bytes()


def test_every_damaged_byte_of_a_torch_file_loads_or_raises_a_ckstore_error(tmp_path: Path) -> None:
    raw = _saved(tmp_path)
    target = tmp_path / "damaged.pt"
    untyped = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Detected pickle protocol ..." on damaged headers
        for pos in range(len(raw)):
            for mask in (0x01, 0xFF):
                data = bytearray(raw)
                data[pos] ^= mask
                target.write_bytes(data)
                try:
                    load_torch(str(target))
                except CkstoreError:
                    pass
                except Exception as exc:  # noqa: BLE001 - what the test looks for
                    untyped.append((pos, mask, type(exc).__name__))
    assert untyped == []


def test_a_damaged_zip_end_record_is_refused_by_detection_and_import(tmp_path: Path) -> None:
    raw = bytearray(_saved(tmp_path))
    # the zip64 end locator's "number of disks" (4 bytes before the end record's signature)
    eocd = raw.rfind(b"PK\x05\x06")
    locator = raw.rfind(b"PK\x06\x07")
    assert locator >= 0 and eocd > locator
    raw[locator + 16] = 2  # total disks = 2: zipfile raises BadZipFile("... span multiple disks")
    path = tmp_path / "odd.dat"
    path.write_bytes(raw)
    with pytest.raises(InvalidInputError, match="cannot tell its format"):
        detect_format(str(path))  # not a zip any more, and not safetensors: an error, typed
    store = ckstore.open(tmp_path / "s", create=True)
    with pytest.raises(InvalidInputError, match="not a readable torch.save file"):
        store.import_checkpoint(path, run="r", format="torch")
    store.close()
