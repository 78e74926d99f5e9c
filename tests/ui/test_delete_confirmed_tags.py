"""A delete from the page removes the tags its confirmation named, never more: a tag set on
the snapshot after its panel was drawn (a training job's ``best``, a colleague's ``keep``)
protects it, as it does from ``ckstore rm`` without ``--force``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import ckstore
from tests.ui.browser import Served, serve
from tests.ui.test_security import request


def test_a_tag_set_after_the_panel_was_drawn_keeps_the_snapshot(
    scenario: tuple[Path, dict[str, str]], store_copy: Path, writable: Served
) -> None:
    target = scenario[1]["pretrain@30"]  # tagged "base"
    detail = json.loads(request(writable, "GET", f"/api/snapshot?ref={target}")[2])
    assert detail["tags"] == ["base"]  # what the confirmation names
    with ckstore.open(store_copy, create=False) as store:
        store.tag(target, "keep-forever")  # meanwhile, elsewhere
    token = {"X-Ckstore-Token": "right-token"}
    body = {"ref": detail["id"], "force": True, "tags": detail["tags"]}  # as details.js sends
    status, _, out = request(writable, "POST", "/api/delete", body, token)
    assert status == 409 and "keep-forever" in json.loads(out)["error"]
    with ckstore.open(store_copy, create=False) as store:
        assert store.tags()["keep-forever"] == target and store.tags()["base"] == target
    body = {"ref": detail["id"], "force": True, "tags": ["base", "keep-forever"]}
    assert request(writable, "POST", "/api/delete", body, token)[0] == 200


@pytest.mark.browser
def test_in_the_browser_delete_never_removes_a_tag_it_did_not_name(
    browser: Any, scenario: tuple[Path, dict[str, str]], store_copy: Path
) -> None:
    target = scenario[1]["pretrain@30"]  # tagged "base"
    s = serve(str(store_copy), token="secret")
    try:
        p = browser.page()
        p.goto(s.base + "/?token=secret")
        p.wait_for_selector("html[data-forks]")
        at = p.evaluate("(id) => window.ckstoreUI.where(id)", target)
        p.mouse.click(at["x"], at["y"])
        p.wait_for_selector("button.untag[data-tag='base']")
        with ckstore.open(store_copy, create=False) as store:
            store.tag(target, "keep-forever")  # a training job tags it while the panel is open
        p.click("#delete-button")
        question = p.inner_text("#confirm-text")
        assert "its tags base?" in question  # the user confirms deleting "base", nothing else
        p.click("#confirm-ok")
        p.wait_for_function(  # an error in the banner, or the snapshot gone
            "() => !document.getElementById('banner').hidden"
            " || document.getElementById('lineage-canvas').dataset.points === '22'"
        )
        banner = p.inner_text("#banner")
        p.close()
    finally:
        s.stop()
    with ckstore.open(store_copy, create=False) as store:
        assert store.tags().get("keep-forever") == target, "a tag nobody confirmed was deleted"
    assert "keep-forever" in banner
