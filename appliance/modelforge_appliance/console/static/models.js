// The Models page: each imported model (its latest revision) with one replica row per node.
// While any replica moves (pending, downloading, removing) its replicas are fetched again every
// FAST_SECONDS, so a download's bar moves; once none moves, only the slow refresh remains.
// Everything goes through the same /api/v1/admin/models calls as the CLI and automation.
import { api, el, errorText, setText, when } from "./console.js";
import { startPulls } from "./models_pull.js";

export const FAST_SECONDS = 1.5;
export const SLOW_SECONDS = 15;
const MOVING = new Set(["pending", "downloading", "removing"]);
const $ = (id) => document.getElementById(id);
const list = $("model-list");
const cards = new Map(); // model name -> card
let fastTimer = null;

export function bytes(n) {
  if (n === null || n === undefined) return "?";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = n;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return unit === 0 ? `${n} B` : `${value.toFixed(value >= 100 ? 0 : 1)} ${units[unit]}`;
}

function shortDigest(digest) {
  const [algorithm, hex] = String(digest).split(":");
  return hex ? `${algorithm}:${hex.slice(0, 12)}…` : String(digest);
}

const modelPath = (name) => `/admin/models/${encodeURIComponent(name)}`;

function digestBox(digest) {
  const code = el("code", { title: digest, "data-testid": "model-digest", "data-digest": digest, text: shortDigest(digest) });
  const copy = el("button", { type: "button", class: "link", "data-testid": "model-copy-digest", text: "copy" });
  copy.addEventListener("click", async () => {
    try {
      await navigator.clipboard.writeText(digest);
      setText(copy, "copied");
    } catch {
      setText(code, digest); // no clipboard (plain http elsewhere than localhost): show it whole to select
    }
    window.setTimeout(() => setText(copy, "copy"), 2000);
  });
  return el("span", { class: "digest" }, code, " ", copy);
}

