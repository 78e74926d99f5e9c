"""The page names snapshots by id: a tag (or run, or snapshot name) spelled like another
snapshot's id must not make a click on one snapshot show, tag or delete another."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import ckstore
from tests.ui.browser import Served, serve
from tests.ui.test_security import request


def test_a_tag_named_like_a_snapshot_id_cannot_redirect_a_delete(
    scenario: tuple[Path, dict[str, str]], store_copy: Path, writable: Served
) -> None:
    ids = scenario[1]
    clicked, precious = ids["diverged@100"], ids["sft-full@300"]
    with ckstore.open(store_copy, create=False) as store:  # e.g. pulled from a shared remote
        store.tag(precious, clicked)  # a tag spelled like the clicked snapshot's id
    token = {"X-Ckstore-Token": "right-token"}
    # what the page does on a click, then "Delete snapshot…" (details.js)
    status, _, out = request(writable, "GET", f"/api/snapshot?ref={clicked}")
    detail = json.loads(out)
    assert status == 200
    assert detail["id"] == clicked, f"clicked {clicked[:12]}, the panel shows {detail['ref']}"
    body = {"ref": detail["id"], "force": len(detail["tags"]) > 0}
    status, _, out = request(writable, "POST", "/api/delete", body, token)
    assert status == 200 and json.loads(out)["deleted"] == clicked
    with ckstore.open(store_copy, create=False) as store:
        kept = {s.id for s in store.log()}
    assert precious in kept and clicked not in kept


def test_a_run_named_like_a_snapshot_id_cannot_redirect_a_tag(
    scenario: tuple[Path, dict[str, str]], store_copy: Path, writable: Served
) -> None:
    ids = scenario[1]
    clicked = ids["pretrain@0"]
    with ckstore.open(store_copy, create=False) as store:  # a run spelled like the id
        other = store.take({"m": ckstore.StateDict({"x": 1})}, run=clicked, step=1)
    token = {"X-Ckstore-Token": "right-token"}
    status, _, out = request(
        writable, "POST", "/api/tag", {"ref": clicked, "name": "keep-me"}, token
    )
    assert status == 200 and json.loads(out)["id"] == clicked, "tagged another snapshot"
    with ckstore.open(store_copy, create=False) as store:
        assert store.tags()["keep-me"] == clicked != other.id


@pytest.mark.browser
def test_in_the_browser_delete_removes_the_snapshot_clicked(
    browser: Any, scenario: tuple[Path, dict[str, str]], store_copy: Path
) -> None:
    """A click on diverged@100, then "Delete snapshot…" and Confirm: diverged@100 goes, and
    the untagged sft-full@300 that a tag spelled like diverged@100's id points at stays."""
    ids = scenario[1]
    clicked, precious = ids["diverged@100"], ids["sft-full@300"]
    with ckstore.open(store_copy, create=False) as store:
        store.tag(precious, clicked)
    s = serve(str(store_copy), token="secret")
    try:
        p = browser.page()
        p.goto(s.base + "/?token=secret")
        p.wait_for_selector("html[data-forks]")
        at = p.evaluate("(id) => window.ckstoreUI.where(id)", clicked)
        p.mouse.click(at["x"], at["y"])
        p.wait_for_selector("#details-ref")
        shown = p.inner_text("#details-ref")
        p.click("#delete-button")
        p.click("#confirm-ok")
        p.wait_for_function(
            "() => document.getElementById('lineage-canvas').dataset.points === '22'"
        )
        assert p.errors == []
        p.close()
    finally:
        s.stop()
    with ckstore.open(store_copy, create=False) as store:
        kept = {x.id for x in store.log()}
    assert precious in kept, "deleted sft-full@300, not the snapshot clicked"
    assert clicked not in kept and shown == "diverged@100"
