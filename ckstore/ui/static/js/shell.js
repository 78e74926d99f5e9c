// The page's frame: errors in a banner, the confirmation dialog, reloading the overview.

import {get} from "./api.js";
import {state, setOverview, changed} from "./state.js";
import {el, clear} from "./util.js";

export function showError(e) {
  const banner = document.getElementById("banner");
  clear(banner).append(el("span", {id: "banner-text"}, e && e.message ? e.message : String(e)),
    el("button", {class: "close", onclick: () => { banner.hidden = true; }}, "×"));
  banner.hidden = false;
}

export function confirmAction(question) {
  const dialog = document.getElementById("confirm");
  document.getElementById("confirm-text").textContent = question;
  return new Promise((resolve) => {
    const done = (ok) => () => {
      dialog.close();
      ok_.removeEventListener("click", yes); no_.removeEventListener("click", no);
      resolve(ok);
    };
    const ok_ = document.getElementById("confirm-ok"), no_ = document.getElementById("confirm-cancel");
    const yes = done(true), no = done(false);
    ok_.addEventListener("click", yes); no_.addEventListener("click", no);
    dialog.showModal();
  });
}

export async function refresh() {
  const ids = state.ov ? state.ov.snaps.id : [];
  const keep = (p) => (p >= 0 ? ids[p] : null);
  const [a, b] = [keep(state.a), keep(state.b)];
  setOverview(await get("/api/overview"));
  state.a = a ? state.ov.snaps.id.indexOf(a) : -1;
  state.b = b ? state.ov.snaps.id.indexOf(b) : -1;
  state.drop = new Set();
  try { state.forks = (await get("/api/forks")).edges; } catch (e) { state.forks = []; }
  changed("overview");
}
