// Storage: per snapshot, logical bytes vs the bytes its take stored (after dedup, compression
// and deltas), as a chart over time; per-run totals; `du` on demand.

import {state, visibleRuns, changed} from "./state.js";
import {get} from "./api.js";
import {el, clear, size, table} from "./util.js";
import {showError} from "./shell.js";

let plot = null, positions = [], root;

export function initStorage(node) {
  root = node;
  root.querySelector("#du-button").addEventListener("click", loadUsage);
}

export function drawStorage() {
  if (!state.ov || root.hidden) return;
  const s = state.ov.snaps, runs = visibleRuns();
  positions = [];
  for (let i = 0; i < s.id.length; i++) if (runs.has(s.run[i])) positions.push(i);
  positions.sort((p, q) => s.t[p] - s.t[q]);
  const data = [positions.map((p) => s.t[p]), positions.map((p) => s.logical[p]), positions.map((p) => s.new[p])];
  const box = root.querySelector("#storage-chart");
  const width = Math.max(400, box.clientWidth || 800);
  if (plot) { plot.destroy(); plot = null; }
  clear(box);
  const fmt = (u, vals) => vals.map((v) => size(v));
  plot = new uPlot({
    width, height: 300,
    series: [{}, {label: "logical bytes", stroke: "#4e79a7", width: 1.5, points: {show: positions.length < 400}, value: (u, v) => size(v)},
      {label: "new bytes stored", stroke: "#f28e2b", fill: "rgba(242,142,43,0.25)", width: 1.5, scale: "new",
        points: {show: positions.length < 400}, value: (u, v) => size(v)}],
    axes: [{}, {values: fmt, size: 80, label: "logical"}, {scale: "new", side: 1, values: fmt, size: 80, label: "new stored", grid: {show: false}}],
    scales: {x: {time: true}, new: {auto: true}},
  }, data, box);
  plot.over.addEventListener("click", () => {
    const idx = plot.cursor.idx;
    if (idx === null || idx === undefined) return;
    state.selected = positions[idx];
    changed("selected");
  });
  box.dataset.points = String(positions.length);
  renderTotals(runs);
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
    state.ov.runs[run], r.n, size(r.logical), size(r.fresh), r.fresh ? (r.logical / r.fresh).toFixed(1) + "×" : "–"]);
  clear(root.querySelector("#storage-totals")).append(
    table(["run", "snapshots", "logical", "new bytes stored", "logical / stored"], body, "totals"));
}

async function loadUsage() {
  const out = clear(root.querySelector("#du-output"));
  out.append(el("p", {class: "muted"}, "Counting unique chunks…"));
  let d;
  try { d = await get("/api/usage"); } catch (e) { showError(e); clear(out); return; }
  const rows = [...d.runs, d.total].map((r) => [r.run ?? "(total)", r.snapshots, size(r.logical_bytes),
    size(r.stored_bytes), r.chunks, r.dedup_ratio ? r.dedup_ratio.toFixed(1) + "×" : "–",
    r.delta_chunks ? `${r.delta_chunks} (${size(r.delta_raw_bytes - r.delta_bytes)} saved)` : "–"]);
  clear(out).append(table(["run", "snapshots", "logical", "unique stored", "chunks", "ratio", "deltas"], rows, "usage"),
    el("p", {class: "muted"}, `packs on the backend: ${d.total.packs}, ${size(d.total.pack_bytes)}`));
}
