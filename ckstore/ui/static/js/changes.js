// Changes between two snapshots: a heat map over the model's layers (one row per layer, one
// cell per tensor, coloured by relative change on a log scale; unchanged tensors grey; NaN/Inf
// red), and the most changed tensors. The index-only diff draws first; the numeric one fills
// it in. The app filter (the model's tensors by default, not the optimizer's moments) and the
// key filter narrow the counts, the map and the list alike.

import {state, ref, changed} from "./state.js";
import {get} from "./api.js";
import {el, clear, size, num, ramp, relScale, table} from "./util.js";
import {showError} from "./shell.js";

let root, last = null, seq = 0;

export function initChanges(node) {
  root = node;
  root.querySelector("#compare-form").addEventListener("submit", (ev) => { ev.preventDefault(); compare(); });
  root.querySelector("#key-filter").addEventListener("input", () => last && render(last));
  root.querySelector("#app-filter").addEventListener("change", () => last && render(last));
  root.querySelector("#swap").addEventListener("click", () => {
    const a = root.querySelector("#ref-a"), b = root.querySelector("#ref-b");
    [a.value, b.value] = [b.value, a.value];
  });
}

export function pairChanged() {
  if (state.a >= 0) root.querySelector("#ref-a").value = ref(state.a);
  if (state.b >= 0) root.querySelector("#ref-b").value = ref(state.b);
  const refs = root.querySelector("#refs");
  if (state.ov && !refs.childElementCount) {
    const s = state.ov.snaps, n = s.id.length;
    const opts = Object.keys(state.ov.tags).concat([...Array(Math.min(n, 300)).keys()].map((k) => ref(n - 1 - k)));
    refs.append(...opts.map((o) => el("option", {value: o})));
  }
}

export async function compare() {
  const a = root.querySelector("#ref-a").value.trim(), b = root.querySelector("#ref-b").value.trim();
  if (!a || !b) { showError(new Error("pick two snapshots (A and B) to compare")); return; }
  const numeric = root.querySelector("#numeric").checked;
  const mine = ++seq, status = root.querySelector("#compare-status");
  root.dataset.state = "loading";
  status.textContent = "Comparing from the index…";
  const t0 = performance.now();
  try {
    last = await get("/api/diff", {a, b});
    if (mine !== seq) return;
    fillApps(last);
    render(last);
    if (numeric && last.counts.changed) {
      status.textContent = `Reading the ${last.counts.changed} changed tensors…`;
      last = await get("/api/diff", {a, b, numeric: 1});
      if (mine !== seq) return;
      render(last);
    }
    status.textContent = `Compared in ${Math.round(performance.now() - t0)} ms` + (last.numeric ? " (numeric)" : " (index only)");
    root.dataset.state = "done";
    performance.mark("ckstore-compare-done");
    const ids = state.ov.snaps.id;
    state.a = ids.indexOf(last.a.id); state.b = ids.indexOf(last.b.id);
    changed("pair-drawn");
  } catch (e) { root.dataset.state = "error"; status.textContent = ""; showError(e); }
}

// The apps of the compared keys; the model's picked first when there is one.
function fillApps(d) {
  const select = root.querySelector("#app-filter"), before = select.value;
  const apps = [...new Set(d.keys.map((r) => r[0].split("/")[0]))].sort();
  clear(select).append(el("option", {value: ""}, "(every app)"), ...apps.map((a) => el("option", {value: a}, a)));
  select.value = apps.includes(before) ? before : apps.includes("model") ? "model" : "";
}

export const NONFINITE = "#d62728";

function color(row, col) {
  const st = row[col.status];
  if (st === "unchanged") return null;
  if (typeof row[col.rel] === "string") return NONFINITE;  // "nan" / "inf": never a large change
  const t = relScale(row[col.rel]);
  if (t !== null) return ramp(t);
  if (row[col.chunk_fraction] !== null) return ramp(0.15 + 0.85 * row[col.chunk_fraction]);
  return ramp(0.5);
}

