"""Local backend atomicity, the opener, hashing and the fault-injection wrapper."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckstore.errors import InvalidInputError, StorageError
from ckstore.objects import (
    HASH_NAME,
    CountingBackend,
    FaultyBackend,
    FsspecBackend,
    LocalBackend,
    chunk_id,
    is_chunk_id,
    memory_backend,
    open_backend,
)
from ckstore.objects import local as local_mod


def _all_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_no_temp_files_left(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path)
    backend.put("packs/ab/x.pack", [b"a", b"b"])
    backend.put("packs/ab/x.pack", b"again")
    assert _all_files(tmp_path) == ["packs/ab/x.pack"]


def test_failed_put_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = LocalBackend(tmp_path)
    calls = {"n": 0}
    real_write = os.write

    def failing_write(fd: int, data: memoryview) -> int:
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(28, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(local_mod.os, "write", failing_write)
    with pytest.raises(StorageError, match="No space left"):
        backend.put("packs/ab/x.pack", [b"first", b"second"])
    monkeypatch.undo()
    assert not backend.exists("packs/ab/x.pack")
    assert list(backend.list()) == []
    assert _all_files(tmp_path) == []
    assert backend.put("packs/ab/x.pack", b"ok") is True


def test_failed_fsync_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = LocalBackend(tmp_path)

    def failing_fsync(fd: int) -> None:
        raise OSError(5, "I/O error")

    monkeypatch.setattr(local_mod.os, "fsync", failing_fsync)
    with pytest.raises(StorageError):
        backend.put("a/b", b"data")
    monkeypatch.undo()
    assert _all_files(tmp_path) == []


def test_temp_files_are_not_listed(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path)
    backend.put("a/b", b"x")
    (tmp_path / "a" / ".b.tmp-123").write_bytes(b"partial")
    assert list(backend.list()) == ["a/b"]


def test_works_without_hard_links(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_link(src: str, dst: str) -> None:
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(local_mod.os, "link", no_link)
    backend = LocalBackend(tmp_path)
    assert backend.put("a/b", b"x") is True
    assert backend.put("a/b", b"y") is False
    assert backend.get("a/b") == b"x"
    assert _all_files(tmp_path) == ["a/b"]


def test_open_backend_dispatch(tmp_path: Path) -> None:
    assert isinstance(open_backend(str(tmp_path / "s")), LocalBackend)
    local = open_backend((tmp_path / "t").as_uri())
    assert isinstance(local, LocalBackend) and local.root == str(tmp_path / "t")
    mem = open_backend("memory://")
    assert isinstance(mem, FsspecBackend) and mem.url.startswith("memory://")
    assert open_backend("memory://").url != mem.url
    mem.put("k", b"v")
    assert open_backend(mem.url).get("k") == b"v"
    with pytest.raises(InvalidInputError):
        open_backend("nosuchproto://x")


def test_hashing() -> None:
    assert HASH_NAME == "blake3"
    empty = "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
    assert chunk_id(b"") == empty
    big = bytes(5 << 20)
    assert chunk_id(big) == chunk_id(memoryview(big)) == chunk_id(bytearray(big))
    assert is_chunk_id(empty) and not is_chunk_id(empty.upper()) and not is_chunk_id(empty[:-1])
    assert not is_chunk_id(None)


def test_faulty_fail_nth_put() -> None:
    backend = FaultyBackend(memory_backend(), fail_put_at=2)
    backend.put("a", b"1")
    with pytest.raises(StorageError, match="injected"):
        backend.put("b", b"2")
    assert not backend.exists("b")
    backend.put("c", b"3")


def test_counting_puts() -> None:
    backend = CountingBackend(memory_backend())
    backend.put("a", [b"12", b"345"])
    backend.put("a", b"x")
    assert (backend.put_calls, backend.bytes_written, backend.created) == (2, 6, 1)


def test_layer_imports_neither_torch_nor_index() -> None:
    """Static check of ckstore/objects itself (the parent package may import more)."""
    import ast

    import ckstore.objects

    package_dir = Path(ckstore.objects.__file__).parent
    for source in package_dir.glob("*.py"):
        for node in ast.walk(ast.parse(source.read_text(), str(source))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert name.split(".")[0] != "torch", f"{source.name} imports {name}"
                assert not name.startswith("ckstore.index"), f"{source.name} imports {name}"


def test_writer_streams_to_a_hidden_file_and_publishes_by_link(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path)
    out = backend.writer()
    assert out.holds_data is False
    out.write(b"x" * 1000)
    staged = [p for p in tmp_path.iterdir() if p.name.startswith(".writer-")]
    assert len(staged) == 1 and staged[0].stat().st_size == 1000  # on disk, not in memory
    assert list(backend.list()) == []
    assert out.commit("packs/ab/x.pack") is True
    assert _all_files(tmp_path) == ["packs/ab/x.pack"]
    with pytest.raises(StorageError, match="after commit or abort"):
        out.write(b"more")


def test_sweep_deletes_only_old_temporaries(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path)
    backend.put("packs/ab/x.pack", b"kept")
    killed = backend.writer()
    killed.write(b"half a pack")  # a process killed here leaves its staging file behind
    (tmp_path / "packs" / "ab" / ".y.pack.tmp-0123").write_bytes(b"half a put")
    (tmp_path / ".keep").write_bytes(b"not ours")
    old = os.stat(tmp_path / "packs/ab/x.pack").st_mtime - 10
    assert backend.sweep_temporary(old) == 0  # written after the cutoff: maybe alive
    assert backend.sweep_temporary(float("inf")) == 2
    assert _all_files(tmp_path) == [".keep", "packs/ab/x.pack"]


def test_views_of_a_file_share_one_mapping_that_goes_with_the_last_view(tmp_path: Path) -> None:
    import gc
    import mmap
    import weakref

    backend = LocalBackend(tmp_path)
    data = os.urandom(3 * mmap.PAGESIZE + 17)
    backend.put("packs/ab/x.pack", data)
    a, b = backend.view("packs/ab/x.pack", 0, 10), backend.view("packs/ab/x.pack", 5000, 100)
    assert a.obj is b.obj and isinstance(a.obj, mmap.mmap) and backend.mapped_views
    assert bytes(b) == data[5000:5100]
    gone = weakref.ref(a.obj)
    del a, b
    gc.collect()
    assert gone() is None  # unmapped with its last view


def test_a_file_written_in_place_is_noticed_and_mapped_anew(tmp_path: Path) -> None:
    import time

    backend = LocalBackend(tmp_path)
    backend.put("packs/ab/x.pack", b"a" * 10_000)
    path = tmp_path / "packs" / "ab" / "x.pack"
    view = backend.view("packs/ab/x.pack", 100, 100)
    time.sleep(0.02)  # a file's times tick with the kernel's clock
    path.chmod(0o644)
    with open(path, "r+b") as f:  # in place: the same inode (what I2 forbids)
        f.seek(150)
        f.write(b"b")
    assert not backend.current(view)
    assert bytes(backend.view("packs/ab/x.pack", 100, 100)) == b"a" * 50 + b"b" + b"a" * 49
    (tmp_path / "new").write_bytes(b"c" * 10_000)
    replaced = backend.view("packs/ab/x.pack", 0, 10)
    os.replace(tmp_path / "new", path)  # another file now: the mapping keeps the old bytes
    assert backend.current(replaced) and bytes(replaced) == b"a" * 10
    assert bytes(backend.view("packs/ab/x.pack", 0, 10)) == b"c" * 10


def test_a_file_cut_short_is_truncated_never_a_crash(tmp_path: Path) -> None:
    from ckstore.errors import CorruptionError, ObjectNotFoundError

    backend = LocalBackend(tmp_path)
    backend.put("packs/ab/x.pack", b"z" * 10_000)
    keep = backend.view("packs/ab/x.pack", 0, 8)  # a live mapping of the longer file
    path = tmp_path / "packs" / "ab" / "x.pack"
    path.chmod(0o644)
    path.write_bytes(b"z" * 100)
    with pytest.raises(CorruptionError, match="truncated"):
        backend.view("packs/ab/x.pack", 50, 100)  # mapped anew at its new size, refused
    path.write_bytes(b"")
    with pytest.raises(CorruptionError, match="truncated"):
        backend.view("packs/ab/x.pack", 0, 1)
    assert bytes(backend.view("packs/ab/x.pack", 0, 0)) == b""
    with pytest.raises(ObjectNotFoundError):
        backend.view("packs/ab/nope.pack", 0, 1)
    del keep


def test_counting_counts_views_and_keeps_the_mapping(tmp_path: Path) -> None:
    counting = CountingBackend(LocalBackend(tmp_path))
    counting.put("packs/ab/x.pack", b"q" * 5000)
    view = counting.view("packs/ab/x.pack", 10, 200)
    assert counting.mapped_views and counting.current(view)
    assert counting.get_calls == 1 and counting.bytes_read == 200
    assert not FaultyBackend(LocalBackend(tmp_path)).mapped_views  # faults go through its get


def test_a_folder_where_an_object_should_be_reads_as_missing_whatever_the_read(
    tmp_path: Path,
) -> None:
    """A read into a buffer refuses a folder of the object's name as a view does: missing (a
    restore then follows the chunk or heals it), not a storage error."""
    from ckstore.errors import ObjectNotFoundError

    b = LocalBackend(str(tmp_path))
    name = "packs/ab/" + "ab" * 32 + ".pack"
    os.makedirs(tmp_path / name)
    with pytest.raises(ObjectNotFoundError):
        b.get_into(name, 0, memoryview(bytearray(8)))
    with pytest.raises(ObjectNotFoundError):
        b.get(name, 0, 8)
    with pytest.raises(ObjectNotFoundError):
        b.view(name, 0, 8)
