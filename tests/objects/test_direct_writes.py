"""Direct writes (``objects/direct.py``): the same object, byte for byte, around the page cache.

A pack written with ``direct`` goes through an aligned buffer and ``O_DIRECT``; its unaligned
tail and patches of bytes already on the disk through an ordinary descriptor; where direct I/O
is refused (at open, or at the first write: a device with larger blocks) everything is buffered.
Every path must publish exactly the bytes a buffered writer would.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import ckstore
from ckstore.objects import direct
from ckstore.objects.direct import ALIGN, BOUNCE_BYTES, DirectAppender
from ckstore.objects.local import LocalBackend
from tests.support.paths import REPO


def _parts(seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    sizes = [16, 1, ALIGN - 1, ALIGN, ALIGN + 1, BOUNCE_BYTES - 17, BOUNCE_BYTES, 3 * BOUNCE_BYTES]
    sizes += [int(n) for n in rng.integers(1, 2 * BOUNCE_BYTES, 6)]
    return [rng.bytes(n) for n in sizes]


def _write(backend: LocalBackend, name: str, parts: list[bytes], direct_: bool) -> bytes:
    """Write ``parts``, then patch a header and a few bytes early on (on the disk by then)."""
    out = backend.writer(direct_)
    for p in parts:
        out.write(p)
    out.patch(0, b"H" * 16)
    out.patch(20, b"PATCHED")
    assert out.commit(name)
    return backend.get(name)


def _expected(parts: list[bytes]) -> bytes:
    want = bytearray(b"".join(parts))
    want[0:16] = b"H" * 16
    want[20:27] = b"PATCHED"
    return bytes(want)


@pytest.mark.parametrize("seed", [0, 1])
def test_a_direct_writer_publishes_the_bytes_a_buffered_one_does(tmp_path: Path, seed: int) -> None:
    backend = LocalBackend(str(tmp_path / "s"))
    parts = _parts(seed)
    assert _write(backend, "direct", parts, True) == _expected(parts)
    assert _write(backend, "buffered", parts, False) == _expected(parts)
    assert not [n for n in os.listdir(backend.root) if n.startswith(".writer-")]


def _direct_capable(tmp_path: Path) -> Path:
    """A folder on a file system with direct I/O: ``tmp_path``, else one beside the tests
    (a tmpfs ``/tmp`` has none)."""
    for base in (tmp_path, REPO / ".pytest-direct"):
        base.mkdir(parents=True, exist_ok=True)
        probe = base / "probe"
        probe.write_bytes(b"")
        fd = direct.open_direct(str(probe))
        probe.unlink()
        if fd is not None:
            os.close(fd)
            return base
    pytest.fail(f"neither {tmp_path} nor {REPO} offers O_DIRECT: the direct path is untested")


def test_this_disk_takes_direct_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The other tests here would pass with everything buffered: show the direct path ran."""
    spilled: list[int] = []
    real = DirectAppender._spill

    def spill(self: DirectAppender, nbytes: int) -> None:
        real(self, nbytes)
        spilled.append(nbytes if self.direct else -nbytes)

    monkeypatch.setattr(DirectAppender, "_spill", spill)
    root = _direct_capable(tmp_path) / f"s-{os.getpid()}-{id(spilled)}"
    try:
        backend = LocalBackend(str(root))
        parts = _parts(2)
        assert _write(backend, "o", parts, True) == _expected(parts)
        assert spilled and all(n > 0 for n in spilled)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_file_system_without_direct_io_gets_the_same_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("ckstore.objects.local.open_direct", lambda path: None)
    backend = LocalBackend(str(tmp_path / "s"))
    parts = _parts(3)
    assert _write(backend, "o", parts, True) == _expected(parts)


def test_a_device_that_refuses_the_direct_writes_midway_gets_the_same_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A device whose blocks are larger than ALIGN refuses the first direct write (EINVAL):
    the writer goes on buffered, from the same offset, and the object is the same."""
    real_pwrite = os.pwrite
    refused: list[int] = []

    def pwrite(fd: int, data: object, offset: int) -> int:
        if fd in direct_fds:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)  # type: ignore[arg-type]

    direct_fds: set[int] = set()
    real_open = direct.open_direct

    def open_direct(path: str) -> int | None:
        fd = real_open(path)
        if fd is not None:
            direct_fds.add(fd)
        return fd

    monkeypatch.setattr("ckstore.objects.local.open_direct", open_direct)
    monkeypatch.setattr(direct.os, "pwrite", pwrite)
    backend = LocalBackend(str(tmp_path / "s"))
    parts = _parts(4)
    assert _write(backend, "o", parts, True) == _expected(parts)
    assert refused == [0] or not direct_fds  # refused once, then buffered


def test_an_aborted_direct_writer_leaves_nothing(tmp_path: Path) -> None:
    backend = LocalBackend(str(tmp_path / "s"))
    out = backend.writer(True)
    out.write(b"x" * (BOUNCE_BYTES + 5))
    out.abort()
    assert not [n for n in os.listdir(backend.root) if n.startswith(".writer-")]
    assert list(backend.list()) == []


def _state(seed: int) -> dict[str, ckstore.StateDict]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": ckstore.StateDict(
            w=torch.randn(3_000_000, generator=g), b=torch.randn(77, generator=g)
        ),
        "optim": ckstore.StateDict(m=torch.randn(1_000_001, generator=g), step=seed),
    }


@pytest.mark.parametrize("knob", ["background", "always", "never"])
def test_takes_written_around_the_page_cache_restore_bit_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, knob: str
) -> None:
    """Which takes go direct is the knob's: an async take's background part by default, every
    take with ``"always"``, none with ``"never"``; each restores bit-exact and checks clean."""
    opened: list[str] = []
    real = direct.open_direct

    def open_direct(path: str) -> int | None:
        opened.append(path)
        return real(path)

    monkeypatch.setattr("ckstore.objects.local.open_direct", open_direct)
    with ckstore.open(tmp_path / "s", create=True) as store:
        store.direct_writes = knob
        a = store.take(_state(1), run="r", step=1)
        after_sync = len(opened)
        b = store.async_take(_state(2), run="r", step=2).wait()
        after_async = len(opened) - after_sync
        for snap, seed in ((a, 1), (b, 2)):
            want = _state(seed)
            got = _state(99)
            store.get(snap.id).restore(got)
            for app in want:
                for k, v in want[app].items():
                    same = torch.equal(v, got[app][k]) if torch.is_tensor(v) else v == got[app][k]
                    assert same, (knob, snap.step, app, k)
        assert store.check(read_data=True).ok
    assert (after_sync > 0) == (knob == "always")
    assert (after_async > 0) == (knob != "never")
