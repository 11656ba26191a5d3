// The Hardware page: every node with its liveness and readiness, refreshed in place every few
// seconds; a hint instead of an empty table while no node is enrolled.
import { api, age, el, errorText, gib, setText } from "./console.js";

export const REFRESH_SECONDS = 5;
const tbody = document.getElementById("fleet-rows");
const status = document.getElementById("fleet-status");
const alertsBox = document.getElementById("alerts");
const emptyHint = document.getElementById("fleet-empty");
const table = document.getElementById("fleet-table");
const rows = new Map(); // node_id -> {tr, cells}
let refreshes = 0;

function gpuSummary(accelerators) {
  if (!accelerators || accelerators.length === 0) return "none";
  const kinds = new Map();
  for (const gpu of accelerators) {
    const key = `${gpu.name} · ${gib(gpu.memory_total_bytes)}`;
    kinds.set(key, (kinds.get(key) || 0) + 1);
  }
  return [...kinds].map(([key, count]) => `${count} × ${key}`).join(", ");
}

// READY, or NOT READY and the first failing check (the node page lists them all); a
// decommissioned node is never ready, and its liveness already says why.
function readinessText(node) {
  if (node.liveness === "decommissioned") return ["retired", "—", ""];
  const { ready, failing } = node.readiness;
  if (ready) return ["ready", "READY", "every readiness check passes"];
  return ["not-ready", `NOT READY · ${failing[0]}`, `failing: ${failing.join(", ")}`];
}

function makeRow(node) {
  const badge = el("span", { class: "badge" });
  const ready = el("span", { class: "ready" });
  const link = el("a", { href: `/console/nodes/${encodeURIComponent(node.node_id)}` });
  const cells = {
    badge,
    ready,
    link,
    hostname: el("td"),
    gpus: el("td"),
    heartbeat: el("td"),
    cordoned: el("td", { "data-field": "cordoned" }),
    eligible: el("td", { "data-field": "production_eligible" }),
  };
  const tr = el(
    "tr",
    { "data-testid": "node-row", "data-node-id": node.node_id },
    el("td", {}, badge),
    el("td", { "data-field": "ready" }, ready),
    el("td", {}, link),
    cells.hostname,
    cells.gpus,
    cells.heartbeat,
    cells.cordoned,
    cells.eligible,
  );
  return { tr, cells, liveness: null, ready: null };
}

function updateRow(row, node, now) {
  const { cells } = row;
  if (row.liveness !== node.liveness) {
    cells.badge.className = `badge liveness-${node.liveness}`;
    row.liveness = node.liveness;
    row.tr.setAttribute("data-liveness", node.liveness);
  }
  setText(cells.badge, node.liveness);
  const [state, text, title] = readinessText(node);
  if (row.ready !== state) {
    cells.ready.className = `ready ready-${state}`;
    row.ready = state;
    row.tr.setAttribute("data-ready", state);
  }
  setText(cells.ready, text);
  if (cells.ready.title !== title) cells.ready.title = title;
  setText(cells.link, node.display_name);
  setText(cells.hostname, node.hostname);
  setText(cells.gpus, gpuSummary(node.accelerators));
  const beat = node.last_heartbeat_at ? (now - Date.parse(node.last_heartbeat_at)) / 1000 : null;
  setText(cells.heartbeat, age(beat));
  setText(cells.cordoned, node.cordoned ? "yes" : "no");
  setText(cells.eligible, node.production_eligible ? "yes" : "no");
}

const ALERTS_SHOWN = 5;

function alertLine(alert) {
  return el(
    "div",
    { class: `alert ${alert.severity}`, "data-testid": "alert" },
    el("strong", { text: `${alert.kind.replace(/_/g, " ")}: ` }),
    el("a", { href: `/console/nodes/${encodeURIComponent(alert.node_id)}`, text: alert.display_name }),
    ` — ${alert.message}. ${alert.next_step}`,
  );
}

// Critical alerts first; past a handful, the rest fold away so the fleet stays in view.
function renderAlerts(alerts) {
  const ordered = [...alerts].sort((a, b) => (a.severity === "critical" ? 0 : 1) - (b.severity === "critical" ? 0 : 1));
  const shown = ordered.slice(0, ALERTS_SHOWN).map(alertLine);
  const rest = ordered.slice(ALERTS_SHOWN);
  if (rest.length) {
    const open = alertsBox.querySelector("details") ? alertsBox.querySelector("details").open : false;
    const more = el("details", { open }, el("summary", { text: `${rest.length} more alert${rest.length === 1 ? "" : "s"}` }), ...rest.map(alertLine));
    shown.push(more);
  }
  alertsBox.replaceChildren(...shown);
}

let busy = false;

export async function refresh() {
  if (busy) return; // a slow answer is never overtaken by the next tick
  busy = true;
  try {
    await refreshOnce();
  } finally {
    busy = false;
  }
}

async function refreshOnce() {
  const started = performance.now();
  let fleet, alerts;
  try {
    [fleet, alerts] = await Promise.all([
      api("GET", "/admin/hardware/nodes"),
      api("GET", "/admin/alerts"),
    ]);
  } catch (error) {
    status.textContent = `Could not refresh: ${errorText(error)}`;
    return;
  }
  const fetched = performance.now();
  const now = Date.parse(fleet.server_time);
  renderAlerts(alerts.alerts);
  const seen = new Set();
  const added = document.createDocumentFragment();
  for (const node of fleet.nodes) {
    seen.add(node.node_id);
    let row = rows.get(node.node_id);
    if (!row) {
      row = makeRow(node);
      rows.set(node.node_id, row);
      added.append(row.tr);
    }
    updateRow(row, node, now);
  }
  tbody.append(added);
  for (const [nodeId, row] of rows) {
    if (!seen.has(nodeId)) {
      row.tr.remove();
      rows.delete(nodeId);
    }
  }
  const empty = fleet.nodes.length === 0;
  emptyHint.hidden = !empty;
  table.hidden = empty;
  refreshes += 1;
  // Timings for the browser test and bench/console.py: the whole refresh, and its DOM part.
  const done = performance.now();
  document.body.setAttribute("data-fleet-refreshes", String(refreshes));
  document.body.setAttribute("data-fleet-refresh-ms", String(Math.round(done - started)));
  document.body.setAttribute("data-fleet-render-ms", String(Math.round(done - fetched)));
  document.body.setAttribute("data-fleet-rendered-at", String(Math.round(done)));
  setText(
    status,
    `${fleet.nodes.length} node${fleet.nodes.length === 1 ? "" : "s"} · refreshed every ${REFRESH_SECONDS} s`,
  );
}

refresh();
window.setInterval(refresh, REFRESH_SECONDS * 1000);
document.addEventListener("modelforge:enrolled", () => refresh());
