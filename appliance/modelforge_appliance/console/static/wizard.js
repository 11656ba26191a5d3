// The Enroll node wizard. The one-time token lives only in this module's memory while the
// wizard is open: never in storage, a cookie, the URL or a server-rendered page. Closing
// the wizard, revoking the token, reaching its expiry, or checking readiness once a node has
// enrolled with it clears it; a check while the enrollment is still pending keeps it.
import { api, el, errorText, setText } from "./console.js";

const $ = (id) => document.getElementById(id);
const dialog = $("enroll");
const tokenBox = $("enroll-token");
const revealButton = $("enroll-reveal");
const copyButton = $("enroll-copy");
const countdown = $("enroll-countdown");
const MASK = "•".repeat(24);

let token = null; // the secret: only here, and in tokenBox while revealed
let enrollment = null; // the mint answer without its token
let expiresAtMs = null; // on the page's monotonic clock, not the wall clock
let timer = null;

function showStep(name) {
  for (const section of dialog.querySelectorAll("[data-step]")) {
    section.hidden = section.getAttribute("data-step") !== name;
  }
  for (const button of dialog.querySelectorAll("[data-step-button]")) {
    button.classList.toggle("current", button.getAttribute("data-step-button") === name);
  }
}

function enableSteps(enabled) {
  for (const button of dialog.querySelectorAll("[data-step-button]")) {
    if (button.getAttribute("data-step-button") !== "mint") button.disabled = !enabled;
  }
}

function clearToken(reason) {
  token = null;
  tokenBox.textContent = "";
  tokenBox.setAttribute("data-cleared", reason);
  revealButton.disabled = true;
  copyButton.disabled = true;
  revealButton.textContent = "Reveal";
  if (timer !== null) {
    window.clearInterval(timer);
    timer = null;
  }
  const notes = {
    closed: "cleared",
    readiness: "cleared from this page (a node enrolled with it)",
    revoked: "revoked",
    expired: "expired",
  };
  setText(countdown, notes[reason] || "cleared");
}

function reset() {
  clearToken("closed");
  enrollment = null;
  expiresAtMs = null;
  for (const id of ["enroll-id", "enroll-expires", "enroll-env", "enroll-start-command", "enroll-worker-command"]) {
    $(id).textContent = "";
  }
  for (const id of ["enroll-more-commands", "manifest-result", "image-commands", "readiness-result", "enroll-error"]) {
    $(id).replaceChildren();
  }
  $("manifest-entry").value = "";
  $("registry-image").value = "";
  $("recreate").hidden = true;
  copyButton.textContent = "Copy";
  $("enroll-submit").disabled = false;
  $("enroll-revoke").disabled = false;
  enableSteps(false);
  showStep("mint");
}

function tick() {
  const left = Math.round((expiresAtMs - performance.now()) / 1000);
  if (left <= 0) {
    clearToken("expired");
    return;
  }
  const minutes = Math.floor(left / 60);
  setText(countdown, `${minutes}:${String(left % 60).padStart(2, "0")} left`);
}

// A key as words, when the answer carries no title for it: "join_commands" → "Join commands".
function words(key) {
  const text = String(key).replace(/_/g, " ");
  return text.charAt(0).toUpperCase() + text.slice(1);
}

// Whatever command fields the mint answer carries (join_commands, …), titled by its
// command_titles: {field: title} or {field: {key: title}}. The start and worker commands
// have places of their own.
function commandBlocks(answer) {
  const titles = answer.command_titles || {};
  const blocks = [];
  const add = (title, text) => {
    if (typeof text === "string" && text) blocks.push([title, text]);
  };
  for (const [key, value] of Object.entries(answer)) {
    if (key === "start_command" || key === "worker_command" || !/_commands?$/.test(key)) continue;
    const own = titles[key];
    const label = typeof own === "string" ? own : words(key);
    const titleOf = (name) => (own && typeof own === "object" && typeof own[name] === "string" ? own[name] : `${label}: ${name}`);
    if (typeof value === "string") add(label, value);
    else if (Array.isArray(value)) {
      value.forEach((item, i) => {
        if (typeof item === "string") add(`${label} ${i + 1}`, item);
        else if (item && typeof item === "object") {
          add(item.title || item.name || item.install_type || `${label} ${i + 1}`, item.command || item.text);
        }
      });
    } else if (value && typeof value === "object") {
      for (const [name, item] of Object.entries(value)) {
        if (typeof item === "string") add(titleOf(name), item);
        else if (item && typeof item === "object") add(item.title || titleOf(name), item.command || item.text);
      }
    }
  }
  return blocks.map(([title, text]) =>
    el("div", { class: "command-block", "data-testid": "enroll-command" }, el("h3", { text: title }), el("pre", { class: "command", text })),
  );
}

