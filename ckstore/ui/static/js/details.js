// The panel of the selected snapshot: record, tags, sharing, and the actions (with the token).

import {state, ref, changed} from "./state.js";
import {get, post, hasToken} from "./api.js";
import {el, clear, size, when, table} from "./util.js";
import {confirmAction, showError, refresh} from "./shell.js";
import {showRun} from "./health.js";

let box, seq = 0;

export function initDetails(root) { box = root; }

export async function showDetails() {
  if (state.selected < 0) { clear(box).append(el("p", {class: "muted"}, "Click a snapshot to see it here.")); return; }
  const pos = state.selected, id = state.ov.snaps.id[pos], mine = ++seq;
  clear(box).append(el("p", {class: "muted"}, "Loading " + ref(pos) + "…"));
  let d;
  try { d = await get("/api/snapshot", {ref: id}); } catch (e) { showError(e); return; }
  if (mine !== seq) return;  // a later selection (or refresh) renders instead
  const shared = d.shared.length
    ? table(["snapshot", "relation", "chunks", "stored"], d.shared.map((s) => [s.ref, s.relation, s.chunks, size(s.stored_bytes)]), "compact shared")
    : el("p", {class: "muted"}, "Shares no chunk with its neighbours, tagged snapshots or other runs' latest.");
  const meta = Object.keys(d.metadata).length ? el("pre", {class: "meta"}, JSON.stringify(d.metadata, null, 1)) : null;
  clear(box).append(
    el("h3", {id: "details-ref"}, d.ref),
    el("dl", {class: "facts"},
      fact("id", d.id.slice(0, 12) + "…"), fact("run", d.run), fact("step", d.step ?? "–"),
      fact("taken", when(d.created_at)), fact("logical", size(d.logical_bytes)),
      fact("new bytes stored", size(d.new_bytes) + ` (${d.new_chunks} chunks; ${d.reused_chunks} reused)`),
      fact("stored (all its chunks)", size(d.stored_bytes)),
      fact("only in this snapshot", size(d.exclusive_bytes) + ` (${d.exclusive_chunks} chunks)`),
      fact("tags", d.tags.length ? d.tags.join(", ") : "–"),
      d.forked_from ? fact("forked from", el("span", {id: "details-fork", class: "ref"}, d.forked_from.ref)) : null,
      fact("health", healthLine(d))),
    meta,
    el("div", {class: "buttons"},
      el("button", {id: "set-a", onclick: () => { state.a = pos; changed("pair"); }}, "Compare as A"),
      el("button", {id: "set-b", onclick: () => { state.b = pos; changed("pair"); }}, "Compare as B")),
    el("h4", {}, "Shares chunks with"), shared,
    actions(d));
}

function fact(k, v) { return [el("dt", {}, k), el("dd", {}, v)]; }

// What the take recorded, from the index: NaN/Inf elements and stale tensors.
function healthLine(d) {
  if (d.nonfinite === null && d.stale === null) return el("span", {id: "details-health", class: "muted"}, "not recorded");
  const parts = [];
  if (d.nonfinite) parts.push(el("span", {class: "flag nan"}, `NaN/Inf: ${d.nonfinite} values`));
  if (d.stale) parts.push(el("span", {class: "flag stale"}, `stale: ${d.stale} tensors`));
  if (!parts.length) parts.push(d.nonfinite === 0 ? "ok: no NaN or Inf" : "–");
  if (d.nonfinite || d.stale) parts.push(" ", el("a", {href: "#health", class: "link", onclick: () => showRun(d.run)}, "see Health"));
  return el("span", {id: "details-health"}, parts);
}

function actions(d) {
  const can = hasToken();
  const name = el("input", {id: "tag-name", placeholder: "tag name", maxlength: "128", disabled: !can});
  const force = el("input", {type: "checkbox", id: "tag-force", disabled: !can});
  const untags = d.tags.map((t) => el("button", {class: "untag", disabled: !can, dataset: {tag: t},
    onclick: () => act(`Remove tag ${t}?`, "/api/untag", {name: t, snapshot: d.id})}, `untag ${t}`));
  return el("div", {class: "actions"},
    el("h4", {}, "Change"),
    can ? null : el("p", {class: "muted", id: "read-only-note"},
      "Read-only: open the URL that `ckstore ui` printed (it carries the token) to tag or delete."),
    el("div", {class: "row"}, name, el("label", {}, force, " move"),
      el("button", {id: "tag-button", disabled: !can, onclick: () => {
        if (!name.value) return;
        act(`Tag ${d.ref} as ${name.value}?`, "/api/tag", {ref: d.id, name: name.value, force: force.checked});
      }}, "Tag")),
    el("div", {class: "row"}, untags),
    el("div", {class: "row"}, el("button", {id: "delete-button", class: "danger", disabled: !can, onclick: () =>
      act(`Delete snapshot ${d.ref}${d.tags.length ? " and its tags " + d.tags.join(", ") : ""}? ` +
          "Its bytes are reclaimed by the next gc.", "/api/delete", {ref: d.id, force: d.tags.length > 0, tags: d.tags})},
      "Delete snapshot…")));
}

async function act(question, path, body) {
  if (!(await confirmAction(question))) return;
  try {
    await post(path, body);
  } catch (e) { showError(e); return; }
  const id = body.ref;
  await refresh();
  if (path === "/api/delete") state.selected = -1;
  else if (id) state.selected = state.ov.snaps.id.indexOf(id);
  changed("selected");
}
