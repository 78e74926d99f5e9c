// Small helpers shared by the views: formatting, DOM building, the colour scale.

export function size(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let v = Number(n), i = 0;
  while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return (i === 0 ? String(v) : v.toFixed(1)) + " " + units[i];  // as the command line prints
}

// Local time, YYYY-MM-DD HH:MM:SS, as the command line prints it.
export function when(t) {
  if (t === null || t === undefined) return "–";
  const d = new Date(t * 1000), p = (n) => String(n).padStart(2, "0");
  return `${d.getFullYear()}-${p(d.getMonth() + 1)}-${p(d.getDate())} ${p(d.getHours())}:${p(d.getMinutes())}:${p(d.getSeconds())}`;
}

// logical / stored as the command line prints it: 3.96x.
export function ratio(x) { return x ? x.toFixed(2) + "x" : "–"; }

export function num(x, digits = 3) {
  if (x === null || x === undefined) return "–";
  if (typeof x === "string") return x;  // "inf", "nan" from strict JSON
  if (x === 0) return "0";
  const a = Math.abs(x);
  return a >= 1e4 || a < 1e-3 ? x.toExponential(digits - 1) : x.toPrecision(digits);
}

// el("td", {class: "x", title: "..."}, child, "text") -> an element (text is never parsed as HTML)
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "dataset") Object.assign(node.dataset, v);
    else if (k === "style") Object.assign(node.style, v);  // CSSOM: allowed by the page's CSP
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

export function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); return node; }

export function table(headers, rows, cls = "") {
  return el("table", {class: cls},
    el("thead", {}, el("tr", {}, headers.map((h) => el("th", {}, h)))),
    el("tbody", {}, rows.map((r) => el("tr", {}, r.map((c) => el("td", {}, c))))));
}

// A perceptual ramp (dark blue -> teal -> yellow), t in [0, 1].
const RAMP = [[48, 18, 59], [50, 100, 200], [30, 170, 160], [140, 210, 80], [250, 230, 50]];
export function ramp(t) {
  t = Math.max(0, Math.min(1, t));
  const x = t * (RAMP.length - 1), i = Math.min(RAMP.length - 2, Math.floor(x)), f = x - i;
  const c = RAMP[i].map((v, k) => Math.round(v + (RAMP[i + 1][k] - v) * f));
  return `rgb(${c[0]},${c[1]},${c[2]})`;
}

// Relative change on a log scale: 1e-6 (or less) -> 0, 1 (or more) -> 1.
export function relScale(rel) {
  if (rel === null || rel === undefined) return null;
  if (typeof rel === "string") return 1;  // inf / nan: as bad as it gets
  if (rel <= 0) return 0;
  return Math.max(0, Math.min(1, (Math.log10(rel) + 6) / 6));
}

export const PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948",
  "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"];
export function runColor(i) { return PALETTE[i % PALETTE.length]; }
