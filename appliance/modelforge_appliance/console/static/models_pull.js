// The Models page's "Pull from a hub" form and the pulls the control plane runs. A pull is
// started with the same POST /api/v1/admin/models call as automation (a hub source); what the
// hub refuses before a byte moves is shown at once, with its next step. While a pull
// downloads, GET /api/v1/admin/model-pulls is read every FAST_SECONDS for its bar; when one
// finishes, the page's models are listed again (onDone).
import { api, el, errorText, setText, when } from "./console.js";

export const FAST_SECONDS = 1.5;
const $ = (id) => document.getElementById(id);
const rows = new Map(); // pull_id -> { node, shown }
let timer = null;
const finished = new Set();

function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = n || 0;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return unit === 0 ? `${n || 0} B` : `${value.toFixed(value >= 100 ? 0 : 1)} ${units[unit]}`;
}

export function patterns(text) {
  return String(text || "")
    .split(",")
    .map((part) => part.trim())
    .filter(Boolean);
}

// "ORG/REPO[@REV]" or "hf://ORG/REPO[@REV]": the API takes both as source.repo.
export function repoOf(text) {
  const value = String(text || "").trim();
  return value.startsWith("hf://") ? value : `hf://${value}`;
}

function pullRow(pull) {
  const total = pull.bytes_total || 0;
  const done = Math.min(pull.bytes_done || 0, total);
  const percent = total ? Math.floor((done / total) * 100) : 100;
  const error = pull.error;
  return el(
    "div",
    { class: "pull-row", "data-testid": "pull-row", "data-pull-id": pull.pull_id, "data-state": pull.state, "data-name": pull.name },
    el("strong", { text: pull.name }),
    " ",
    el("span", { class: `badge pull-${pull.state}`, "data-testid": "pull-state", text: pull.state }),
    " ",
    el("code", { "data-testid": "pull-source", text: pull.source }),
    el(
      "div",
      {},
      el("progress", { max: total || 1, value: total ? done : 1, "data-testid": "pull-progress", "data-bytes-done": done, "data-bytes-total": total }),
      el("span", { class: "muted", text: ` ${bytes(done)} of ${bytes(total)} (${percent} %) · ${pull.files.length} file${pull.files.length === 1 ? "" : "s"} · started ${when(pull.started_at)}` }),
    ),
    error
      ? el(
          "p",
          { class: "error", "data-testid": "pull-error-row", "data-code": error.code },
          el("strong", { text: error.code }),
          ` ${error.message || ""}${error.next_step ? ` — ${error.next_step}` : ""}`,
        )
      : "",
  );
}

function show(pulls) {
  const list = $("pull-list");
  const seen = new Set();
  for (const pull of pulls) {
    seen.add(pull.pull_id);
    const shown = JSON.stringify([pull.state, pull.bytes_done, pull.error]);
    const existing = rows.get(pull.pull_id);
    if (existing && existing.shown === shown) continue;
    const node = pullRow(pull);
    if (existing) existing.node.replaceWith(node);
    else list.append(node);
    rows.set(pull.pull_id, { node, shown });
  }
  for (const [id, row] of rows) {
    if (!seen.has(id)) {
      row.node.remove();
      rows.delete(id);
    }
  }
}

async function refresh(onDone) {
  timer = null;
  try {
    const answer = await api("GET", "/admin/model-pulls");
    show(answer.pulls);
    const newlyDone = answer.pulls.filter((p) => p.state === "done" && !finished.has(p.pull_id));
    for (const pull of answer.pulls) if (pull.state !== "downloading") finished.add(pull.pull_id);
    if (newlyDone.length) await onDone();
    if (answer.pulls.some((p) => p.state === "downloading")) schedule(onDone);
  } catch (error) {
    setText($("pull-error"), `Could not read the pulls: ${errorText(error)}`);
  }
}

function schedule(onDone) {
  if (timer === null) timer = window.setTimeout(() => refresh(onDone), FAST_SECONDS * 1000);
}

export function startPulls(onDone) {
  const form = $("pull-form");
  if (!form) return;
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    setText($("pull-error"), "");
    const submit = form.querySelector("button[type=submit]");
    const data = new FormData(form);
    const source = { hub: "huggingface", repo: repoOf(data.get("repo")) };
    const include = patterns(data.get("include"));
    const exclude = patterns(data.get("exclude"));
    if (include.length) source.include = include;
    if (exclude.length) source.exclude = exclude;
    submit.disabled = true;
    try {
      await api("POST", "/admin/models", { name: String(data.get("name") || "").trim(), source });
      form.reset();
      await refresh(onDone);
    } catch (error) {
      setText($("pull-error"), errorText(error));
    } finally {
      submit.disabled = false;
    }
  });
  // Pulls already running (started elsewhere, or before this page was opened).
  api("GET", "/admin/model-pulls")
    .then((answer) => {
      for (const pull of answer.pulls) if (pull.state !== "downloading") finished.add(pull.pull_id);
      show(answer.pulls);
      if (answer.pulls.some((p) => p.state === "downloading")) schedule(onDone);
    })
    .catch((error) => setText($("pull-error"), `Could not read the pulls: ${errorText(error)}`));
}