function render(d) {
  const col = Object.fromEntries(d.columns.map((c, i) => [c, i]));
  const filter = root.querySelector("#key-filter").value.trim();
  const app = root.querySelector("#app-filter").value;
  const shown = (r) => (!filter || r[col.key].includes(filter)) && (!app || r[col.key].split("/")[0] === app);
  const c = {changed: 0, added: 0, removed: 0, unchanged: 0};
  for (const r of d.keys) if (shown(r)) c[r[col.status]]++;
  const narrowed = filter || app ? ` (of ${d.keys.length} keys: ${[app && "app " + app, filter && `"${filter}"`].filter(Boolean).join(", ")})` : "";
  clear(root.querySelector("#compare-summary")).append(
    el("span", {class: "pill changed"}, `${c.changed} changed`), el("span", {class: "pill added"}, `${c.added} added`),
    el("span", {class: "pill removed"}, `${c.removed} removed`), el("span", {class: "pill unchanged"}, `${c.unchanged} unchanged`),
    el("span", {class: "muted"}, `${narrowed} ${d.a.ref} → ${d.b.ref}; changed chunks hold ${size(d.bytes.changed_chunk_bytes)};` +
      ` B stores ${size(d.b_deltas.new_stored_bytes)} beyond A`));
  const map = clear(root.querySelector("#heatmap"));
  let cells = 0;
  for (const layer of d.layers) {
    const keys = layer.keys.filter((k) => shown(d.keys[k]));
    if (!keys.length) continue;
    const row = el("div", {class: "hm-row", dataset: {layer: layer.layer, status: layer.status}},
      el("span", {class: "hm-label", title: layer.layer}, layer.layer || "(top level)"),
      el("span", {class: "hm-cells"}, keys.map((k) => {
        const r = d.keys[k], bg = color(r, col);
        cells++;
        return el("span", {class: "hm-cell st-" + r[col.status], style: bg ? {background: bg} : {},
          dataset: {key: r[col.key], status: r[col.status]},
          title: `${r[col.key]}\n${r[col.status]}${r[col.dtype] ? " " + r[col.dtype] : ""}${r[col.shape] ? " [" + r[col.shape] + "]" : ""}` +
            (r[col.rel] !== null ? `\nrelative change ${rel(r[col.rel])}, max |Δ| ${num(r[col.max_abs])}` : "") +
            (r[col.changed_chunks] !== null ? `\nchunks changed ${r[col.changed_chunks]}/${r[col.total_chunks]}` : "") +
            (r[col.reason] ? `\n${r[col.reason]}` : "")}, r[col.leaf].slice(0, 10));
      })),
      el("span", {class: "hm-value" + (typeof layer.rel === "string" ? " nonfinite" : "")},
        layer.rel !== null ? rel(layer.rel) : layer.fraction !== null ? `${Math.round(layer.fraction * 100)}% chunks` : ""));
    map.append(row);
  }
  map.dataset.cells = String(cells);
  const top = d.keys.filter((r) => r[col.status] !== "unchanged" && shown(r))
    .sort((x, y) => rank(y, col) - rank(x, col)).slice(0, 50);
  clear(root.querySelector("#change-table")).append(table(
    ["key", "status", "dtype", "shape", "chunks changed", "relative change", "max |Δ|"],
    top.map((r) => [r[col.key], r[col.status], r[col.dtype] ?? "–", r[col.shape] ? `[${r[col.shape]}]` : "–",
      r[col.changed_chunks] !== null ? `${r[col.changed_chunks]}/${r[col.total_chunks]}` : "–",
      typeof r[col.rel] === "string" ? el("span", {class: "nonfinite"}, rel(r[col.rel])) : rel(r[col.rel]), num(r[col.max_abs])]),
    "changes"));
}

// A relative change as people read it: NaN and Inf named, never a number.
function rel(x) {
  if (x === "nan") return "NaN";
  if (x === "inf") return "Inf";
  return num(x);
}

function rank(r, col) {
  const rel = r[col.rel];
  if (typeof rel === "string") return Infinity;
  return rel !== null ? rel : (r[col.chunk_fraction] ?? 1) - 2;
}
