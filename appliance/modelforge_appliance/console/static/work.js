// The Work page: the queue, refreshed in place every few seconds, and a form that submits a
// smoke to one chosen node. Both go through the same /api/v1/admin/work calls as automation.
import { api, el, errorText, setText, when } from "./console.js";

export const REFRESH_SECONDS = 5;
const LIMIT = 100;
const $ = (id) => document.getElementById(id);
const form = $("smoke-form");
const select = $("smoke-node");
const queued = $("smoke-queued");
const failure = $("smoke-error");
let nodes = new Map(); // node_id -> node, as the node list answered it

function readinessWord(node) {
  return node.readiness.ready ? "READY" : `NOT READY: ${node.readiness.failing[0]}`;
}

async function loadNodes() {
  const fleet = await api("GET", "/admin/hardware/nodes");
  nodes = new Map(fleet.nodes.map((node) => [node.node_id, node]));
  const enrolled = fleet.nodes.filter((node) => node.liveness !== "decommissioned");
  const chosen = select.value;
  select.replaceChildren(
    ...enrolled.map((node) =>
      el("option", { value: node.node_id, text: `${node.display_name} (${node.hostname}) — ${readinessWord(node)}` }),
    ),
  );
  if (enrolled.some((node) => node.node_id === chosen)) select.value = chosen;
  form.hidden = enrolled.length === 0;
  $("smoke-no-nodes").hidden = enrolled.length > 0;
}

function nodeCell(nodeId) {
  if (!nodeId) return el("td", { text: "—" });
  const node = nodes.get(nodeId);
  const link = el("a", { href: `/console/nodes/${encodeURIComponent(nodeId)}`, text: node ? node.display_name : nodeId });
  return el("td", {}, link);
}

function row(item) {
  return el(
    "tr",
    { "data-testid": "work-row", "data-work-id": item.work_id, "data-state": item.state },
    el("td", {}, el("span", { class: `badge state-${item.state}`, text: item.state })),
    el("td", {}, el("a", { href: `/console/work/${encodeURIComponent(item.work_id)}`, text: item.work_id })),
    el("td", { text: item.capability }),
    nodeCell(item.node_id),
    el("td", { text: `${item.attempts} of ${item.max_attempts}` }),
    el("td", { text: when(item.created_at) }),
    el("td", { text: when(item.started_at) }),
    el("td", { text: when(item.finished_at) }),
  );
}

let busy = false;

async function refresh() {
  if (busy) return; // a slow answer is never overtaken by the next tick
  busy = true;
  try {
    const state = $("work-state").value;
    const query = `limit=${LIMIT}${state ? `&state=${encodeURIComponent(state)}` : ""}`;
    const answer = await api("GET", `/admin/work?${query}`);
    $("work-rows").replaceChildren(...answer.work.map(row));
    const count = answer.work.length;
    const more = answer.next_before ? ` (the newest ${LIMIT})` : "";
    const none = state ? `No ${state} work items.` : "No work items yet: submit a smoke above.";
    setText($("work-status"), count ? `${count} item${count === 1 ? "" : "s"}${more} · refreshed every ${REFRESH_SECONDS} s` : none);
  } catch (error) {
    setText($("work-status"), `Could not refresh: ${errorText(error)}`);
  } finally {
    busy = false;
  }
}

form.addEventListener("submit", async (event) => {
  event.preventDefault();
  const nodeId = select.value;
  const button = $("smoke-submit");
  button.disabled = true;
  queued.replaceChildren();
  setText(failure, "");
  try {
    const item = await api("POST", "/admin/work", { capability: "smoke", constraints: { node_ids: [nodeId] } });
    const node = nodes.get(nodeId);
    queued.replaceChildren(
      "Queued ",
      el("a", { href: `/console/work/${encodeURIComponent(item.work_id)}`, "data-testid": "smoke-queued-link", text: item.work_id }),
      ".",
    );
    if (node && !node.readiness.ready) {
      // Readiness and claiming share their conditions but for telemetry, so say what is known.
      queued.append(
        ` The node is ${readinessWord(node)}: the item stays queued until the node can claim it (`,
        el("a", { href: `/console/nodes/${encodeURIComponent(nodeId)}`, text: "its checks" }),
        ").",
      );
    }
    await refresh();
  } catch (error) {
    setText(failure, errorText(error));
  } finally {
    button.disabled = false;
  }
});

$("work-state").addEventListener("change", () => refresh());
loadNodes()
  .catch((error) => setText(failure, `Could not load the nodes: ${errorText(error)}`))
  .then(refresh);
window.setInterval(refresh, REFRESH_SECONDS * 1000);
