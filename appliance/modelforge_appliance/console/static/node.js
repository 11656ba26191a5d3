// A node page: facts, actions, readiness, the servers and replicas it holds, per-GPU charts of
// the last hour, credentials, audit.
import { api, age, el, errorText, gib, keyValues, setText, when } from "./console.js";

const $ = (id) => document.getElementById(id);
const nodeId = $("node").getAttribute("data-node-id");
const base = `/admin/hardware/nodes/${encodeURIComponent(nodeId)}`;
const errorBox = $("node-error");
let preview = null;
let pendingDigest = null; // the hardware change shown, which Accept hardware accepts
const charts = new Map(); // `${uuid}/${metric}` -> uPlot
const METRICS = [
  ["utilization_gpu_percent", "Utilisation", "%", (v) => v],
  ["memory_used_bytes", "Memory used", "GiB", (v) => (v === null ? null : v / 2 ** 30)],
  ["temperature_c", "Temperature", "°C", (v) => v],
  ["power_w", "Power", "W", (v) => v],
];

function show(error) {
  errorBox.textContent = error ? errorText(error) : "";
}

function fact(term, value) {
  return [el("dt", { text: term }), el("dd", { text: value })];
}

async function loadNode() {
  const node = await api("GET", base);
  setText($("node-name"), node.display_name);
  const badge = $("node-liveness");
  badge.className = `badge liveness-${node.liveness}`;
  setText(badge, node.liveness);
  const beat = node.last_heartbeat_at ? age((Date.now() - Date.parse(node.last_heartbeat_at)) / 1000) : "never";
  $("node-facts").replaceChildren(
    ...fact("Node id", node.node_id),
    ...fact("Hostname", node.hostname),
    ...fact("Last heartbeat", node.last_heartbeat_at ? `${when(node.last_heartbeat_at)} (${beat})` : "never"),
    ...fact("Agent", `${node.agent_version} · protocol ${node.protocol_version} · ${node.accelerator_mode}`),
    ...fact("GPUs", node.accelerators.map((g) => `#${g.index} ${g.name} ${gib(g.memory_total_bytes)}`).join(", ") || "none"),
    ...fact("Cordoned", node.cordoned ? "yes" : "no"),
    ...fact("Production eligible", node.production_eligible ? "yes" : "no"),
    ...fact("Enrolled", when(node.enrolled_at)),
  );
  const retired = node.liveness === "decommissioned";
  showHardware(retired ? { pending: false } : node.hardware);
  $("cordon").disabled = retired || node.cordoned;
  $("uncordon").disabled = retired || !node.cordoned;
  $("revoke-credential").disabled = retired;
  $("decommission-preview").disabled = retired;
}

// Accelerators the node published unlike its accepted ones (trust on first use).
function showHardware(hardware) {
  const panel = $("hardware-change");
  panel.hidden = !hardware.pending;
  pendingDigest = hardware.pending ? hardware.digest : null;
  if (!hardware.pending) return;
  setText($("hardware-since"), `on ${when(hardware.since)}`);
  const memory = (change, side) => (change.field === "memory_total_bytes" ? gib(change[side]) : String(change[side]));
  const difference = hardware.difference;
  $("hardware-difference").replaceChildren(
    ...difference.appeared.map((g) => el("li", { text: `appeared: ${g.uuid} (${g.name}, ${gib(g.memory_total_bytes)})` })),
    ...difference.vanished.map((g) => el("li", { text: `vanished: ${g.uuid} (${g.name}, ${gib(g.memory_total_bytes)})` })),
    ...difference.changed.map((c) => el("li", { text: `${c.uuid}: ${c.field} ${memory(c, "accepted")} → ${memory(c, "published")}` })),
  );
}

async function loadReadiness() {
  const readiness = await api("GET", `${base}/readiness`);
  $("readiness").replaceChildren(
    ...readiness.checks.map((check) =>
      el(
        "li",
        { class: check.ok ? "ok" : "failing", "data-check": check.name },
        el("strong", { text: `${check.ok ? "✓" : "✗"} ${check.name}` }),
        ` — ${check.detail}`,
        check.next_step ? el("div", { class: "next-step", text: `Next: ${check.next_step}` }) : null,
      ),
    ),
  );
}

function whyCell(error) {
  if (!error) return el("td", { class: "muted", text: "—" });
  return el("td", { "data-code": error.code }, el("strong", { text: error.code }), ` ${error.message || ""}`);
}

async function loadServing() {
  const answer = await api("GET", `${base}/serving`);
  $("servers").replaceChildren(
    ...answer.servers.map((s) =>
      el(
        "tr",
        { "data-testid": "node-server", "data-deployment": s.deployment, "data-state": s.state },
        el("td", {}, el("a", { href: "/console/deployments", text: s.deployment })),
        el("td", { text: `${s.model}@${s.revision} · ${s.runtime}` }),
        el("td", {}, el("span", { class: `badge server-${s.state}`, text: s.state })),
        el("td", { text: when(s.state_since) }),
        el("td", { text: String(s.restarts ?? 0) }),
        whyCell(s.error),
      ),
    ),
  );
  $("servers-none").hidden = answer.servers.length > 0;
  $("replicas").replaceChildren(
    ...answer.replicas.map((r) =>
      el(
        "tr",
        { "data-testid": "node-replica", "data-model": r.model, "data-state": r.state },
        el("td", {}, el("a", { href: "/console/models", text: `${r.model}@${r.revision}` })),
        el("td", {}, el("span", { class: `badge replica-${r.state}`, text: r.state })),
        el("td", { text: r.bytes_total ? `${gib(r.bytes_done)} of ${gib(r.bytes_total)}` : "—" }),
        whyCell(r.error),
      ),
    ),
  );
  $("replicas-none").hidden = answer.replicas.length > 0;
}

