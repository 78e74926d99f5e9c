// Start: take the token, load the overview, draw the lineage (first paint), then the forks.
// Views are tabs (#lineage, #storage, #changes, #health, #gc); filters apply to all of them.

import {takeToken, hasToken, get} from "./api.js";
import {state, setOverview, onChange, positionOf} from "./state.js";
import {initLineage, draw, where} from "./lineage.js";
import {initStorage, drawStorage} from "./storage.js";
import {initChanges, pairChanged, compare} from "./changes.js";
import {initHealth, fillRuns} from "./health.js";
import {initGc} from "./gc.js";
import {initDetails, showDetails} from "./details.js";
import {showError} from "./shell.js";
import {el, clear, runColor} from "./util.js";

const VIEWS = ["lineage", "storage", "changes", "health", "gc"];

function currentView() {
  const v = location.hash.replace("#", "");
  return VIEWS.includes(v) ? v : "lineage";
}

function showView() {
  const v = currentView();
  for (const name of VIEWS) {
    document.getElementById("view-" + name).hidden = name !== v;
    document.getElementById("tab-" + name).classList.toggle("active", name === v);
  }
  document.documentElement.dataset.view = v;
  redraw();
}

function redraw() {
  const v = currentView();
  if (v === "lineage") draw();
  if (v === "storage") drawStorage();
}

function renderFilters() {
  const runs = clear(document.getElementById("run-filter"));
  state.ov.runs.forEach((name, i) => {
    const box = el("input", {type: "checkbox", value: String(i), checked: !state.runFilter || state.runFilter.has(i)});
    box.addEventListener("change", () => {
      const on = [...runs.querySelectorAll("input:checked")].map((x) => Number(x.value));
      state.runFilter = on.length === state.ov.runs.length ? null : new Set(on);
      redraw();
    });
    runs.append(el("label", {class: "run-check", dataset: {run: name}}, box,
      el("span", {class: "swatch", style: {background: runColor(i)}}), name));
  });
  const tags = document.getElementById("tag-filter");
  clear(tags).append(el("option", {value: ""}, "(all)"),
    ...Object.keys(state.ov.tags).map((t) => el("option", {value: t}, t)));
  tags.value = state.tagFilter in state.ov.tags ? state.tagFilter : "";
  const where = document.getElementById("store-url");
  where.textContent = state.ov.store.shown;
  where.title = state.ov.store.url;
  document.getElementById("store-count").textContent =
    `${state.ov.snaps.id.length} snapshots, ${state.ov.runs.length} runs, ${Object.keys(state.ov.tags).length} tags`;
}

async function start() {
  takeToken();
  document.getElementById("mode").textContent = hasToken() ? "changes allowed (token)" : "read-only";
  for (const [id, init] of [["view-lineage", initLineage], ["view-storage", initStorage],
    ["view-changes", initChanges], ["view-health", initHealth], ["view-gc", initGc], ["details", initDetails]]) {
    init(document.getElementById(id));
  }
  document.getElementById("tag-filter").addEventListener("change", (e) => { state.tagFilter = e.target.value; redraw(); });
  document.getElementById("all-runs").addEventListener("click", () => { state.runFilter = null; renderFilters(); redraw(); });
  window.addEventListener("hashchange", showView);
  onChange((what) => {
    if (what === "overview") { renderFilters(); fillRuns(); pairChanged(); showDetails(); }
    if (what === "selected") showDetails();
    if (what === "pair") { pairChanged(); }
    redraw();
  });
  try {
    setOverview(await get("/api/overview"));
  } catch (e) { showError(e); document.documentElement.dataset.ready = "error"; return; }
  renderFilters(); fillRuns(); showView(); showDetails();
  requestAnimationFrame(() => {
    performance.mark("ckstore-first-paint");
    document.documentElement.dataset.ready = "1";
  });
  try { state.forks = (await get("/api/forks")).edges; } catch (e) { showError(e); }
  document.documentElement.dataset.forks = String(state.forks.length);
  redraw();
}

// For tests and the bench: where a snapshot is drawn, select by ref, compare.
window.ckstoreUI = {
  state, where: (id) => where(positionOf(id)), positionOf,
  compare, pick: (a, b) => { state.a = positionOf(a); state.b = positionOf(b); pairChanged(); },
};

start();
