"""Untag from a snapshot's panel removes the tag from that snapshot only: a tag that moved
since the panel was drawn (a training job moves ``best`` to each better step) stays where it
is, still protecting the snapshot it now names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import ckstore
from tests.ui.browser import Served, serve
from tests.ui.test_security import request


def test_untag_refuses_a_tag_that_moved_to_another_snapshot(
    scenario: tuple[Path, dict[str, str]], store_copy: Path, writable: Served
) -> None:
    old, new = scenario[1]["sft-frozen@300"], scenario[1]["sft-frozen@400"]  # "best" is at @300
    with ckstore.open(store_copy, create=False) as store:
        store.tag(new, "best", force=True)  # moved since the panel of @300 was drawn
    token = {"X-Ckstore-Token": "right-token"}
    body = {"name": "best", "snapshot": old}  # as details.js sends it from @300's panel
    status, _, out = request(writable, "POST", "/api/untag", body, token)
    assert status == 409 and "best" in json.loads(out)["error"]
    with ckstore.open(store_copy, create=False) as store:
        assert store.tags()["best"] == new


@pytest.mark.browser
def test_in_the_browser_untag_never_removes_a_tag_from_another_snapshot(
    browser: Any, scenario: tuple[Path, dict[str, str]], store_copy: Path
) -> None:
    old, new = scenario[1]["sft-frozen@300"], scenario[1]["sft-frozen@400"]  # "best" is at @300
    s = serve(str(store_copy), token="secret")
    try:
        p = browser.page()
        p.goto(s.base + "/?token=secret")
        p.wait_for_selector("html[data-forks]")
        at = p.evaluate("(id) => window.ckstoreUI.where(id)", old)
        p.mouse.click(at["x"], at["y"])
        p.wait_for_selector("button.untag[data-tag='best']")
        with ckstore.open(store_copy, create=False) as store:
            store.tag(new, "best", force=True)  # the training job moves "best" to @400
        p.click("button.untag[data-tag='best']")
        p.click("#confirm-ok")
        p.wait_for_function(  # an error in the banner, or the tag gone
            "() => !document.getElementById('banner').hidden"
            " || !('best' in window.ckstoreUI.state.ov.tags)"
        )
        p.close()
    finally:
        s.stop()
    with ckstore.open(store_copy, create=False) as store:
        assert store.tags().get("best") == new, "untag on @300's panel removed @400's tag"
