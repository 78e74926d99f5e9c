// The page's calls to its server. The token (from the URL `ckstore ui` printed) is kept for
// the browser session only, taken out of the address bar, and sent in a header, never a cookie.

const KEY = "ckstore-ui-token";

export function takeToken() {
  const params = new URLSearchParams(location.search);
  const given = params.get("token");
  if (given) {
    sessionStorage.setItem(KEY, given);
    params.delete("token");
    const rest = params.toString();
    history.replaceState(null, "", location.pathname + (rest ? "?" + rest : "") + location.hash);
  }
  return sessionStorage.getItem(KEY);
}

export function hasToken() { return !!sessionStorage.getItem(KEY); }

export class ApiError extends Error {
  constructor(status, body) {
    super(body && body.error ? body.error : `HTTP ${status}`);
    this.status = status;
    this.type = body && body.type;
  }
}

async function decode(res) {
  let body = null;
  try { body = await res.json(); } catch (e) { body = null; }
  if (!res.ok) throw new ApiError(res.status, body);
  return body;
}

export async function get(path, params = {}) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v !== null && v !== undefined && v !== "") q.set(k, v);
  const qs = q.toString();
  return decode(await fetch(path + (qs ? "?" + qs : ""), {headers: {accept: "application/json"}}));
}

export async function post(path, body) {
  const headers = {"content-type": "application/json", accept: "application/json"};
  const token = sessionStorage.getItem(KEY);
  if (token) headers["x-ckstore-token"] = token;
  return decode(await fetch(path, {method: "POST", headers, body: JSON.stringify(body)}));
}
