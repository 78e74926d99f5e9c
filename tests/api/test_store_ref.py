"""A store as something that pickles: given open or by URL, reopened where it is used, and the
open handle of this process reused for its URL."""

from __future__ import annotations

import pickle
from pathlib import Path

import ckstore
from ckstore.store_ref import StoreRef, opened


def test_a_ref_pickles_by_url_and_reuses_the_open_handle(tmp_path: Path) -> None:
    store = ckstore.open(tmp_path / "s", create=True)
    ref = StoreRef(store)
    assert ref.get() is store and ref.is_open and not ref.owned
    assert opened(store.url) is store
    twin = pickle.loads(pickle.dumps(ref))
    assert twin.url == store.url and not twin.is_open
    assert twin.get() is store  # this process has it open: no second handle
    ref.close()  # given open: stays open
    assert not store.closed
    store.close()
    assert store.closed and opened(store.url) is None
    again = pickle.loads(pickle.dumps(ref))
    reopened = again.get()  # nothing open for the URL any more: opened anew, and owned
    assert reopened is not store and again.owned and not reopened.closed
    again.close()
    assert reopened.closed


def test_a_ref_by_url_opens_read_only_when_asked(tmp_path: Path) -> None:
    ckstore.open(tmp_path / "s", create=True).close()
    ref = StoreRef(str(tmp_path / "s"), read_only=True)
    store = ref.get()
    assert store.read_only and ref.owned
    ref.close()