function fileCount(model) {
  const files = model.files;
  const count = model.file_count ?? (Array.isArray(files) ? files.length : files);
  return count === undefined || count === null ? "" : ` · ${count} file${count === 1 ? "" : "s"}`;
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

function makeCard(model) {
  const card = {
    name: model.name,
    model,
    rows: new Map(), // `${node_id}/${revision}` -> row
    replicas: [],
    head: el("div", { class: "model-head" }),
    body: el("tbody", { "data-testid": "replica-rows" }),
    none: el("p", { class: "muted", "data-testid": "replicas-none", text: "On no node yet: replicate it to the nodes that should hold it." }),
    error: el("p", { class: "error", role: "alert", "data-testid": "model-error" }),
    picker: el("fieldset", { class: "picker", "data-testid": "replicate-picker", hidden: true }),
  };
  const open = el("button", { type: "button", "data-testid": "replicate-open", text: "Replicate…" });
  open.addEventListener("click", () => openPicker(card));
  card.root = el(
    "section",
    { class: "card model", "data-testid": "model-card", "data-model": model.name },
    card.head,
    el("div", { class: "actions" }, open),
    card.picker,
    card.error,
    el(
      "table",
      { class: "small" },
      el("thead", {}, el("tr", {}, ...["Node", "Revision", "State", "Progress", "Error", "Updated", ""].map((h) => el("th", { text: h })))),
      card.body,
    ),
    card.none,
  );
  return card;
}

function showHead(card) {
  const model = card.model;
  const revisions = model.revision_count || model.revisions;
  const others = typeof revisions === "number" && revisions > 1 ? ` (latest of ${revisions})` : "";
  card.head.replaceChildren(
    el("h2", { "data-testid": "model-name", text: model.name }),
    el(
      "p",
      { class: "facts-line" },
      "revision ",
      el("strong", { "data-testid": "model-revision", text: model.revision }),
      others,
      " · ",
      digestBox(model.digest),
      " · ",
      el("span", { "data-testid": "model-size", "data-bytes": model.size_bytes, text: bytes(model.size_bytes) }),
      fileCount(model),
      model.created_at ? ` · imported ${when(model.created_at)}` : "",
    ),
  );
}

function progressCell(replica) {
  const total = replica.bytes_total;
  if (!total || replica.state === "pending" || replica.state === "removing") return el("td", { class: "muted", text: "—" });
  const done = Math.min(replica.bytes_done || 0, total);
  const percent = Math.floor((done / total) * 100);
  return el(
    "td",
    { class: "progress-cell" },
    el("progress", { max: total, value: done, "data-testid": "replica-progress", "data-bytes-done": done, "data-bytes-total": total }),
    el("span", { class: "muted", text: ` ${bytes(done)} of ${bytes(total)} (${percent} %)` }),
  );
}

function errorCell(replica) {
  const error = replica.error;
  if (!error) return el("td", { text: "" });
  return el("td", { "data-testid": "replica-error", "data-code": error.code }, el("strong", { text: error.code }), ` ${error.message || ""}`);
}

function replicaRow(card, replica) {
  const name = replica.display_name || replica.node_id;
  const remove = el("button", { type: "button", class: "danger", "data-testid": "replica-remove", text: "Remove", disabled: replica.state === "removing" });
  armed(remove, "Click again to remove", () => removeReplica(card, replica));
  return el(
    "tr",
    { "data-testid": "replica-row", "data-node-id": replica.node_id, "data-revision": replica.revision, "data-state": replica.state },
    el("td", {}, el("a", { href: `/console/nodes/${encodeURIComponent(replica.node_id)}`, text: name })),
    el("td", { text: replica.revision }),
    el("td", {}, el("span", { class: `badge replica-${replica.state}`, "data-testid": "replica-state", text: replica.state })),
    progressCell(replica),
    errorCell(replica),
    el("td", { text: when(replica.updated_at) }),
    el("td", {}, remove),
  );
}

// Rows are replaced only when what they show changed, so an armed Remove stays armed.
function showReplicas(card, replicas) {
  card.replicas = replicas;
  const seen = new Set();
  for (const replica of replicas) {
    const key = `${replica.node_id}/${replica.revision}`;
    seen.add(key);
    const shown = JSON.stringify([replica.state, replica.bytes_done, replica.bytes_total, replica.error, replica.display_name, replica.updated_at]);
    const existing = card.rows.get(key);
    if (existing && existing.shown === shown) continue;
    const tr = replicaRow(card, replica);
    if (existing) existing.tr.replaceWith(tr);
    else card.body.append(tr);
    card.rows.set(key, { tr, shown });
  }
  for (const [key, row] of card.rows) {
    if (!seen.has(key)) {
      row.tr.remove();
      card.rows.delete(key);
    }
  }
  card.none.hidden = replicas.length > 0;
}

async function loadReplicas(card) {
  const answer = await api("GET", `${modelPath(card.name)}/replicas`);
  showReplicas(card, answer.replicas);
}

async function removeReplica(card, replica) {
  setText(card.error, "");
  try {
    const query = replica.revision ? `?revision=${encodeURIComponent(replica.revision)}` : "";
    await api("DELETE", `${modelPath(card.name)}/replicas/${encodeURIComponent(replica.node_id)}${query}`);
  } catch (error) {
    setText(card.error, errorText(error));
  }
  await refreshReplicas();
}

// The node choices: online nodes can be chosen; every other one is shown, disabled, with its
// liveness, as is a node that already holds (or is fetching) this revision.
async function openPicker(card) {
  setText(card.error, "");
  const picker = card.picker;
  try {
    const fleet = await api("GET", "/admin/hardware/nodes");
    const holding = new Map(card.replicas.filter((r) => r.revision === card.model.revision).map((r) => [r.node_id, r.state]));
    const choices = fleet.nodes.map((node) => {
      const held = holding.get(node.node_id);
      const eligible = node.liveness === "online" && (!held || held === "failed" || held === "removing");
      const why = node.liveness !== "online" ? node.liveness : held && !eligible ? `already ${held}` : "";
      const box = el("input", { type: "checkbox", value: node.node_id, "data-testid": "replicate-node", "data-node-id": node.node_id, disabled: !eligible });
      return el(
        "label",
        { class: `choice${eligible ? "" : " muted"}`, "data-liveness": node.liveness },
        box,
        ` ${node.display_name} (${node.hostname})`,
        why ? el("span", { class: "muted", "data-testid": "replicate-node-why", text: ` — ${why}` }) : "",
      );
    });
    const submit = el("button", { type: "button", "data-testid": "replicate-submit", text: `Replicate ${card.model.revision}` });
    const cancel = el("button", { type: "button", class: "link", "data-testid": "replicate-cancel", text: "Cancel" });
    const problem = el("p", { class: "error", role: "alert", "data-testid": "replicate-error" });
    submit.addEventListener("click", async () => {
      const chosen = [...picker.querySelectorAll("input:checked")].map((box) => box.value);
      if (!chosen.length) return setText(problem, "Choose at least one node.");
      submit.disabled = true;
      try {
        await api("POST", `${modelPath(card.name)}/replicas`, { node_ids: chosen, revision: card.model.revision });
        picker.hidden = true;
        await refreshReplicas();
      } catch (error) {
        setText(problem, errorText(error));
      } finally {
        submit.disabled = false;
      }
    });
    cancel.addEventListener("click", () => (picker.hidden = true));
    picker.replaceChildren(
      el("legend", { text: `Replicate ${card.name} ${card.model.revision} to` }),
      ...(choices.length ? choices : [el("p", { class: "muted", text: "No node is enrolled." })]),
      el("div", { class: "actions" }, submit, cancel),
      problem,
    );
    picker.hidden = false;
  } catch (error) {
    setText(card.error, errorText(error));
  }
}

function moving() {
  return [...cards.values()].some((card) => card.replicas.some((r) => MOVING.has(r.state)));
}

// Poll fast while something moves, and stop as soon as nothing does.
function schedule() {
  const fast = moving();
  list.setAttribute("data-polling", fast ? "fast" : "idle");
  if (fast && fastTimer === null) {
    fastTimer = window.setTimeout(() => {
      fastTimer = null;
      refreshReplicas();
    }, FAST_SECONDS * 1000);
  }
}

let busy = false;
let again = false; // asked while a refresh was in flight: its answer may predate the change

async function refreshReplicas() {
  if (busy) {
    again = true;
    return;
  }
  busy = true;
  try {
    do {
      again = false;
      await Promise.all([...cards.values()].map(loadReplicas));
    } while (again);
    setText($("models-error"), "");
  } catch (error) {
    setText($("models-error"), `Could not refresh: ${errorText(error)}`);
  } finally {
    busy = false;
    schedule();
  }
}

async function refreshModels() {
  try {
    const answer = await api("GET", "/admin/models");
    const names = new Set(answer.models.map((m) => m.name));
    for (const model of answer.models) {
      let card = cards.get(model.name);
      if (!card) {
        card = makeCard(model);
        cards.set(model.name, card);
        list.append(card.root);
      }
      card.model = model;
      showHead(card);
    }
    for (const [name, card] of cards) {
      if (!names.has(name)) {
        card.root.remove();
        cards.delete(name);
      }
    }
    $("models-empty").hidden = cards.size > 0;
    const count = cards.size;
    setText($("models-status"), count ? `${count} model${count === 1 ? "" : "s"} · replicas refreshed every ${FAST_SECONDS} s while one moves` : "");
    setText($("models-error"), "");
  } catch (error) {
    setText($("models-error"), `Could not load the models: ${errorText(error)}`);
  }
  await refreshReplicas();
}

refreshModels();
window.setInterval(refreshModels, SLOW_SECONDS * 1000);
startPulls(refreshModels);
