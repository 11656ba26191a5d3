// The Deployments page: each deployment with one row per server (one per member node), its
// state, why (the last error), since when, restarts and, backing off, its next attempt; a
// node can be added (chosen among the nodes that are not members) and a member removed.
// While any server moves (pending, starting, stopping) the list is fetched again every
// FAST_SECONDS, so a server's state follows its agent's reports; once none moves, only the
// slow refresh remains. Everything goes through the same /api/v1/admin/deployments calls as
// the CLI and automation; what a node reported (an error's message) is shown as text only.
import { age, api, el, errorText, setText, when } from "./console.js";

export const FAST_SECONDS = 1.5;
export const SLOW_SECONDS = 15;
const MOVING = new Set(["pending", "starting", "stopping"]);
const $ = (id) => document.getElementById(id);
const list = $("deployment-list");
const cards = new Map(); // deployment name -> card
let fastTimer = null;

const deploymentPath = (name) => `/admin/deployments/${encodeURIComponent(name)}`;

// A GPU by the start of its UUID (GPU-1a2b3c4d…), the whole UUID on hover.
export function shortUuid(uuid) {
  const text = String(uuid);
  return text.length > 12 ? `${text.slice(0, 12)}…` : text;
}

// A destructive button asks for a second click instead of a browser dialog (as on a node page).
function armed(button, label, call) {
  const original = button.textContent;
  let armedUntil = 0;
  button.addEventListener("click", async () => {
    if (performance.now() > armedUntil) {
      armedUntil = performance.now() + 5000;
      button.textContent = label;
      button.setAttribute("data-armed", "");
      window.setTimeout(() => {
        button.textContent = original;
        button.removeAttribute("data-armed");
      }, 5000);
      return;
    }
    armedUntil = 0;
    button.textContent = original;
    button.removeAttribute("data-armed");
    await call();
  });
}

// How a client calls a deployment: the OpenAI-compatible base URL on this control plane's
// port, the deployment's name as `model`, and an API key (docs/clients.md).
export function clientCall(name, origin) {
  const base = `${origin}/v1`;
  const body = JSON.stringify({ model: name, messages: [{ role: "user", content: "Hello" }] });
  const curl =
    `curl ${base}/chat/completions -H "Authorization: Bearer $MODELFORGE_API_KEY" ` +
    `-H "Content-Type: application/json" -d '${body.replaceAll("'", "'\\''")}'`;
  return { base, curl };
}

function clientDetails(name) {
  const origin = $("deployments").dataset.apiOrigin || window.location.origin;
  const call = clientCall(name, origin);
  return el(
    "details",
    { class: "client-call", "data-testid": "deployment-client" },
    el("summary", { text: "How a client calls it" }),
    el(
      "p",
      {},
      "Base URL ",
      el("code", { "data-testid": "client-base-url", text: call.base }),
      ", model ",
      el("code", { "data-testid": "client-model", text: name }),
      ", and an API key (",
      el("code", { text: "modelforge api-keys create --name NAME" }),
      "); any OpenAI-compatible client works. docs/clients.md says what each refusal means.",
    ),
    el("pre", { class: "command", "data-testid": "client-curl", text: call.curl }),
  );
}

function makeCard(deployment) {
  const card = {
    name: deployment.name,
    deployment,
    rows: new Map(), // server_id -> {tr, shown, remove}
    head: el("div", { class: "deployment-head" }),
    body: el("tbody", { "data-testid": "server-rows" }),
    error: el("p", { class: "error", role: "alert", "data-testid": "deployment-error" }),
    stop: el("button", { type: "button", class: "danger", "data-testid": "deployment-stop", text: "Stop" }),
    restart: el("button", { type: "button", "data-testid": "deployment-restart", text: "Restart" }),
    add: el("button", { type: "button", "data-testid": "deployment-add-node", text: "Add node…" }),
    picker: el("fieldset", { class: "picker", "data-testid": "add-node-picker", hidden: true }),
  };
  armed(card.stop, "Click again to stop every server", () => act(card, "DELETE", deploymentPath(card.name)));
  card.restart.addEventListener("click", () => act(card, "POST", `${deploymentPath(card.name)}/restart`));
  card.add.addEventListener("click", () => openPicker(card));
  card.root = el(
    "section",
    { class: "card deployment", "data-testid": "deployment-card", "data-deployment": deployment.name },
    card.head,
    clientDetails(deployment.name),
    el("div", { class: "actions" }, card.restart, card.add, card.stop),
    card.picker,
    card.error,
    el(
      "table",
      { class: "small" },
      el("thead", {}, el("tr", {}, ...["Node", "State", "Since", "GPUs", "Restarts", "Next attempt", "Why", ""].map((h) => el("th", { text: h })))),
      card.body,
    ),
  );
  return card;
}

