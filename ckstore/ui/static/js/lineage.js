// The lineage graph on a canvas: one lane per run, snapshots over time (or step), parent
// edges along each lane, fork edges (dashed) from a base snapshot to a run's first snapshot,
// tags as labels; gc-preview drops crossed out; what each take recorded (from the index, so
// before any health is loaded): NaN/Inf or replicas that differ as a red "!" badge, stale
// tensors as an amber one.

import {state, ref, visibleRuns, changed} from "./state.js";
import {runColor, when, size, el, clear} from "./util.js";

const LEFT = 150, RIGHT = 30, TOP = 24, BOTTOM = 34;
let canvas, tip, layout = null, xMode = "time";

export function initLineage(root) {
  canvas = root.querySelector("#lineage-canvas");
  tip = root.querySelector("#lineage-tip");
  canvas.addEventListener("mousemove", onMove);
  canvas.addEventListener("mouseleave", () => { tip.hidden = true; });
  canvas.addEventListener("click", onClick);
  root.querySelector("#x-mode").addEventListener("change", (e) => { xMode = e.target.value; draw(); });
  window.addEventListener("resize", () => draw());
}

function xValue(pos) {
  const s = state.ov.snaps;
  return xMode === "step" && s.step[pos] !== null ? s.step[pos] : (xMode === "step" ? 0 : s.t[pos]);
}

