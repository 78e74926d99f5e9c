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

RUN_COLORS = {
    "pretrain": (0x4E, 0x79, 0xA7),
    "sft-frozen": (0xF2, 0x8E, 0x2B),
    "sft-full": (0x59, 0xA1, 0x4F),
}
NAN_RED = "rgb(214, 39, 40)"

COLOR_COUNT = """([r, g, b]) => {
  const c = document.getElementById('lineage-canvas');
  const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
  let n = 0;
  for (let i = 0; i < d.length; i += 4)
    if (Math.abs(d[i] - r) < 8 && Math.abs(d[i + 1] - g) < 8 && Math.abs(d[i + 2] - b) < 8) n++;
  return n;
}"""


def shot(page: Any, tmp_path: Path, name: str) -> Path:
    """Save the page as ``name``.png (into ``$CKSTORE_UI_SHOTS`` too, when set: ``make
    screenshots`` writes docs/ui so)."""
    out = tmp_path / f"{name}.png"
    page.mouse.move(1, 1)  # no tooltip over what the picture shows
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


def click(page: Any, snapshot_id: str, **keys: bool) -> None:
    """Click snapshot ``snapshot_id`` on the lineage graph (holding ``Alt`` / ``Shift``)."""
    at = page.evaluate("(id) => window.ckstoreUI.where(id)", snapshot_id)
    for key in keys:
        page.keyboard.down(key)
    page.mouse.click(at["x"], at["y"])
    for key in keys:
        page.keyboard.up(key)


def test_open_draws_runs_forks_tags_and_what_takes_recorded(page: Any, tmp_path: Path) -> None:
    canvas = page.locator("#lineage-canvas")
    assert canvas.get_attribute("data-points") == "23" and canvas.get_attribute("data-lanes") == "7"
    assert canvas.get_attribute("data-forks") == "5"
    assert "token" not in page.url  # taken out of the address bar, kept for the session
    assert page.inner_text("#mode") == "changes allowed (token)"
    assert page.locator("#lineage-legend li").all_inner_texts() == [
        "pretrain (4)", "sft-frozen (4)", "sft-full (3)", "lora-delta (3)", "diverged (4)",
        "stuck (3)", "legacy (2)",
    ]  # fmt: skip
    assert "23 snapshots, 7 runs, 2 tags" in page.inner_text("#store-count")
    assert page.inner_text("#store-url") == "ckpts"  # never a temporary folder's path
    for run, rgb in RUN_COLORS.items():
        assert page.evaluate(COLOR_COUNT, list(rgb)) > 50, run  # each lane is drawn in its colour
    # NaN (diverged@300, @400) and stale (stuck@1, @2) are marked from the index, before any
    # health was loaded, and the key says what the marks mean
    assert canvas.get_attribute("data-flags") == "4"
    assert page.evaluate(COLOR_COUNT, [0xD6, 0x27, 0x28]) > 100  # the red NaN badges
    key = page.inner_text("#lineage-key")
    assert "NaN/Inf recorded" in key and "stale tensors recorded" in key and "fork" in key
    shot(page, tmp_path, "lineage")


def test_step_axis_ticks_are_round(page: Any) -> None:
    page.select_option("#x-mode", "step")
    ticks = [int(t) for t in page.locator("#lineage-canvas").get_attribute("data-ticks").split(",")]
    assert ticks == [0, 50, 100, 150, 200, 250, 300, 350, 400]  # not 5, 14, 23...


def test_filter_by_run_and_by_tag(page: Any) -> None:
    canvas = page.locator("#lineage-canvas")
    page.locator("label.run-check[data-run='sft-full'] input").uncheck()
    assert canvas.get_attribute("data-lanes") == "6" and canvas.get_attribute("data-points") == "20"
    assert page.evaluate(COLOR_COUNT, list(RUN_COLORS["sft-full"])) == 0
    page.click("#all-runs")
    page.select_option("#tag-filter", "best")  # its run, and runs forked from it: none
    assert canvas.get_attribute("data-lanes") == "1" and canvas.get_attribute("data-points") == "4"
    # the base run and every run forked from it, the full fine-tune (which shares no chunk
    # with it: its take recorded the restore) included; not the unrelated legacy run
    page.select_option("#tag-filter", "base")
    assert canvas.get_attribute("data-lanes") == "6"