async function mint() {
  $("enroll-error").textContent = "";
  const name = $("enroll-name").value.trim();
  const seconds = Number($("enroll-expiry").value);
  $("enroll-submit").disabled = true;
  let answer;
  try {
    // The mode goes into the join commands and the env file the answer carries.
    const accelerator_mode = $("enroll-accelerator").value;
    answer = await api("POST", "/admin/node-enrollments", { display_name: name, expires_in_seconds: seconds, accelerator_mode });
  } catch (error) {
    $("enroll-error").textContent = errorText(error);
    $("enroll-submit").disabled = false;
    return;
  }
  token = answer.token;
  enrollment = { ...answer };
  delete enrollment.token;
  answer = null;
  expiresAtMs = performance.now() + seconds * 1000;
  tokenBox.textContent = MASK;
  tokenBox.removeAttribute("data-cleared");
  revealButton.disabled = false;
  copyButton.disabled = false;
  $("enroll-id").textContent = enrollment.enrollment_id;
  $("enroll-expires").textContent = new Date(Date.now() + seconds * 1000).toLocaleTimeString();
  // The answer's env file and join commands already carry the chosen accelerator mode.
  $("enroll-env").textContent = enrollment.env_file;
  $("enroll-start-command").textContent = enrollment.start_command;
  $("enroll-worker-command").textContent = enrollment.worker_command || "";
  $("enroll-more-commands").replaceChildren(
    ...(enrollment.warnings || []).map((text) => el("p", { class: "warning", "data-testid": "enroll-warning", text: `Warning: ${text}` })),
    ...commandBlocks(enrollment),
  );
  tick();
  timer = window.setInterval(tick, 1000);
  enableSteps(true);
  showStep("settings");
  document.dispatchEvent(new CustomEvent("modelforge:enrolled"));
}

function toggleReveal() {
  if (token === null) return;
  const shown = tokenBox.textContent === token;
  tokenBox.textContent = shown ? MASK : token;
  revealButton.textContent = shown ? "Reveal" : "Hide";
}

async function copyToken() {
  if (token === null) return;
  try {
    await navigator.clipboard.writeText(token);
    setText(copyButton, "Copied");
  } catch {
    setText(copyButton, "Copy failed: reveal and select it");
  }
}

async function revoke() {
  if (!enrollment) return;
  $("enroll-revoke").disabled = true;
  try {
    await api("DELETE", `/admin/node-enrollments/${encodeURIComponent(enrollment.enrollment_id)}`);
    clearToken("revoked");
  } catch (error) {
    $("enroll-revoke").disabled = false;
    $("enroll-more-commands").prepend(el("p", { class: "error", text: errorText(error) }));
  }
}

function problemList(error) {
  const problems = (error.body && error.body.problems) || [];
  if (problems.length === 0) return [el("p", { class: "error", text: errorText(error) })];
  return [
    el("p", { class: "error", text: "Rejected:" }),
    el("ul", {}, ...problems.map((p) => el("li", { "data-field": p.field }, el("code", { text: p.field }), `: ${p.message}`))),
  ];
}