export function draw() {
  if (!state.ov || !canvas || canvas.offsetParent === null) return;
  const s = state.ov.snaps, n = s.id.length;
  const runs = [...visibleRuns()].sort((a, b) => a - b);
  const lane = new Map(runs.map((r, i) => [r, i]));
  const laneH = runs.length <= 12 ? 44 : Math.max(14, Math.min(44, 520 / runs.length));
  const width = canvas.parentElement.clientWidth || 900;
  const height = TOP + BOTTOM + Math.max(1, runs.length) * laneH;
  const dpr = window.devicePixelRatio || 1;
  canvas.width = width * dpr; canvas.height = height * dpr;
  canvas.style.width = width + "px"; canvas.style.height = height + "px";
  const g = canvas.getContext("2d");
  g.setTransform(dpr, 0, 0, dpr, 0, 0);
  g.clearRect(0, 0, width, height);

  const shown = [];
  let lo = Infinity, hi = -Infinity;
  for (let i = 0; i < n; i++) {
    if (!lane.has(s.run[i])) continue;
    shown.push(i);
    const x = xValue(i); if (x < lo) lo = x; if (x > hi) hi = x;
  }
  if (hi === lo) { hi += 1; lo -= 1; }
  const sx = (v) => LEFT + (v - lo) / (hi - lo) * (width - LEFT - RIGHT);
  const sy = (r) => TOP + lane.get(r) * laneH + laneH / 2;
  const px = new Float32Array(n).fill(NaN), py = new Float32Array(n).fill(NaN);
  for (const i of shown) { px[i] = sx(xValue(i)); py[i] = sy(s.run[i]); }

  // lanes and run names
  g.font = "12px system-ui, sans-serif"; g.textBaseline = "middle";
  runs.forEach((r, k) => {
    g.fillStyle = k % 2 ? "#f6f7f9" : "#ffffff";
    g.fillRect(0, TOP + k * laneH, width, laneH);
    g.fillStyle = runColor(r);
    g.fillRect(6, TOP + k * laneH + laneH / 2 - 5, 10, 10);
    g.fillStyle = "#222";
    g.fillText(state.ov.runs[r].slice(0, 18), 22, TOP + k * laneH + laneH / 2);
  });
  // time or step axis: steps on round numbers (0, 10, 20...), times at five even places
  g.fillStyle = "#555"; g.textBaseline = "top";
  const ticks = xMode === "step" ? stepTicks(lo, hi) : [0, 1, 2, 3, 4, 5].map((k) => lo + (hi - lo) * k / 5);
  ticks.forEach((v, k) => {
    const x = sx(v);
    g.fillRect(x, height - BOTTOM + 2, 1, 4);
    const ms = String(Math.floor((v % 1) * 1000)).padStart(3, "0");
    const label = xMode === "step" ? String(v) : hi - lo < 60 ? when(v).slice(11, 19) + "." + ms
      : hi - lo < 86400 ? when(v).slice(11, 19) : when(v).slice(0, 16);
    g.textAlign = xMode === "step" ? "center" : k === 0 ? "left" : k === ticks.length - 1 ? "right" : "center";
    g.fillText(label, x, height - BOTTOM + 8);
  });
  canvas.dataset.ticks = ticks.join(",");
  g.textAlign = "left";
  // parent edges
  g.lineWidth = 1.5;
  for (const i of shown) {
    const p = s.parent[i];
    if (p < 0 || isNaN(px[p])) continue;
    g.strokeStyle = runColor(s.run[i]);
    g.beginPath(); g.moveTo(px[p], py[p]); g.lineTo(px[i], py[i]); g.stroke();
  }
  // fork edges
  let forks = 0;
  g.setLineDash([5, 4]); g.strokeStyle = "#444"; g.lineWidth = 1.2;
  for (const e of state.forks) {
    if (isNaN(px[e.from]) || isNaN(px[e.to])) continue;
    forks++;
    const mx = (px[e.from] + px[e.to]) / 2;
    g.beginPath(); g.moveTo(px[e.from], py[e.from]);
    g.bezierCurveTo(mx, py[e.from], mx, py[e.to], px[e.to], py[e.to]); g.stroke();
  }
  g.setLineDash([]);
  // snapshots
  const r0 = shown.length > 3000 ? 2 : shown.length > 600 ? 3 : 4.5;
  for (const i of shown) {
    g.fillStyle = runColor(s.run[i]);
    g.beginPath(); g.arc(px[i], py[i], r0, 0, 2 * Math.PI); g.fill();
  }
  // tags, flags, drops, selection
  g.textBaseline = "bottom"; g.font = "11px system-ui, sans-serif";
  for (const [pos, names] of state.tagsAt) {
    if (isNaN(px[pos])) continue;
    ring(g, px[pos], py[pos], r0 + 3, "#222", 1.5);
    const label = names.join(", ");
    const w = g.measureText(label).width + 8;
    g.fillStyle = "rgba(255,255,255,0.9)"; g.fillRect(px[pos] - w / 2, py[pos] - r0 - 19, w, 14);
    g.fillStyle = "#111"; g.textAlign = "center"; g.fillText(label, px[pos], py[pos] - r0 - 6);
  }
  g.textAlign = "left";
  let flagged = 0;
  for (const [pos, kind] of state.flags) {
    if (isNaN(px[pos])) continue;
    flagged++;
    const color = FLAG_COLORS[kind], bx = px[pos] + r0 + 5, by = py[pos] + r0 + 5;
    ring(g, px[pos], py[pos], r0 + 2, color, 2);
    g.fillStyle = color; g.beginPath(); g.arc(bx, by, 7, 0, 2 * Math.PI); g.fill();
    g.fillStyle = "#fff"; g.font = "bold 11px system-ui, sans-serif"; g.textAlign = "center"; g.textBaseline = "middle";
    g.fillText(kind === "nan" ? "!" : "≈", bx, by + 0.5);
  }
  g.textAlign = "left";
  g.strokeStyle = "#d62728"; g.lineWidth = 2;
  for (const pos of state.drop) {
    if (isNaN(px[pos])) continue;
    const d = r0 + 2;
    g.beginPath(); g.moveTo(px[pos] - d, py[pos] - d); g.lineTo(px[pos] + d, py[pos] + d);
    g.moveTo(px[pos] + d, py[pos] - d); g.lineTo(px[pos] - d, py[pos] + d); g.stroke();
  }
  if (state.a >= 0 && !isNaN(px[state.a])) badge(g, px[state.a], py[state.a], "A", "#1f77b4");
  if (state.b >= 0 && !isNaN(px[state.b])) badge(g, px[state.b], py[state.b], "B", "#ff7f0e");
  if (state.selected >= 0 && !isNaN(px[state.selected])) ring(g, px[state.selected], py[state.selected], r0 + 6, "#000", 2.5);

  layout = {px, py, shown};
  canvas.dataset.points = String(shown.length);
  canvas.dataset.lanes = String(runs.length);
  canvas.dataset.forks = String(forks);
  canvas.dataset.drops = String([...state.drop].filter((p) => !isNaN(px[p])).length);
  canvas.dataset.flags = String(flagged);
  renderLegend(runs);
}

const FLAG_COLORS = {nan: "#d62728", stale: "#d08a00"};

