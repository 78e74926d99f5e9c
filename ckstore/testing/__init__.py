"""The conformance suite of the :class:`~ckstore.objects.Backend` contract, for any backend.

Every backend ckstore ships (memory, local disk, any fsspec URL, S3) passes these tests; a
backend you write passes them too before ckstore can trust it. Subclass
:class:`BackendConformance` in a pytest module and give it a ``backend`` fixture that yields a
fresh, empty backend (and closes it)::

    import pytest
    from ckstore.testing import BackendConformance

    class TestMyBackend(BackendConformance):
        @pytest.fixture
        def backend(self, tmp_path):
            b = MyBackend(tmp_path / "store")
            yield b
            b.close()

The tests pin down the contract written in ``ckstore/objects/backend.py``: create-only puts
(exactly one winner among concurrent writers of a name), ranged and exact reads and views,
truncation reported as corruption, idempotent deletes, sorted listing by prefix, and names validated at
the boundary. It needs pytest (the test extra); ckstore itself never imports this module.
"""

from __future__ import annotations

import threading

import pytest

from ..errors import CorruptionError, InvalidInputError, ObjectNotFoundError
from ..objects import Backend

NAME = "packs/ab/abcdef.pack"

__all__ = ["NAME", "BackendConformance"]


class BackendConformance:
    """The Backend contract as tests; subclass it with a ``backend`` fixture (module docstring)."""

    def test_put_get_round_trip(self, backend: Backend) -> None:
        assert backend.put(NAME, b"hello world") is True
        assert backend.get(NAME) == b"hello world"
        assert backend.size(NAME) == 11
        assert backend.exists(NAME)

    def test_ranged_get(self, backend: Backend) -> None:
        data = bytes(range(256)) * 4
        backend.put(NAME, data)
        assert backend.get(NAME, 10, 20) == data[10:30]
        assert backend.get(NAME, 1000) == data[1000:]
        assert backend.get(NAME, 5, 0) == b""
        assert backend.get(NAME, len(data)) == b""

    def test_put_sequence_of_buffers(self, backend: Backend) -> None:
        parts: list[bytes | bytearray | memoryview] = [
            b"abc",
            memoryview(b"defgh"),
            bytearray(b""),
            memoryview(b"xyz")[1:],
        ]
        assert backend.put(NAME, parts)
        assert backend.get(NAME) == b"abcdefghyz"

    def test_create_if_absent(self, backend: Backend) -> None:
        assert backend.put(NAME, b"first") is True
        assert backend.put(NAME, b"other") is False  # of the size in place (see Backend)
        assert backend.get(NAME) == b"first"

    def test_empty_object(self, backend: Backend) -> None:
        assert backend.put("e/empty", b"")
        assert backend.size("e/empty") == 0
        assert backend.get("e/empty") == b""

    def test_missing_object(self, backend: Backend) -> None:
        for call in (lambda: backend.get("no/such"), lambda: backend.size("no/such")):
            with pytest.raises(ObjectNotFoundError) as info:
                call()
            assert "no/such" in str(info.value) and backend.url in str(info.value)
        assert not backend.exists("no/such")

    def test_short_range_is_corruption(self, backend: Backend) -> None:
        backend.put(NAME, b"0123456789")
        with pytest.raises(CorruptionError, match="truncated"):
            backend.get(NAME, 5, 10)
        with pytest.raises(CorruptionError, match="truncated"):
            backend.get(NAME, 20, 1)

    def test_get_into_reads_exactly_into_the_buffer(self, backend: Backend) -> None:
        data = bytes(range(256)) * 4
        backend.put(NAME, data)
        buf = bytearray(b"\xee" * 40)
        backend.get_into(NAME, 10, memoryview(buf)[5:25])
        assert buf[5:25] == data[10:30] and buf[:5] == b"\xee" * 5 and buf[25:] == b"\xee" * 15
        with pytest.raises(CorruptionError, match="truncated"):
            backend.get_into(NAME, 1020, memoryview(bytearray(10)))
        with pytest.raises(ObjectNotFoundError):
            backend.get_into("no/such", 0, memoryview(bytearray(1)))

    def test_get_into_each_hands_over_the_whole_read_in_order(self, backend: Backend) -> None:
        data = bytes(range(256)) * 4
        backend.put(NAME, data)
        buf = bytearray(1000)
        pieces: list[bytes] = []
        backend.get_into_each(NAME, 7, memoryview(buf), lambda p: pieces.append(bytes(p)))
        assert bytes(buf) == data[7:1007] and b"".join(pieces) == data[7:1007]
        with pytest.raises(CorruptionError, match="truncated"):
            backend.get_into_each(NAME, 1020, memoryview(bytearray(10)), lambda p: None)

    def test_view_is_the_range_and_outlives_a_delete(self, backend: Backend) -> None:
        data = bytes(range(256)) * 64
        backend.put(NAME, data)
        view = backend.view(NAME, 1000, 300)
        assert view.readonly and bytes(view) == data[1000:1300]
        assert bytes(backend.view(NAME, 0, 0)) == b""
        assert backend.current(view)
        backend.drop(NAME, 1000, 300)  # hints: never an error, the view still reads
        backend.prefetch(NAME, 0, len(data))
        assert backend.read_ahead() >= 0
        assert bytes(view) == data[1000:1300]
        backend.delete(NAME)
        assert bytes(view) == data[1000:1300]  # a mapping outlives the object's deletion
        with pytest.raises(ObjectNotFoundError):
            backend.view(NAME, 0, 1)

    def test_view_past_the_end_is_corruption(self, backend: Backend) -> None:
        backend.put(NAME, b"abc")
        with pytest.raises(CorruptionError, match="truncated"):
            backend.view(NAME, 1, 10)

    def test_delete_is_idempotent(self, backend: Backend) -> None:
        backend.put(NAME, b"x")
        backend.delete(NAME)
        assert not backend.exists(NAME)
        backend.delete(NAME)
        with pytest.raises(ObjectNotFoundError):
            backend.get(NAME)
        assert backend.put(NAME, b"y") is True

    def test_list_with_prefix(self, backend: Backend) -> None:
        names = ["packs/aa/1.pack", "packs/ab/2.pack", "packs/ab/3.pack", "manifests/cd/4", "top"]
        for n in names:
            backend.put(n, n.encode())
        assert list(backend.list()) == sorted(names)
        assert list(backend.list("packs/")) == sorted(names[:3])
        assert list(backend.list("packs/ab")) == ["packs/ab/2.pack", "packs/ab/3.pack"]
        assert list(backend.list("packs/ab/")) == ["packs/ab/2.pack", "packs/ab/3.pack"]
        assert list(backend.list("nothing/")) == []
        assert not backend.exists("packs")

    def test_list_is_sorted_across_depths(self, backend: Backend) -> None:
        # "-" and "0" sort on either side of "/": a server that walks directories (SeaweedFS)
        # returns "a/b" first, the contract wants plain string order.
        names = ["a0", "a/b", "a-c", "a/b-c/d"]
        for n in names:
            backend.put(n, n.encode())
        assert list(backend.list()) == sorted(names)
        assert list(backend.list("a")) == sorted(names)

    def test_list_after_deleting_everything_is_empty(self, backend: Backend) -> None:
        # SeaweedFS keeps the emptied directories; s3fs's find() then reported the store's root
        # itself as an object.
        for n in ("packs/ab/1.pack", "top"):
            backend.put(n, b"x")
            backend.delete(n)
        assert list(backend.list()) == []
        assert list(backend.list("packs/")) == []
        assert not backend.exists("packs/ab")

    @pytest.mark.parametrize(
        "bad",
        ["", "/abs", "a//b", "a/", "../x", "a/../b", "a\\b", "a/.hidden", "sp ace", "é", "a\nb"],
    )
    def test_bad_names_rejected(self, backend: Backend, bad: str) -> None:
        with pytest.raises(InvalidInputError):
            backend.put(bad, b"x")
        with pytest.raises(InvalidInputError):
            backend.get(bad)
        with pytest.raises(InvalidInputError):
            backend.exists(bad)

    def test_bad_range_rejected(self, backend: Backend) -> None:
        backend.put(NAME, b"abc")
        with pytest.raises(InvalidInputError):
            backend.get(NAME, -1, 1)
        with pytest.raises(InvalidInputError):
            backend.get(NAME, 0, -1)

    def test_concurrent_puts_one_winner(self, backend: Backend) -> None:
        results: list[bool] = []
        barrier = threading.Barrier(8)

        def worker() -> None:
            barrier.wait()
            results.append(backend.put(NAME, b"same content" * 100))

        threads = [threading.Thread(target=worker) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(results) == [False] * 7 + [True]
        assert backend.get(NAME) == b"same content" * 100

    def test_writer_publishes_pieces_with_a_patched_header(self, backend: Backend) -> None:
        out = backend.writer()
        out.write(bytes(4))
        out.write(b"payload-one")
        out.write(memoryview(bytearray(b"payload-two")))
        out.patch(0, b"HEAD")
        assert out.size == 26
        assert not backend.exists(NAME)  # nothing visible before commit
        assert out.commit(NAME) is True
        assert backend.get(NAME) == b"HEADpayload-onepayload-two"
        assert list(backend.list()) == [NAME]  # the staging place is never listed

    def test_writer_commit_is_create_if_absent(self, backend: Backend) -> None:
        backend.put(NAME, b"first")
        out = backend.writer()
        out.write(b"other")
        assert out.commit(NAME) is False
        assert backend.get(NAME) == b"first"

    def test_writer_buffers_may_be_reused_when_it_holds_none(self, backend: Backend) -> None:
        out = backend.writer()
        buf = bytearray(b"abc")
        out.write(buf)
        if not out.holds_data:
            buf[:] = b"xyz"  # written away already: reusing the buffer changes nothing
        out.commit(NAME)
        assert backend.get(NAME) == b"abc"

    def test_aborted_writer_leaves_nothing(self, backend: Backend) -> None:
        out = backend.writer()
        out.write(b"half a pack")
        out.abort()
        out.abort()  # idempotent
        assert list(backend.list()) == []
        assert backend.sweep_temporary(float("inf")) == 0  # nothing left to sweep either

    def test_url_and_repr(self, backend: Backend) -> None:
        assert "://" in backend.url
        assert backend.url in repr(backend)
