"""The page in a real headless Chromium: open, filter, pick, compare, health, gc preview, and
the actions behind the token. Assertions are on the DOM and on the lineage canvas's pixels;
each view is also saved as a PNG (in ``$CKSTORE_UI_SHOTS`` when set: docs/ui is made so)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.ui.browser import Browser, Served, serve

pytestmark = pytest.mark.browser

RUN_COLORS = {"base": (0x4E, 0x79, 0xA7), "sft": (0xF2, 0x8E, 0x2B), "delta": (0x59, 0xA1, 0x4F)}

COLOR_COUNT = """([r, g, b]) => {
  const c = document.getElementById('lineage-canvas');
  const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
  let n = 0;
  for (let i = 0; i < d.length; i += 4)
    if (Math.abs(d[i] - r) < 8 && Math.abs(d[i + 1] - g) < 8 && Math.abs(d[i + 2] - b) < 8) n++;
  return n;
}"""


def shot(page: Any, tmp_path: Path, name: str) -> Path:
    """Save the page as ``name``.png (into ``$CKSTORE_UI_SHOTS`` too, when set)."""
    out = tmp_path / f"{name}.png"
    page.screenshot(path=str(out))
    assert out.stat().st_size > 10_000  # a drawn page, not a blank one
    folder = os.environ.get("CKSTORE_UI_SHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        clip = {"x": 0, "y": 0, "width": 1400, "height": 620}  # docs/ PNGs stay well under 200 KiB
        page.screenshot(path=str(Path(folder) / f"{name}.png"), clip=clip)
    return out


@pytest.fixture
def page(browser: Browser, served: Served) -> Iterator[Any]:
    p = browser.page()
    p.goto(served.base + "/?token=" + served.token)
    p.wait_for_selector("html[data-ready='1']")
    p.wait_for_selector("html[data-forks]")
    yield p
    assert p.errors == []
    p.close()


def view(page: Any, name: str) -> None:
    page.click(f"#tab-{name}")
    page.wait_for_selector(f"html[data-view='{name}']")


def test_open_draws_runs_forks_and_tags(page: Any, tmp_path: Path) -> None:
    canvas = page.locator("#lineage-canvas")
    assert canvas.get_attribute("data-points") == "12" and canvas.get_attribute("data-lanes") == "3"
    assert canvas.get_attribute("data-forks") == "2"
    assert "token" not in page.url  # taken out of the address bar, kept for the session
    assert page.inner_text("#mode") == "changes allowed (token)"
    assert page.locator("#lineage-legend li").all_inner_texts() == [
        "base (5)",
        "sft (4)",
        "delta (3)",
    ]
    assert "12 snapshots, 3 runs, 2 tags" in page.inner_text("#store-count")
    for run, rgb in RUN_COLORS.items():
        assert page.evaluate(COLOR_COUNT, list(rgb)) > 50, run  # each lane is drawn in its colour
    shot(page, tmp_path, "lineage")


def test_filter_by_run_and_by_tag(page: Any) -> None:
    canvas = page.locator("#lineage-canvas")
    page.locator("label.run-check[data-run='delta'] input").uncheck()
    assert canvas.get_attribute("data-lanes") == "2" and canvas.get_attribute("data-points") == "9"
    assert page.evaluate(COLOR_COUNT, list(RUN_COLORS["delta"])) == 0
    page.click("#all-runs")
    page.select_option("#tag-filter", "best")  # its run, and runs forked from it: none
    assert canvas.get_attribute("data-lanes") == "1" and canvas.get_attribute("data-points") == "4"
    page.select_option(
        "#tag-filter", "base-model"
    )  # the base run and both fine-tunes forked from it
    assert canvas.get_attribute("data-lanes") == "3"


def test_click_a_snapshot_for_its_details_and_sharing(
    page: Any, scenario: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    ids = scenario[1]
    at = page.evaluate("(id) => window.ckstoreUI.where(id)", ids["sft@100"])
    page.mouse.click(at["x"], at["y"])
    page.wait_for_selector("#details-ref")
    assert page.inner_text("#details-ref") == "sft@100"
    shared = page.locator("table.shared tbody tr").all_inner_texts()
    assert any("base@4" in row and "tag base-model" in row for row in shared)
    shot(page, tmp_path, "lineage")


def test_compare_two_snapshots_picked_on_the_graph(
    page: Any, scenario: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    ids = scenario[1]
    a = page.evaluate("(id) => window.ckstoreUI.where(id)", ids["base@4"])
    page.keyboard.down("Alt")
    page.mouse.click(a["x"], a["y"])
    page.keyboard.up("Alt")
    b = page.evaluate("(id) => window.ckstoreUI.where(id)", ids["sft@400"])
    page.keyboard.down("Shift")
    page.mouse.click(b["x"], b["y"])
    page.keyboard.up("Shift")
    view(page, "changes")
    assert page.input_value("#ref-a") == "base@4" and page.input_value("#ref-b") == "sft@400"
    page.click("#compare-button")
    page.wait_for_selector("#view-changes[data-state='done']")
    assert "(numeric)" in page.inner_text("#compare-status")
    assert page.locator("#heatmap").get_attribute("data-cells") == "59"
    assert page.locator(".hm-cell.st-unchanged").count() == 29  # the frozen backbone, greyed
    changed = page.locator(".hm-cell.st-changed").first
    assert changed.evaluate("e => e.style.background").startswith("rgb(")
    assert (
        page.locator(".hm-row[data-layer='model/layers.0.attn.q'][data-status='unchanged']").count()
        == 1
    )
    rows = page.locator("table.changes tbody tr")
    assert rows.count() == 30 and "float32" in rows.first.inner_text()
    shot(page, tmp_path, "changes")
    page.fill("#key-filter", "head")
    assert page.locator("#heatmap").get_attribute("data-cells") == "2"


def test_compare_refuses_an_unknown_ref_with_a_message(page: Any) -> None:
    view(page, "changes")
    page.fill("#ref-a", "' OR 1=1 --")
    page.fill("#ref-b", "best")
    page.click("#compare-button")
    page.wait_for_selector("#view-changes[data-state='error']")
    assert "no snapshot matches" in page.inner_text("#banner-text")


def test_storage_chart_totals_and_du(page: Any, tmp_path: Path) -> None:
    view(page, "storage")
    page.wait_for_selector("#storage-chart canvas")
    assert page.locator("#storage-chart").get_attribute("data-points") == "12"
    assert page.locator(".u-legend").count() == 1
    totals = page.locator("table.totals tbody tr").all_inner_texts()
    assert [t.split("\t")[0] for t in totals] == ["base", "sft", "delta"]
    page.click("#du-button")
    page.wait_for_selector("table.usage")
    assert page.locator("table.usage tbody tr").last.inner_text().startswith("(total)")
    shot(page, tmp_path, "storage")


def test_health_panel_flags_and_norms(page: Any, tmp_path: Path) -> None:
    view(page, "health")
    page.select_option("#health-run", "sft")
    page.wait_for_selector("#view-health[data-state='recorded']")
    page.wait_for_selector("#health-chart canvas")
    flags = page.locator("table.flags tbody tr").all_inner_texts()
    assert any(row.startswith("300\t3\t0") and "model/head.weight" in row for row in flags)
    shot(page, tmp_path, "health")
    page.select_option("#health-run", "base")
    page.wait_for_selector("#view-health[data-state='none']")
    assert "No health recorded" in page.inner_text("#health-empty")
    view(page, "lineage")  # the flags loaded are marked on the timeline
    assert page.evaluate("() => window.ckstoreUI.state.flags.size") == 3


def test_gc_preview_marks_the_drops_and_deletes_nothing(page: Any, tmp_path: Path) -> None:
    view(page, "gc")
    page.fill("input[name=keep_last]", "1")
    page.fill("input[name=grace]", "0")
    page.click("#gc-preview")
    page.wait_for_selector("#view-gc[data-state='done']")
    assert page.inner_text("#gc-summary").startswith("9 snapshots would be dropped")
    assert page.inner_text("#gc-command") == "ckstore gc --keep-last 1 --grace 0s"
    assert page.locator("#gc-drops li").count() == 9
    shot(page, tmp_path, "gc-preview")
    page.click("#gc-show")
    page.wait_for_selector("html[data-view='lineage']")
    assert page.locator("#lineage-canvas").get_attribute("data-drops") == "9"
    assert (
        page.evaluate(
            "() => fetch('/api/overview').then(r => r.json()).then(d => d.snaps.id.length)"
        )
        == 12
    )


def test_actions_need_the_token_and_a_confirmation(
    browser: Browser, store_copy: Path, tmp_path: Path
) -> None:
    s = serve(str(store_copy), token="secret")
    try:
        ro = browser.page()  # a tab without the token: read-only
        ro.goto(s.base + "/")
        ro.wait_for_selector("html[data-ready='1']")
        assert ro.inner_text("#mode") == "read-only"
        ro.wait_for_selector("html[data-forks]")
        at = ro.evaluate("() => window.ckstoreUI.where(window.ckstoreUI.state.ov.snaps.id[0])")
        ro.mouse.click(at["x"], at["y"])
        ro.wait_for_selector("#read-only-note")
        assert (
            ro.locator("#tag-button").is_disabled() and ro.locator("#delete-button").is_disabled()
        )
        ro.close()

        p = browser.page()
        p.goto(s.base + "/?token=secret")
        p.wait_for_selector("html[data-forks]")
        at = p.evaluate("() => window.ckstoreUI.where(window.ckstoreUI.state.ov.snaps.id[0])")
        p.mouse.click(at["x"], at["y"])
        p.wait_for_selector("#details-ref")
        p.fill("#tag-name", "first")
        p.click("#tag-button")
        assert p.locator("#confirm").is_visible()
        p.click("#confirm-cancel")  # nothing happens without the confirmation
        assert "first" not in p.evaluate("() => Object.keys(window.ckstoreUI.state.ov.tags)")
        p.click("#tag-button")
        p.click("#confirm-ok")
        p.wait_for_function("() => 'first' in window.ckstoreUI.state.ov.tags")
        p.wait_for_selector("button.untag[data-tag='first']")
        p.click("#delete-button")
        assert "and its tags first" in p.inner_text("#confirm-text")
        p.click("#confirm-ok")
        p.wait_for_function(
            "() => document.getElementById('lineage-canvas').dataset.points === '11'"
        )
        assert p.evaluate("() => window.ckstoreUI.state.ov.snaps.id.length") == 11
        assert p.errors == []
        p.close()
    finally:
        s.stop()


def test_a_malformed_store_shows_an_error_page(browser: Browser, store_copy: Path) -> None:
    (store_copy / "index.sqlite").write_bytes(b"garbage" * 1000)
    s = serve(str(store_copy))
    try:
        p = browser.page()
        p.goto(s.base + "/")
        assert "ckstore ui: cannot read the store" in p.inner_text("h1")
        assert "Traceback" not in p.content() and p.locator("#error-message").inner_text()
        p.close()
    finally:
        s.stop()