async function checkImage() {
  const result = $("manifest-result");
  const commands = $("image-commands");
  result.replaceChildren();
  commands.replaceChildren();
  // The mode the token was minted with: the worker image, and GPUs reserved or not.
  const accelerator_mode = (enrollment && enrollment.accelerator_mode) || "nvidia";
  let body;
  if ($("image-mode").value === "registry") {
    body = { registry_image: $("registry-image").value.trim(), accelerator_mode };
  } else {
    try {
      body = { entry: JSON.parse($("manifest-entry").value), accelerator_mode };
    } catch (error) {
      result.replaceChildren(el("p", { class: "error", text: `Not JSON: ${error.message}` }));
      return;
    }
    if (!body.entry || typeof body.entry !== "object" || Array.isArray(body.entry)) {
      result.replaceChildren(el("p", { class: "error", text: "Paste the JSON object of the entry." }));
      return;
    }
  }
  let answer;
  try {
    answer = await api("POST", "/admin/node-agent-image/check", body);
  } catch (error) {
    result.replaceChildren(...problemList(error));
    return;
  }
  const ignored = answer.ignored.length ? ` (${answer.ignored.join(", ")} ignored: docker load may rewrite it)` : "";
  result.replaceChildren(
    el("p", { class: "ok", "data-accepted": "true", text: `Accepted ${answer.image}, checked against the ${answer.checked_against}${ignored}.` }),
  );
  commands.replaceChildren(
    ...answer.commands.map((command) =>
      el("div", { class: "command-block" }, el("h3", { text: command.title }), el("pre", { class: "command", "data-command": command.name, text: command.text })),
    ),
  );
}

function renderChecks(readiness) {
  return el(
    "ul",
    { class: "checks" },
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

async function checkReadiness() {
  if (!enrollment) return;
  const out = $("readiness-result");
  out.replaceChildren(el("p", { class: "muted", text: "Checking…" }));
  try {
    const { enrollments } = await api("GET", "/admin/node-enrollments");
    const mine = enrollments.find((e) => e.enrollment_id === enrollment.enrollment_id);
    // The token is needed until a node has enrolled with it: only then is it cleared here.
    // Once revoked or expired it is of no use either.
    if (mine && mine.state !== "pending") clearToken(mine.node_id ? "readiness" : mine.state);
    if (!mine || !mine.node_id) {
      const state = mine ? mine.state : "unknown";
      out.replaceChildren(
        el("p", { "data-enrollment-state": state, text: `The token is ${state}: no node has enrolled with it yet.` }),
        el("p", { class: "next-step", text: state === "pending" ? "Start the agent with the start command, then check again." : "Mint a new token." }),
      );
      return;
    }
    const readiness = await api("GET", `/admin/hardware/nodes/${encodeURIComponent(mine.node_id)}/readiness`);
    out.replaceChildren(
      el(
        "p",
        { "data-node-id": readiness.node_id },
        "Node ",
        el("a", { href: `/console/nodes/${encodeURIComponent(readiness.node_id)}`, text: readiness.node_id }),
        readiness.ready ? " is ready." : " is not ready yet:",
      ),
      renderChecks(readiness),
    );
    $("recreate").hidden = false;
  } catch (error) {
    out.replaceChildren(el("p", { class: "error", text: errorText(error) }));
  }
}

$("enroll-open").addEventListener("click", () => {
  reset();
  dialog.showModal();
  $("enroll-name").focus();
});
$("enroll-close").addEventListener("click", () => {
  reset(); // at once, not only when the close event comes round
  dialog.close();
});
dialog.addEventListener("close", reset); // the Close button, Escape, anything
window.addEventListener("pagehide", () => clearToken("closed"));
$("enroll-submit").addEventListener("click", mint);
revealButton.addEventListener("click", toggleReveal);
copyButton.addEventListener("click", copyToken);
$("enroll-revoke").addEventListener("click", revoke);
$("manifest-check").addEventListener("click", checkImage);
$("enroll-readiness").addEventListener("click", checkReadiness);
$("image-mode").addEventListener("change", () => {
  const registry = $("image-mode").value === "registry";
  $("image-bundle").hidden = registry;
  $("image-registry").hidden = !registry;
});
for (const button of dialog.querySelectorAll("[data-step-button]")) {
  button.addEventListener("click", () => showStep(button.getAttribute("data-step-button")));
}
for (const button of dialog.querySelectorAll("[data-goto]")) {
  button.addEventListener("click", () => showStep(button.getAttribute("data-goto")));
}
