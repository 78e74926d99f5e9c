// Storage: per snapshot, the bytes its take stored (after dedup, compression and deltas) and its
// logical bytes, one colour per run on one bytes axis from 0, over time; per-run totals; `du`
// (unique stored bytes, and what only each run holds) on demand.

import {state, visibleRuns, changed} from "./state.js";
import {get} from "./api.js";
import {el, clear, size, table, runColor, when, ratio} from "./util.js";
import {showError} from "./shell.js";

let plot = null, positions = [], root;

export function initStorage(node) {
  root = node;
  root.querySelector("#du-button").addEventListener("click", loadUsage);
}

export function drawStorage() {
  if (!state.ov || root.hidden) return;
  const s = state.ov.snaps, runs = [...visibleRuns()].sort((a, b) => a - b);
  positions = [];
  for (let i = 0; i < s.id.length; i++) if (runs.includes(s.run[i])) positions.push(i);
  positions.sort((p, q) => s.t[p] - s.t[q]);
  // one x column of every snapshot shown; each run's series holds its own snapshots, null elsewhere
  const data = [positions.map((p) => s.t[p])];
  const series = [{label: "taken", value: (u, v) => (v === null || v === undefined ? "–" : when(v))}];
  const points = {show: positions.length < 400, size: 5};
  for (const r of runs) {
    const name = state.ov.runs[r], color = runColor(r);
    data.push(positions.map((p) => (s.run[p] === r ? s.new[p] : null)));
    series.push({label: `${name} stored`, stroke: color, width: 2, spanGaps: true, points, value: (u, v) => size(v)});
    data.push(positions.map((p) => (s.run[p] === r ? s.logical[p] : null)));
    series.push({label: `${name} logical`, stroke: color, width: 1, dash: [5, 4], spanGaps: true,
      points: {show: false}, value: (u, v) => size(v)});
  }
  const box = root.querySelector("#storage-chart");
  const width = Math.max(400, box.clientWidth || 800);
  if (plot) { plot.destroy(); plot = null; }
  clear(box);
  plot = new uPlot({
    width, height: 300, series,
    axes: [{values: (u, vals) => vals.map((v) => when(v).slice(5, 16)), space: 90},  // UTC, as the lineage
      {values: (u, vals) => vals.map((v) => size(v)), size: 80, label: "bytes"}],
    scales: {x: {time: true}, y: {range: (u, lo, hi) => [0, Math.max(1, hi) * 1.05]}},
  }, data, box);
  plot.over.addEventListener("click", () => {
    const idx = plot.cursor.idx;
    if (idx === null || idx === undefined) return;
    state.selected = positions[idx];
    changed("selected");
  });
  box.dataset.points = String(positions.length);
  box.dataset.series = String(runs.length);
  renderTotals(new Set(runs));
}

function renderTotals(runs) {
  const s = state.ov.snaps, rows = new Map();
  for (let i = 0; i < s.id.length; i++) {
    if (!runs.has(s.run[i])) continue;
    const r = rows.get(s.run[i]) || {n: 0, logical: 0, fresh: 0};
    r.n++; r.logical += s.logical[i]; r.fresh += s.new[i];
    rows.set(s.run[i], r);
  }
  const body = [...rows.entries()].sort((x, y) => x[0] - y[0]).map(([run, r]) => [
    state.ov.runs[run], r.n, size(r.logical), size(r.fresh), ratio(r.fresh && r.logical / r.fresh)]);
  clear(root.querySelector("#storage-totals")).append(
    table(["run", "snapshots", "logical", "new bytes stored", "logical / stored"], body, "totals"));
}

async function loadUsage() {
  const out = clear(root.querySelector("#du-output"));
  out.append(el("p", {class: "muted"}, "Counting unique chunks…"));
  let d;
  try { d = await get("/api/usage"); } catch (e) { showError(e); clear(out); return; }
  const rows = [...d.runs, d.total].map((r) => [r.run ?? "(total)", r.snapshots, size(r.logical_bytes),
    size(r.stored_bytes), r.run !== null && r.run !== undefined ? size(r.exclusive_bytes) : "", r.chunks,
    ratio(r.dedup_ratio),
    r.delta_chunks ? `${r.delta_chunks} (${size(r.delta_raw_bytes - r.delta_bytes)} saved)` : "–"]);
  clear(out).append(table(["run", "snapshots", "logical", "unique stored", "exclusive", "chunks", "ratio", "deltas"], rows, "usage"),
    el("p", {class: "muted"}, `packs on the backend: ${d.total.packs}, ${size(d.total.pack_bytes)}. ` +
      "exclusive: stored bytes no other run uses (what deleting the run and a gc free)."));
}
