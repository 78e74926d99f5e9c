"""``wait_pushed`` reports a push that keeps failing, however soon its retry comes.

Before: it raised the push's error only at a moment with no push wanted and none running. A
retry due at once (a short delay on a busy machine: the clean-clone CI of 9634c26, the tier's
bucket folder taken away, retries every 0.2 s) left no such moment, so a minute's wait
returned False, the remote's failure unsaid; and ``close``, which waits for that error to give
up, waited forever.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest

import ckstore
from ckstore import errors
from ckstore.remote import uploader as uploader_mod
from tests.support.remotes import KNOBS, fill


def test_a_push_failing_with_its_retry_already_due_is_raised_not_timed_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    remote = tmp_path / "tier"
    with ckstore.open(tmp_path / "local", create=True, push_to=str(remote), **KNOBS) as s:
        fill(s, "r", [1])
        assert s.wait_pushed(timeout=60)
    shutil.rmtree(remote)  # an unmounted share: pushes fail until it is back

    failed = uploader_mod.Uploader._failed

    def retry_due_at_once(self: uploader_mod.Uploader, exc: BaseException) -> None:
        failed(self, exc)
        with self._cond:  # the retry's timer fired before the round ended
            self._wanted = True

    monkeypatch.setattr(uploader_mod.Uploader, "_failed", retry_due_at_once)
    monkeypatch.setattr(uploader_mod, "RETRY_SECONDS", (0.5,))
    monkeypatch.setattr(uploader_mod, "CLOSE_ATTEMPTS", 1)
    store = ckstore.open(tmp_path / "local", push_to=str(remote))
    closing = threading.Thread(target=store.close, daemon=True)
    try:
        fill(store, "r", [2])
        with pytest.raises((errors.NotFoundError, errors.StorageError), match="tier"):
            store.wait_pushed(timeout=10)
    finally:
        closing.start()  # gives up after CLOSE_ATTEMPTS failures (before: waited forever)
        closing.join(30)
    assert not closing.is_alive()
    with ckstore.open(tmp_path / "local") as again:  # what was not pushed stays, and restores
        assert [s.step for s in again.log()] == [2, 1]
