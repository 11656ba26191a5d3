// What every console page shares: calling the admin API with the session, small DOM helpers.
// The session cookie is HttpOnly; state-changing calls carry the page's CSRF token.

const meta = document.querySelector('meta[name="csrf-token"]');
export const csrfToken = meta ? meta.getAttribute("content") : "";

export class ApiError extends Error {
  constructor(status, body) {
    const error = (body && body.error) || {};
    super(error.message || `HTTP ${status}`);
    this.status = status;
    this.code = error.code || "";
    this.nextStep = error.next_step || "";
    this.body = body || {};
  }
}

let leaving = false; // one redirect to the sign-in page, however many calls were refused

export async function api(method, path, body) {
  const headers = { Accept: "application/json" };
  if (method !== "GET") headers["X-CSRF-Token"] = csrfToken;
  const init = { method, headers, credentials: "same-origin", cache: "no-store" };
  if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const response = await fetch(`/api/v1${path}`, init);
  const data = await response.json().catch(() => ({}));
  if (response.status === 401 && data.error && data.error.code === "SESSION_EXPIRED" && !leaving) {
    leaving = true;
    window.location.assign("/console/sign-in");
  }
  if (!response.ok) throw new ApiError(response.status, data);
  return data;
}

// Build an element; children are nodes or text (always text, never parsed as HTML).
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "class") node.className = value;
    else if (name === "text") node.textContent = value;
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

export function setText(node, text) {
  if (node.textContent !== text) node.textContent = text;
}

export function age(seconds) {
  if (seconds === null || seconds === undefined || Number.isNaN(seconds)) return "never";
  const s = Math.max(0, Math.round(seconds));
  if (s < 90) return `${s} s ago`;
  if (s < 5400) return `${Math.round(s / 60)} min ago`;
  if (s < 172800) return `${Math.round(s / 3600)} h ago`;
  return `${Math.round(s / 86400)} d ago`;
}

export function gib(bytes) {
  if (bytes === null || bytes === undefined) return "?";
  return `${(bytes / 2 ** 30).toFixed(bytes >= 10 * 2 ** 30 ? 0 : 1)} GiB`;
}

export function when(iso) {
  return iso ? new Date(iso).toLocaleString() : "—";
}

// A JSON value as "key: value" pairs: nested keys dotted (constraints.gpu_count), list items
// indexed unless they are plain values (joined), null and empty as "none". Never HTML.
export function flatten(value, prefix = "", pairs = []) {
  const plain = (v) => v === null || typeof v !== "object";
  if (Array.isArray(value) && value.length && !value.every(plain)) {
    value.forEach((item, index) => flatten(item, `${prefix}[${index}]`, pairs));
  } else if (value !== null && typeof value === "object" && !Array.isArray(value) && Object.keys(value).length) {
    for (const key of Object.keys(value).sort()) flatten(value[key], prefix ? `${prefix}.${key}` : key, pairs);
  } else if (prefix) {
    pairs.push([prefix, Array.isArray(value) ? value.map(shown).join(", ") || "none" : shown(value)]);
  }
  return pairs;
}

function shown(value) {
  if (value === null || value === undefined || (typeof value === "object" && !Object.keys(value).length)) return "none";
  return value === "" ? '""' : String(value);
}

// The pairs of flatten() as a definition list (text nodes only), or a dash when there are none.
export function keyValues(value, attrs = {}) {
  if (value !== null && value !== undefined && typeof value !== "object") return el("span", { text: String(value) });
  const pairs = flatten(value);
  if (!pairs.length) return el("span", { class: "muted", text: "—" });
  return el("dl", { class: "kv", ...attrs }, ...pairs.flatMap(([key, text]) => [el("dt", { text: key }), el("dd", { text })]));
}

export function errorText(error) {
  if (error instanceof ApiError) {
    return `${error.message}${error.nextStep ? ` — ${error.nextStep}` : ""}`;
  }
  return String(error && error.message ? error.message : error);
}

const logout = document.getElementById("logout");
if (logout) {
  logout.addEventListener("click", async () => {
    await fetch("/console/sign-out", {
      method: "POST",
      headers: { "X-CSRF-Token": csrfToken, Accept: "application/json" },
      credentials: "same-origin",
    }).catch(() => null);
    window.location.assign("/console/sign-in");
  });
}