// The choices: nodes that are not members; only an online, uncordoned one can be chosen
// (the others are listed, disabled, saying why). The control plane checks the rest: the
// runtime, the model's presence (or "replicate first") and free GPUs, and says what it lacks.
async function openPicker(card) {
  setText(card.error, "");
  const picker = card.picker;
  try {
    const fleet = await api("GET", "/admin/hardware/nodes");
    const members = new Set(card.deployment.servers.map((s) => s.node_id));
    const others = fleet.nodes.filter((node) => !members.has(node.node_id) && node.liveness !== "decommissioned");
    const select = el("select", { "data-testid": "add-node-select", class: "narrow-select" });
    for (const node of others) {
      const why = node.liveness !== "online" ? node.liveness : node.cordoned ? "cordoned" : "";
      const label = `${node.display_name} (${node.hostname})${why ? ` — ${why}` : ""}`;
      select.append(el("option", { value: node.node_id, disabled: Boolean(why), text: label }));
    }
    const firstChoice = [...select.options].find((option) => !option.disabled);
    if (firstChoice) firstChoice.selected = true;
    const replicate = el("input", { type: "checkbox", "data-testid": "add-node-replicate" });
    const submit = el("button", { type: "button", "data-testid": "add-node-submit", text: "Add", disabled: !firstChoice });
    const cancel = el("button", { type: "button", class: "link", "data-testid": "add-node-cancel", text: "Cancel" });
    const problem = el("p", { class: "error", role: "alert", "data-testid": "add-node-error" });
    submit.addEventListener("click", async () => {
      if (!select.value) return setText(problem, "Choose a node.");
      submit.disabled = true;
      try {
        const view = await api("POST", `${deploymentPath(card.name)}/servers`, { node_ids: [select.value], replicate: replicate.checked });
        picker.hidden = true;
        if (view && view.name === card.name) show([view], false);
        await refresh();
      } catch (error) {
        setText(problem, errorText(error));
      } finally {
        submit.disabled = false;
      }
    });
    cancel.addEventListener("click", () => (picker.hidden = true));
    picker.replaceChildren(
      el("legend", { text: `Add a node to ${card.name}` }),
      ...(others.length
        ? [
            select,
            el("label", { class: "choice" }, replicate, " Replicate the model to it first if it lacks it"),
          ]
        : [el("p", { class: "muted", "data-testid": "add-node-none", text: "Every enrolled node is a member already." })]),
      el("div", { class: "actions" }, submit, cancel),
      problem,
    );
    picker.hidden = false;
  } catch (error) {
    setText(card.error, errorText(error));
  }
}

function settingsText(deployment) {
  const settings = deployment.settings || {};
  const parts = [];
  if (settings.context_length) parts.push(`context ${settings.context_length}`);
  if (settings.args && settings.args.length) parts.push(`args ${settings.args.join(" ")}`);
  if (settings.image_id) parts.push(`image ${shortUuid(settings.image_id)}`);
  if (settings.split && settings.split.length) parts.push(`split across ${settings.split.length} nodes`);
  return parts.length ? ` · ${parts.join(" · ")}` : "";
}

// A split's member: its role and its part of the layers (settings.shares, in split order).
function roleText(deployment, server) {
  if (!server.role) return "";
  const settings = deployment.settings || {};
  const index = (settings.split || []).indexOf(server.node_id);
  const share = index >= 0 && settings.shares ? settings.shares[index] : null;
  return ` (${server.role}${share === null || share === undefined ? "" : `, ${Math.round(share * 100)}% of the layers`})`;
}