async function loadCredentials() {
  const answer = await api("GET", `${base}/credentials`);
  setText($("credential-counts"), `${answer.active} active, ${answer.revoked} revoked`);
  $("credentials").replaceChildren(
    ...answer.credentials.map((c) =>
      el("tr", {}, el("td", { text: c.credential_id }), el("td", { text: when(c.created_at) }), el("td", { text: when(c.last_used_at) }), el("td", { text: c.revoked_at ? `${when(c.revoked_at)} (${c.revoked_reason || ""})` : "—" })),
    ),
  );
}

async function loadAudit() {
  const answer = await api("GET", `/admin/audit-events?limit=50&node_id=${encodeURIComponent(nodeId)}`);
  $("audit").replaceChildren(
    ...answer.events.map((e) =>
      el("tr", {}, el("td", { text: when(e.at) }), el("td", { text: e.actor }), el("td", { text: e.action }), el("td", { class: "detail" }, keyValues(e.detail))),
    ),
  );
}

function chartWidth() {
  return Math.max(260, Math.min(420, Math.floor(($("charts").clientWidth - 48) / 4)));
}

async function loadTelemetry() {
  const answer = await api("GET", `${base}/telemetry`);
  const box = $("charts");
  if (answer.gpus.length === 0) {
    box.replaceChildren(el("p", { class: "muted", text: "No telemetry in the last hour." }));
    charts.clear();
    return;
  }
  if (typeof window.uPlot !== "function") {
    box.replaceChildren(el("p", { class: "error", text: "The chart library did not load." }));
    return;
  }
  const seen = new Set();
  for (const gpu of answer.gpus) {
    const xs = gpu.samples.map((s) => Date.parse(s.at) / 1000);
    let group = box.querySelector(`[data-gpu="${CSS.escape(gpu.uuid)}"]`);
    if (!group) {
      group = el("div", { class: "gpu", "data-gpu": gpu.uuid, "data-testid": "gpu-charts" }, el("h3", { text: `GPU ${gpu.index} · ${gpu.uuid}` }));
      box.append(group);
    }
    for (const [field, title, unit, scale] of METRICS) {
      const key = `${gpu.uuid}/${field}`;
      seen.add(key);
      const data = [xs, gpu.samples.map((s) => scale(s[field]))];
      const existing = charts.get(key);
      if (existing) {
        existing.setData(data);
        continue;
      }
      const holder = el("div", { class: "chart", "data-metric": field });
      group.append(holder);
      const options = {
        title: `${title} (${unit})`,
        width: chartWidth(),
        height: 150,
        legend: { show: false },
        series: [{}, { label: title, stroke: "#2f6fdf", width: 1.5, spanGaps: false }],
        axes: [{}, { size: 46 }],
      };
      charts.set(key, new window.uPlot(options, data, holder));
    }
  }
  for (const [key, chart] of charts) {
    if (!seen.has(key)) {
      chart.destroy();
      charts.delete(key);
    }
  }
  box.setAttribute("data-charted-gpus", String(answer.gpus.length));
}

async function refresh() {
  try {
    await Promise.all([loadNode(), loadReadiness(), loadServing(), loadCredentials(), loadAudit()]);
    show(null);
  } catch (error) {
    show(error);
  }
}

async function action(call) {
  try {
    await call();
    show(null);
  } catch (error) {
    show(error);
  }
  await refresh();
}

// A destructive button asks for a second click instead of a browser dialog.
function armed(button, label, call) {
  const original = button.textContent;
  let armedUntil = 0;
  button.addEventListener("click", async () => {
    if (performance.now() > armedUntil) {
      armedUntil = performance.now() + 5000;
      button.textContent = label;
      window.setTimeout(() => (button.textContent = original), 5000);
      return;
    }
    armedUntil = 0;
    button.textContent = original;
    await action(call);
  });
}

$("cordon").addEventListener("click", () => action(() => api("POST", `${base}/cordon`)));
$("accept-hardware").addEventListener("click", () =>
  action(() => api("POST", `${base}/accept-hardware`, { digest: pendingDigest })),
);
$("uncordon").addEventListener("click", () => action(() => api("POST", `${base}/uncordon`)));
armed($("revoke-credential"), "Click again to revoke for good", () => api("DELETE", `${base}/credential`));
$("decommission-preview").addEventListener("click", () =>
  action(async () => {
    preview = await api("POST", `${base}/decommission/preview`);
    const effects = preview.effects;
    $("decommission-effects").replaceChildren(
      el("li", { text: `revoke ${effects.credentials_revoked.length} credential(s): ${effects.credentials_revoked.join(", ") || "none"}` }),
      el("li", { text: `return ${effects.leases_returned.length} lease(s)` }),
      el("li", { text: `retire identity ${effects.identity_retired || "(none)"}` }),
      el("li", { text: `free hostname ${effects.hostname_freed}` }),
      el("li", { text: `confirmation valid until ${when(preview.expires_at)}` }),
    );
    $("decommission").hidden = false;
  }),
);
$("decommission-execute").addEventListener("click", () =>
  action(async () => {
    if (!preview) return;
    const confirmation = preview.confirmation;
    preview = null;
    $("decommission").hidden = true;
    await api("POST", `${base}/decommission/execute`, { confirmation });
  }),
);
$("decommission-cancel").addEventListener("click", () => {
  preview = null;
  $("decommission").hidden = true;
});

refresh();
loadTelemetry().catch(show);
window.setInterval(refresh, 10000);
window.setInterval(() => loadTelemetry().catch(show), 30000);
