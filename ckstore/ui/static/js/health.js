// Health of one run (where its snapshots recorded it): NaN/Inf, stale and diverged-replica flags, which are also
// marked on the lineage timeline, and the norm of each layer over steps.

import {state, changed} from "./state.js";
import {get} from "./api.js";
import {el, clear, num, table, PALETTE} from "./util.js";
import {showError} from "./shell.js";

let root, plot = null;

export function initHealth(node) {
  root = node;
  root.querySelector("#health-run").addEventListener("change", load);
  root.querySelector("#health-load").addEventListener("click", load);
}

export function fillRuns() {
  const select = root.querySelector("#health-run");
  const current = select.value;
  clear(select).append(...state.ov.runs.map((r) => el("option", {value: r}, r)));
  if (state.ov.runs.includes(current)) select.value = current;
}

export async function load() {
  const run = root.querySelector("#health-run").value;
  if (!run) return;
  const out = clear(root.querySelector("#health-output"));
  root.dataset.state = "loading";
  out.append(el("p", {class: "muted"}, `Reading the health of ${run}…`));
  let d;
  try { d = await get("/api/health", {run, limit: 200}); } catch (e) { showError(e); clear(out); return; }
  clear(out);
  if (plot) { plot.destroy(); plot = null; }
  for (const p of d.points) {
    if (p.nan || p.inf || Object.keys(p.diverged).length) state.flags.set(p.pos, "nan");
    else if (p.stale.length) state.flags.set(p.pos, "stale");
  }
  root.dataset.state = d.recorded ? "recorded" : "none";
  if (!d.recorded) {
    out.append(el("p", {id: "health-empty", class: "empty"}, `No health recorded in run ${run} (${d.read} snapshots read).`));
    return;
  }
  const flagged = d.points.filter((p) => p.nan || p.inf || p.stale.length || Object.keys(p.diverged).length);
  out.append(el("p", {}, `${d.read} snapshots read; ${flagged.length} flagged.`));
  const layers = Object.keys(d.norms);
  const xs = d.points.map((p, i) => (p.step ?? i));
  const chart = el("div", {id: "health-chart"});
  out.append(el("h4", {}, "Norm per layer"), chart);
  plot = new uPlot({
    width: Math.max(400, root.clientWidth - 20), height: 260,
    scales: {x: {time: false}, y: {distr: 3}},
    series: [{label: "step"}, ...layers.map((l, k) => ({label: l, stroke: PALETTE[k % PALETTE.length], width: 1.5, value: (u, v) => num(v)}))],
    axes: [{label: "step"}, {values: (u, vals) => vals.map((v) => num(v, 2)), size: 60}],
  }, [xs, ...layers.map((l) => d.norms[l])], chart);
  out.append(el("h4", {}, "Flags"), flagged.length ? table(["step", "NaN", "Inf", "stale", "diverged replicas", "tensors with NaN/Inf"],
    flagged.map((p) => [p.step ?? "–", p.nan, p.inf, stale(p.stale), diverged(p.diverged), p.bad.slice(0, 6).join(", ") || "–"]), "flags")
    : el("p", {class: "muted"}, "No NaN, Inf, stale tensor or diverged replica recorded."));
  changed("flags");
}

function stale(keys) {
  if (!keys.length) return "–";
  return el("span", {title: keys.join("\n")}, `${keys.length}: ${keys.slice(0, 3).join(", ")}${keys.length > 3 ? ", …" : ""}`);
}

function diverged(found) {
  const keys = Object.keys(found);
  if (!keys.length) return "–";
  const text = keys.map((k) => `${k} (rank ${found[k].join(", ")})`);
  return el("span", {title: text.join("\n")}, `${keys.length}: ${text.slice(0, 2).join(", ")}${keys.length > 2 ? ", …" : ""}`);
}