// Unset, a server gets one GPU on a node that has any and none elsewhere (the rows say which).
function gpuText(deployment) {
  const count = deployment.gpu_count;
  const shared = deployment.share_gpus ? " (shared)" : "";
  if (count === null || count === undefined) return shared ? ` · GPUs${shared}` : "";
  if (count === 0) return " · no GPUs";
  return ` · ${count} GPU${count === 1 ? "" : "s"} per server${shared}`;
}

function showHead(card) {
  const d = card.deployment;
  card.root.setAttribute("data-state", d.state);
  card.head.replaceChildren(
    el("h2", {}, el("span", { "data-testid": "deployment-name", text: d.name }), " ", el("span", { class: `badge deployment-${d.state}`, "data-testid": "deployment-state", text: d.state })),
    el(
      "p",
      { class: "facts-line" },
      el("strong", { "data-testid": "deployment-model", title: d.digest || "", text: `${d.model}@${d.revision}` }),
      " · ",
      el("span", { "data-testid": "deployment-runtime", text: d.runtime }),
      gpuText(d),
      settingsText(d),
      d.created_at ? ` · deployed ${when(d.created_at)}` : "",
      d.created_by ? ` by ${d.created_by}` : "",
    ),
  );
  // Stopping what is stopped asks nothing; a stopping deployment is on its way already.
  const settled = d.state === "stopped" || d.state === "stopping";
  card.stop.disabled = settled;
  card.restart.disabled = d.state === "stopping";
  card.add.disabled = settled;
  if (settled) card.picker.hidden = true;
}

function sinceText(server, now) {
  return server.state_since ? age((now - Date.parse(server.state_since)) / 1000) : "—";
}

function sinceCell(server, now) {
  if (!server.state_since) return el("td", { class: "muted", text: "—" });
  return el("td", {}, el("span", { class: "since", "data-testid": "server-since", "data-since": server.state_since, title: when(server.state_since), text: sinceText(server, now) }));
}

function gpusCell(server) {
  const gpus = server.gpus || [];
  if (!gpus.length) return el("td", { class: "muted", "data-testid": "server-gpus", "data-gpus": "", text: "none" });
  return el("td", { "data-testid": "server-gpus", "data-gpus": gpus.join(",") }, ...gpus.map((uuid) => el("code", { class: "gpu", title: uuid, text: shortUuid(uuid) })));
}

function errorCell(server) {
  const error = server.error;
  if (!error) return el("td", { text: "" });
  return el("td", { "data-testid": "server-error", "data-code": error.code }, el("strong", { text: error.code }), ` ${error.message || ""}`);
}

// "in 8 s" (or "now" once it is due) for a backing-off server; empty otherwise.
function nextAttemptText(server, now) {
  if (server.state !== "backoff" || !server.next_attempt_at) return "";
  const seconds = Math.round((Date.parse(server.next_attempt_at) - now) / 1000);
  if (seconds <= 0) return "now";
  return seconds < 90 ? `in ${seconds} s` : `in ${Math.round(seconds / 60)} min`;
}

function nextAttemptCell(server, now) {
  const text = nextAttemptText(server, now);
  if (!text) return el("td", { class: "muted", text: "" });
  return el("td", {}, el("span", { class: "since", "data-testid": "server-next-attempt", "data-at": server.next_attempt_at, title: when(server.next_attempt_at), text }));
}

function stateCell(server) {
  const badge = el("span", { class: `badge server-${server.state}`, "data-testid": "server-state", text: server.state });
  const note = server.goal === "remove" ? "leaving" : server.state === "idle" ? "unloaded" : "";
  return el("td", {}, badge, note ? el("span", { class: "muted", "data-testid": "server-note", text: ` ${note}` }) : "");
}

// Remove asks for a second click; the button outlives the row's redraws, so a refresh
// between the two clicks does not disarm it.
function removeButton(card, server) {
  const name = server.display_name || server.node_id;
  const button = el("button", { type: "button", class: "danger", "data-testid": "server-remove", text: "Remove" });
  armed(button, `Click again to remove ${name}`, () => act(card, "DELETE", `${deploymentPath(card.name)}/servers/${encodeURIComponent(server.node_id)}`));
  return button;
}

