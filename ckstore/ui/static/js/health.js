// Health of one run (where its snapshots recorded it): NaN/Inf, stale and diverged-replica
// flags (the lineage marks them from the index, without this view), and the norm of each layer
// of one app over steps: the model's weights by default, with the points where a layer held
// NaN/Inf marked.

import {state} from "./state.js";
import {get} from "./api.js";
import {el, clear, num, table, PALETTE} from "./util.js";
import {showError} from "./shell.js";

let root, plot = null, seq = 0;
const SHOWN = 6;  // tensors named per flagged snapshot before "and N more"

export function initHealth(node) {
  root = node;
  root.querySelector("#health-run").addEventListener("change", () => load(""));
  root.querySelector("#health-app").addEventListener("change", () => load(root.querySelector("#health-app").value));
  root.querySelector("#health-load").addEventListener("click", () => load(root.querySelector("#health-app").value));
}

export function fillRuns() {
  const select = root.querySelector("#health-run");
  const current = select.value;
  clear(select).append(...state.ov.runs.map((r) => el("option", {value: r}, r)));
  if (state.ov.runs.includes(current)) select.value = current;
}

// Open the health of `run` (the details panel's link).
export function showRun(run) {
  root.querySelector("#health-run").value = run;
  load("");
}

export async function load(app = "") {
  const run = root.querySelector("#health-run").value;
  if (!run) return;
  const out = clear(root.querySelector("#health-output")), mine = ++seq;
  root.dataset.state = "loading";
  out.append(el("p", {class: "muted"}, `Reading the health of ${run}…`));
  let d;
  try { d = await get("/api/health", {run, limit: 200, app}); } catch (e) { showError(e); clear(out); return; }
  if (mine !== seq) return;
  clear(out);
  if (plot) { plot.destroy(); plot = null; }
  const apps = root.querySelector("#health-app");
  clear(apps).append(...d.apps.map((a) => el("option", {value: a}, a)), el("option", {value: "*"}, "(every app)"));
  apps.value = d.app;
  root.dataset.state = d.recorded ? "recorded" : "none";
  if (!d.recorded) {
    out.append(el("p", {id: "health-empty", class: "empty"}, `No health recorded in run ${run} (${d.read} snapshots read).`));
    return;
  }
  const flagged = d.points.filter((p) => p.nan || p.inf || p.stale.length || Object.keys(p.diverged).length);
  const layers = Object.keys(d.norms);
  out.append(el("p", {}, `${d.read} snapshots read; ${flagged.length} flagged. ` +
    `Norms of ${d.app === "*" ? "every app" : d.app}: ${layers.length} of ${d.layers} layers` +
    (d.layers > layers.length ? " (those with NaN/Inf, then the largest)" : "") + "."));
  const xs = d.points.map((p, i) => (p.step ?? i));
  const chart = el("div", {id: "health-chart"});
  out.append(el("h4", {}, "Norm per layer"), chart,
    el("p", {class: "muted"}, el("span", {class: "mark nan"}, "!"),
      " a layer held NaN/Inf at that step (its norm counts the finite values)"));
  let marks = 0;
  const drawMarks = (u) => {
    const g = u.ctx, dpr = window.devicePixelRatio || 1;
    marks = 0;
    g.save();
    layers.forEach((l) => {
      for (const i of d.nonfinite[l] || []) {
        const v = d.norms[l][i];
        const x = u.valToPos(xs[i], "x", true);
        const y = v > 0 ? u.valToPos(v, "y", true) : u.bbox.top + u.bbox.height - 8 * dpr;
        g.fillStyle = "#d62728"; g.strokeStyle = "#fff"; g.lineWidth = 1.5 * dpr;
        g.beginPath(); g.arc(x, y, 7 * dpr, 0, 2 * Math.PI); g.fill(); g.stroke();
        g.fillStyle = "#fff"; g.font = `bold ${10 * dpr}px system-ui, sans-serif`;
        g.textAlign = "center"; g.textBaseline = "middle"; g.fillText("!", x, y);
        marks++;
      }
    });
    g.restore();
    chart.dataset.nanMarks = String(marks);
  };
  plot = new uPlot({
    width: Math.max(400, root.clientWidth - 20), height: 260,
    scales: {x: {time: false}, y: {distr: 3}},
    series: [{label: "step", value: (u, v) => (v === null || v === undefined ? "–" : String(v))},
      ...layers.map((l, k) => ({label: l, stroke: PALETTE[k % PALETTE.length], width: 1.5, value: (u, v) => num(v),
        points: {show: true, size: 4}}))],
    axes: [{label: "step"}, {values: (u, vals) => vals.map((v) => (v === null || v === undefined ? "" : num(v, 2))), size: 60}],
    hooks: {draw: [drawMarks]},
  }, [xs, ...layers.map((l) => d.norms[l].map((v) => (v > 0 ? v : null)))], chart);
  out.append(el("h4", {}, "Flags"), flagged.length ? table(["step", "NaN", "Inf", "stale", "diverged replicas", "tensors with NaN/Inf"],
    flagged.map((p) => [p.step ?? "–", p.nan, p.inf, some(p.stale, 3), diverged(p.diverged), some(p.bad, SHOWN)]), "flags")
    : el("p", {class: "muted"}, "No NaN, Inf, stale tensor or diverged replica recorded."));
}

// The first `n` keys, then how many more (all of them in the tooltip).
function some(keys, n) {
  if (!keys.length) return "–";
  const more = keys.length > n ? ` … and ${keys.length - n} more` : "";
  return el("span", {title: keys.join("\n")}, keys.slice(0, n).join(", ") + more);
}

function diverged(found) {
  const keys = Object.keys(found);
  if (!keys.length) return "–";
  const text = keys.map((k) => `${k} (rank ${found[k].join(", ")})`);
  return el("span", {title: text.join("\n")}, `${keys.length}: ${text.slice(0, 2).join(", ")}${keys.length > 2 ? ", …" : ""}`);
}