// Round step ticks between lo and hi: multiples of 1, 2 or 5 times a power of ten, 4 to 10 of them.
export function stepTicks(lo, hi) {
  const span = Math.max(1, hi - lo), raw = span / 6, mag = 10 ** Math.floor(Math.log10(raw));
  const unit = [1, 2, 5, 10].map((m) => m * mag).find((u) => span / u <= 10) || 10 * mag;
  const step = Math.max(1, unit), out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + 1e-9; v += step) out.push(Math.round(v));
  return out;
}

function ring(g, x, y, r, color, w) {
  g.strokeStyle = color; g.lineWidth = w;
  g.beginPath(); g.arc(x, y, r, 0, 2 * Math.PI); g.stroke();
}

function badge(g, x, y, letter, color) {
  ring(g, x, y, 9, color, 3);
  g.fillStyle = color; g.font = "bold 11px system-ui, sans-serif"; g.textAlign = "center";
  g.textBaseline = "top"; g.fillText(letter, x, y + 11); g.textAlign = "left";
}

function renderLegend(runs) {
  const box = document.getElementById("lineage-legend");
  if (!box) return;
  const counts = new Map();
  for (const r of state.ov.snaps.run) counts.set(r, (counts.get(r) || 0) + 1);
  clear(box).append(...runs.map((r) => el("li", {class: "run-item", dataset: {run: state.ov.runs[r]}},
    el("span", {class: "swatch", style: {background: runColor(r)}}),
    `${state.ov.runs[r]} (${counts.get(r) || 0})`)));
}

// The snapshot drawn nearest to a point of the canvas (within 10 px), or -1.
export function hit(x, y) {
  if (!layout) return -1;
  let best = -1, bestD = 100;
  for (const i of layout.shown) {
    const dx = layout.px[i] - x, dy = layout.py[i] - y, d = dx * dx + dy * dy;
    if (d < bestD) { bestD = d; best = i; }
  }
  return best;
}

// Where snapshot `pos` is drawn, in page coordinates (for tests and the bench).
export function where(pos) {
  if (!layout || isNaN(layout.px[pos])) return null;
  const r = canvas.getBoundingClientRect();
  return {x: r.left + layout.px[pos], y: r.top + layout.py[pos]};
}

function onMove(ev) {
  const r = canvas.getBoundingClientRect();
  const i = hit(ev.clientX - r.left, ev.clientY - r.top);
  if (i < 0) { tip.hidden = true; canvas.style.cursor = "default"; return; }
  canvas.style.cursor = "pointer";
  const s = state.ov.snaps;
  const tags = state.tagsAt.get(i);
  clear(tip).append(el("div", {}, el("b", {}, ref(i)), el("br"), when(s.t[i]), el("br"),
    `logical ${size(s.logical[i])}, new ${size(s.new[i])}`, tags ? el("div", {}, "tags: " + tags.join(", ")) : null,
    health(i)));
  tip.hidden = false;
  // keep the tip inside the graph: left of the pointer near the right edge, above it near the bottom
  const x = ev.clientX - r.left, y = ev.clientY - r.top, w = tip.offsetWidth, h = tip.offsetHeight;
  tip.style.left = (x + 14 + w > r.width ? Math.max(0, x - 14 - w) : x + 14) + "px";
  tip.style.top = (y + 10 + h > r.height ? Math.max(0, y - 10 - h) : y + 10) + "px";
}

// What the take recorded, for the tooltip (null: nothing to say).
function health(i) {
  const s = state.ov.snaps, parts = [];
  if (s.nonfinite[i]) parts.push(`NaN/Inf: ${s.nonfinite[i]} values`);
  if (s.stale[i]) parts.push(`stale: ${s.stale[i]} tensors`);
  if (s.diverged[i]) parts.push(`replicas differ: ${s.diverged[i]} tensors`);
  return parts.length ? el("div", {class: "tip-flag"}, parts.join(" · ")) : null;
}

function onClick(ev) {
  const r = canvas.getBoundingClientRect();
  const i = hit(ev.clientX - r.left, ev.clientY - r.top);
  if (i < 0) return;
  if (ev.shiftKey) { state.b = i; changed("pair"); }
  else if (ev.altKey) { state.a = i; changed("pair"); }
  state.selected = i;
  changed("selected");
}
