// A work item's page: its facts, input (env names only, never their values), constraints,
// result, error and log tail, refreshed until it has finished; Cancel while it can be.
import { api, el, errorText, keyValues, setText, when } from "./console.js";

const $ = (id) => document.getElementById(id);
const workId = $("work-item").getAttribute("data-work-id");
const path = `/admin/work/${encodeURIComponent(workId)}`;
const CANCELLABLE = new Set(["queued", "leased"]);
const FINISHED = new Set(["succeeded", "failed", "cancelled"]);
let timer = null;

function show(error) {
  setText($("item-error"), error ? errorText(error) : "");
}

function fact(term, value) {
  return [el("dt", { text: term }), el("dd", {}, value)];
}

// An env's values may be secrets: only its names are ever put on the page.
function withoutEnvValues(input) {
  if (!input || !input.env || typeof input.env !== "object") return input;
  const { env, ...rest } = input;
  return { ...rest, "env (names only)": Object.keys(env).sort() };
}

function render(item) {
  const badge = $("item-state");
  badge.className = `badge state-${item.state}`;
  setText(badge, item.state);
  const node = item.node_id
    ? el("a", { href: `/console/nodes/${encodeURIComponent(item.node_id)}`, text: item.node_id })
    : "—";
  $("item-facts").replaceChildren(
    ...fact("Capability", item.capability),
    ...fact("Node", node),
    ...fact("Attempts", `${item.attempts} of ${item.max_attempts}`),
    ...fact("Timeout", `${item.timeout_seconds} s`),
    ...fact("Submitted by", item.created_by),
    ...fact("Created", when(item.created_at)),
    ...fact("Started", when(item.started_at)),
    ...fact("Finished", when(item.finished_at)),
    ...(item.lease_expires_at ? fact("Lease expires", when(item.lease_expires_at)) : []),
    ...(item.idempotency_key ? fact("Idempotency key", item.idempotency_key) : []),
    ...(item.error ? fact("Error", `${item.error.code}: ${item.error.message}`) : []),
  );
  $("item-input").replaceChildren(keyValues(withoutEnvValues(item.input), { "data-testid": "item-input-fields" }));
  $("item-constraints").replaceChildren(keyValues(item.constraints));
  $("item-result").replaceChildren(keyValues(item.result));
  setText($("item-log"), item.log_tail || "(no log yet)");
  $("item-cancel").disabled = !CANCELLABLE.has(item.state);
  document.body.setAttribute("data-item-state", item.state);
}

async function refresh() {
  try {
    const item = await api("GET", path);
    render(item);
    show(null);
    if (FINISHED.has(item.state) && timer !== null) {
      window.clearInterval(timer);
      timer = null;
    }
  } catch (error) {
    show(error);
  }
}

$("item-cancel").addEventListener("click", async () => {
  $("item-cancel").disabled = true;
  try {
    render(await api("POST", `${path}/cancel`));
    show(null);
  } catch (error) {
    show(error);
    await refresh();
  }
});

refresh();
timer = window.setInterval(refresh, 3000);