def test_click_a_snapshot_for_its_details_and_sharing(
    page: Any, scenario: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    ids = scenario[1]
    click(page, ids["sft-frozen@100"])
    page.wait_for_selector("#details-ref")
    assert page.inner_text("#details-ref") == "sft-frozen@100"
    assert page.inner_text("#details-fork") == "pretrain@30"
    shared = page.locator("table.shared tbody tr").all_inner_texts()
    assert any("pretrain@30" in row and "tag base" in row for row in shared)
    # refs stay on one line in the narrow panel (pretrain@30 never breaks into "pretrain@3 0")
    lines = """e => { const r = document.createRange(); r.selectNodeContents(e);
                      return new Set([...r.getClientRects()].map((b) => Math.round(b.top))).size; }"""
    for cell in [page.locator("#details-ref"), *page.locator("table.shared td:first-child").all()]:
        assert cell.evaluate(lines) == 1, cell.inner_text()
    assert "ok: no NaN or Inf" in page.inner_text("#details-health")
    shot(page, tmp_path, "lineage")


def test_the_details_of_a_nan_snapshot_say_so(
    page: Any, scenario: tuple[Path, dict[str, str]]
) -> None:
    click(page, scenario[1]["diverged@300"])
    page.wait_for_selector("#details-ref")
    health = page.inner_text("#details-health")
    assert "NaN/Inf: 3 values" in health and "see Health" in health
    page.click("#details-health a")
    page.wait_for_selector("#view-health[data-state='recorded']")
    assert page.input_value("#health-run") == "diverged"


def test_the_tooltip_of_the_right_most_snapshot_stays_in_view(
    page: Any, scenario: tuple[Path, dict[str, str]]
) -> None:
    at = page.evaluate("(id) => window.ckstoreUI.where(id)", scenario[1]["legacy@1"])
    page.mouse.move(at["x"], at["y"])
    tip = page.locator("#lineage-tip")
    tip.wait_for(state="visible")
    box, graph = tip.bounding_box(), page.locator(".canvas-box").bounding_box()
    assert graph["x"] <= box["x"] and box["x"] + box["width"] <= graph["x"] + graph["width"]
    assert "legacy@1" in tip.inner_text()


def test_compare_two_snapshots_picked_on_the_graph(
    page: Any, scenario: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    ids = scenario[1]
    click(page, ids["pretrain@30"], Alt=True)
    click(page, ids["sft-frozen@300"], Shift=True)
    view(page, "changes")
    assert (
        page.input_value("#ref-a") == "pretrain@30"
        and page.input_value("#ref-b") == "sft-frozen@300"
    )
    page.click("#compare-button")
    page.wait_for_selector("#view-changes[data-state='done']")
    assert "(numeric)" in page.inner_text("#compare-status")
    assert page.input_value("#app-filter") == "model"  # the model's tensors, not Adam's moments
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
    assert not any(r.startswith("optim/") for r in rows.all_inner_texts())
    pills = "() => [...document.querySelectorAll('#compare-summary .pill')].map(e => e.innerText)"
    assert page.evaluate(pills)[0] == "30 changed"
    shot(page, tmp_path, "changes")
    page.fill("#key-filter", "head")  # the counts follow the filters too
    assert page.locator("#heatmap").get_attribute("data-cells") == "2"
    assert page.evaluate(pills) == ["2 changed", "0 added", "0 removed", "0 unchanged"]
    page.fill("#key-filter", "")
    page.select_option("#app-filter", "optim")
    assert page.evaluate(pills)[0] != "30 changed"
    assert all(
        r.startswith("optim/") for r in page.locator("table.changes tbody tr").all_inner_texts()
    )


def test_a_nan_tensor_is_never_drawn_as_a_large_change(page: Any) -> None:
    view(page, "changes")
    page.fill("#ref-a", "diverged@200")
    page.fill("#ref-b", "diverged@300")
    page.click("#compare-button")
    page.wait_for_selector("#view-changes[data-state='done']")
    cell = page.locator(".hm-cell[data-key='model/layers.3.mlp.0.weight']")
    assert cell.evaluate("e => e.style.background") == NAN_RED
    assert "relative change NaN" in cell.get_attribute("title")
    others = page.locator(".hm-cell.st-changed").evaluate_all(
        "cells => cells.map(e => e.style.background)"
    )
    assert others.count(NAN_RED) == 1  # finite changes, however large, are on the ramp
    first = page.locator("table.changes tbody tr").first.inner_text()
    assert first.startswith("model/layers.3.mlp.0.weight") and "NaN" in first


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
    chart = page.locator("#storage-chart")
    assert chart.get_attribute("data-points") == "23" and chart.get_attribute("data-series") == "7"
    legend = page.locator(".u-legend").inner_text()
    assert "Time" not in legend and "pretrain stored" in legend and "sft-frozen logical" in legend
    assert page.locator(".u-axis").count() == 2  # one x axis, one bytes axis
    assert page.evaluate(
        "() => { const u = document.querySelector('#storage-chart .u-wrap'); return !!u; }"
    )
    totals = page.locator("table.totals tbody tr").all_inner_texts()
    assert [t.split("\t")[0] for t in totals] == [
        "pretrain", "sft-frozen", "sft-full", "lora-delta", "diverged", "stuck", "legacy",
    ]  # fmt: skip
    page.click("#du-button")
    page.wait_for_selector("table.usage")
    assert "exclusive" in page.locator("table.usage thead").inner_text()
    assert page.locator("table.usage tbody tr").last.inner_text().startswith("(total)")
    shot(page, tmp_path, "storage")


def test_health_plots_the_model_and_marks_nan(page: Any, tmp_path: Path) -> None:
    view(page, "health")
    page.select_option("#health-run", "diverged")
    page.wait_for_selector("#view-health[data-state='recorded']")
    page.wait_for_selector("#health-chart canvas")
    assert page.input_value("#health-app") == "model"
    legend = page.locator("#health-chart .u-legend").inner_text()
    assert "model/layers.3.mlp.0" in legend and "optim" not in legend  # the NaN layer is plotted
    # one mark per NaN layer and step: layers.3.mlp.0 at 300; every MLP weight (8) at 400
    assert page.locator("#health-chart").get_attribute("data-nan-marks") == "9"
    flags = page.locator("table.flags tbody tr").all_inner_texts()
    assert any(
        row.startswith("300\t3\t0") and "model/layers.3.mlp.0.weight" in row for row in flags
    )
    shot(page, tmp_path, "health")
    page.select_option("#health-app", "optim")
    page.wait_for_function(
        "() => document.querySelector('#health-chart .u-legend')?.innerText.includes('optim/')"
    )
    assert "/step" not in page.locator("#health-chart .u-legend").inner_text()  # counters
    page.select_option("#health-run", "legacy")
    page.wait_for_selector("#view-health[data-state='none']")
    assert "No health recorded" in page.inner_text("#health-empty")


def test_health_names_every_nan_tensor_or_how_many_more(page: Any) -> None:
    view(page, "health")
    page.select_option("#health-run", "diverged")
    page.wait_for_selector("#view-health[data-state='recorded']")
    row = page.locator("table.flags tbody tr").last  # step 400: NaN in weights and moments
    heads = page.locator("table.flags thead th").all_inner_texts()
    cell = row.locator("td").nth(heads.index("tensors with NaN/Inf")).locator("span")
    names = cell.get_attribute("title").split("\n")
    shown = cell.inner_text()
    assert len(names) > 6 and shown.endswith(f"… and {len(names) - 6} more")


def test_gc_preview_marks_the_drops_and_deletes_nothing(
    page: Any, scenario: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    import ckstore

    with ckstore.open(scenario[0]) as store:
        dropped = store.gc(keep_last=1, grace_seconds=0, dry_run=True).snapshots_dropped
    view(page, "gc")
    page.fill("input[name=keep_last]", "1")
    page.fill("input[name=grace]", "0")
    page.click("#gc-preview")
    page.wait_for_selector("#view-gc[data-state='done']")
    assert page.inner_text("#gc-summary").startswith(f"{len(dropped)} snapshots would be dropped")
    assert page.inner_text("#gc-command") == "ckstore gc --keep-last 1 --grace 0s"
    assert page.locator("#gc-drops li").count() == len(dropped)
    shot(page, tmp_path, "gc-preview")
    page.click("#gc-show")
    page.wait_for_selector("html[data-view='lineage']")
    assert page.locator("#lineage-canvas").get_attribute("data-drops") == str(len(dropped))
    assert (
        page.evaluate(
            "() => fetch('/api/overview').then(r => r.json()).then(d => d.snaps.id.length)"
        )
        == 23
    )


def test_gc_preview_keeps_the_best_by_a_metric(page: Any) -> None:
    view(page, "gc")
    page.fill("input[name=keep_best]", "1")
    page.fill("input[name=metric]", "loss")
    page.fill("input[name=runs]", "sft-frozen")
    page.fill("input[name=grace]", "0")
    page.click("#gc-preview")
    page.wait_for_selector("#view-gc[data-state='done']")
    assert page.inner_text("#gc-command") == (
        "ckstore gc --keep-best 1 --metric loss --run sft-frozen --grace 0s"
    )
    drops = page.locator("#gc-drops li").all_inner_texts()
    # the lowest loss (1.1, tagged best too) and the newest healthy stay
    assert sorted(drops) == ["sft-frozen@100", "sft-frozen@200"]


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
            "() => document.getElementById('lineage-canvas').dataset.points === '22'"
        )
        assert p.evaluate("() => window.ckstoreUI.state.ov.snaps.id.length") == 22
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
