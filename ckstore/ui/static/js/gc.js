// Maintenance preview: what `gc` with a policy would drop and reclaim (nothing is deleted),
// the drops crossed out on the lineage graph, and the command line that applies it.

import {state, changed} from "./state.js";
import {get} from "./api.js";
import {el, clear, size} from "./util.js";
import {showError} from "./shell.js";

let root;
const UNIT = {s: 1, h: 3600, d: 86400, w: 604800};

export function initGc(node) {
  root = node;
  root.querySelector("#gc-form").addEventListener("submit", (ev) => { ev.preventDefault(); preview(); });
}

export async function preview() {
  const f = root.querySelector("#gc-form");
  const v = (name) => f.elements[name].value.trim();
  const older = v("older_than") ? String(Number(v("older_than")) * UNIT[v("older_unit")]) : "";
  const grace = v("grace") !== "" ? String(Number(v("grace")) * 3600) : "";
  const params = {keep_last: v("keep_last"), keep_every_steps: v("keep_every_steps"), older_than: older,
    runs: v("runs"), keep_tagged: f.elements.keep_tagged.checked ? "1" : "0", grace_seconds: grace,
    keep_best: v("keep_best"), metric: v("keep_best") ? v("metric") : "", mode: v("mode")};
  const out = clear(root.querySelector("#gc-output"));
  root.dataset.state = "loading";
  out.append(el("p", {class: "muted"}, "Previewing…"));
  let d;
  try { d = await get("/api/gc/preview", params); } catch (e) { root.dataset.state = "error"; clear(out); showError(e); return; }
  state.drop = new Set(d.drop);
  const r = d.report;
  clear(out).append(
    el("p", {id: "gc-summary", class: "summary"},
      el("b", {}, `${d.drop.length} snapshot${d.drop.length === 1 ? "" : "s"} would be dropped`),
      ` (${size(d.drop_logical_bytes)} logical), ${r.snapshots_kept} kept. ` +
      `Reclaims ${size(r.bytes_reclaimed)} now: ${r.chunks_removed} chunks, ${r.manifests_removed} manifests.`),
    r.grace_kept_bytes ? el("p", {class: "muted"}, `The ${Math.round(r.grace_seconds / 3600)} h grace period keeps ` +
      `${size(r.grace_kept_bytes)} (${r.grace_kept_chunks} chunks) for now.`) : null,
    el("p", {}, "Nothing was deleted. To apply it: ", el("code", {id: "gc-command"}, d.command)),
    d.drop.length ? el("p", {}, el("a", {href: "#lineage", id: "gc-show"}, "Show the drops on the lineage graph"), " (crossed out in red)") : null,
    d.drop_refs.length ? el("details", {open: d.drop_refs.length <= 30},
      el("summary", {}, "Snapshots it would drop"),
      el("ul", {id: "gc-drops", class: "drops"}, d.drop_refs.slice(0, 500).map((x) => el("li", {}, x)))) : null);
  root.dataset.state = "done";
  changed("drop");
}