function serverRow(server, now, remove, card) {
  const name = server.display_name || server.node_id;
  remove.disabled = server.goal === "remove" || card.deployment.state === "stopping" || card.deployment.state === "stopped";
  return el(
    "tr",
    { "data-testid": "server-row", "data-server-id": server.server_id, "data-node-id": server.node_id, "data-state": server.state },
    el(
      "td",
      {},
      el("a", { href: `/console/nodes/${encodeURIComponent(server.node_id)}`, "data-testid": "server-node", text: name }),
      server.role ? el("span", { class: "muted", "data-testid": "server-role", text: roleText(card.deployment, server) }) : "",
    ),
    stateCell(server),
    sinceCell(server, now),
    gpusCell(server),
    el("td", { "data-testid": "server-restarts", text: String(server.restarts ?? 0) }),
    nextAttemptCell(server, now),
    errorCell(server),
    el("td", {}, remove),
  );
}

// Rows are replaced only when what they show changed (the ages among it).
function showServers(card, now) {
  const seen = new Set();
  for (const server of card.deployment.servers) {
    seen.add(server.server_id);
    const shown = JSON.stringify([server.state, server.goal, card.deployment.state, server.state_since, sinceText(server, now), nextAttemptText(server, now), server.display_name, server.gpus, server.restarts, server.error, server.role]);
    const existing = card.rows.get(server.server_id);
    if (existing && existing.shown === shown) continue;
    const remove = existing ? existing.remove : removeButton(card, server);
    const tr = serverRow(server, now, remove, card);
    if (existing) existing.tr.replaceWith(tr);
    else card.body.append(tr);
    card.rows.set(server.server_id, { tr, shown, remove });
  }
  for (const [id, row] of card.rows) {
    if (!seen.has(id)) {
      row.tr.remove();
      card.rows.delete(id);
    }
  }
}

async function act(card, method, path) {
  setText(card.error, "");
  card.stop.disabled = card.restart.disabled = card.add.disabled = true;
  try {
    const view = await api(method, path);
    if (view && view.name === card.name) show([view], false);
  } catch (error) {
    setText(card.error, errorText(error));
  }
  await refresh();
}

function moving() {
  return [...cards.values()].some((card) => card.deployment.servers.some((s) => MOVING.has(s.state)));
}

// Poll fast while a server moves, and stop as soon as none does.
function schedule() {
  const fast = moving();
  list.setAttribute("data-polling", fast ? "fast" : "idle");
  if (fast && fastTimer === null) {
    fastTimer = window.setTimeout(() => {
      fastTimer = null;
      refresh();
    }, FAST_SECONDS * 1000);
  }
}

// ``whole``: the answer lists every deployment (cards missing from it go).
function show(deployments, whole, now = Date.now()) {
  const names = new Set(deployments.map((d) => d.name));
  for (const deployment of deployments) {
    let card = cards.get(deployment.name);
    if (!card) {
      card = makeCard(deployment);
      cards.set(deployment.name, card);
      list.append(card.root);
    }
    card.deployment = deployment;
    showHead(card);
    showServers(card, now);
  }
  if (!whole) return;
  for (const [name, card] of cards) {
    if (!names.has(name)) {
      card.root.remove();
      cards.delete(name);
    }
  }
  $("deployments-empty").hidden = cards.size > 0;
  const count = cards.size;
  setText($("deployments-status"), count ? `${count} deployment${count === 1 ? "" : "s"} · refreshed every ${FAST_SECONDS} s while a server starts or stops` : "");
}

let busy = false;
let again = false; // asked while a refresh was in flight: its answer may predate the change

async function refresh() {
  if (busy) {
    again = true;
    return;
  }
  busy = true;
  try {
    do {
      again = false;
      const answer = await api("GET", "/admin/deployments");
      // Ages on the control plane's clock when it says what time it is.
      const now = answer.server_time ? Date.parse(answer.server_time) : Date.now();
      show(answer.deployments, true, now);
    } while (again);
    setText($("deployments-error"), "");
  } catch (error) {
    setText($("deployments-error"), `Could not load the deployments: ${errorText(error)}`);
  } finally {
    busy = false;
    schedule();
  }
}

refresh();
window.setInterval(refresh, SLOW_SECONDS * 1000);
