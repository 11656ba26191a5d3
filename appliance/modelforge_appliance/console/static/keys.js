// The API keys page: mint a key (its secret shown once), list and revoke keys, and what each
// used, with a chart of tokens and requests per UTC day. Everything goes through the same
// /api/v1/admin/api-keys and /api/v1/admin/usage calls as the CLI and automation.
import { api, el, errorText, setText, when } from "./console.js";

const $ = (id) => document.getElementById(id);
const REFRESH_SECONDS = 15;
let chart = null;

function limitsText(key) {
  const said = [];
  if (key.deployments) said.push(`only ${key.deployments.join(", ")}`);
  if (key.rpm) said.push(`${key.rpm}/min`);
  if (key.tokens_per_day) said.push(`${key.tokens_per_day} tokens/day`);
  if (key.expires_at) said.push(`until ${when(key.expires_at)}`);
  return said.length ? said.join(" · ") : "none";
}

function keyRow(key) {
  const revoke = el("button", { type: "button", class: "link", "data-testid": "key-revoke", text: "Revoke" });
  let armed = false;
  revoke.addEventListener("click", async () => {
    if (!armed) {
      armed = true;
      setText(revoke, "Click again to revoke for good");
      window.setTimeout(() => {
        armed = false;
        setText(revoke, "Revoke");
      }, 5000);
      return;
    }
    try {
      await api("DELETE", `/admin/api-keys/${encodeURIComponent(key.key_id)}`);
      await refresh();
    } catch (error) {
      setText($("keys-error"), errorText(error));
    }
  });
  return el(
    "tr",
    { "data-testid": "key-row", "data-key-id": key.key_id, "data-state": key.state },
    el("td", {}, el("code", { text: key.key_id })),
    el("td", { text: key.name }),
    el("td", { "data-testid": "key-limits", text: limitsText(key) }),
    el("td", { text: key.last_used_at ? when(key.last_used_at) : "never" }),
    el("td", { text: key.state }),
    el("td", {}, key.state === "active" ? revoke : ""),
  );
}

function usageRow(row) {
  return el(
    "tr",
    { "data-testid": "usage-row", "data-key-id": row.key_id },
    el("td", { text: row.name ? `${row.name} (${row.key_id})` : row.key_id }),
    el("td", { "data-testid": "usage-requests", text: String(row.requests) }),
    el("td", { "data-testid": "usage-prompt", text: String(row.prompt_tokens) }),
    el("td", { "data-testid": "usage-completion", text: String(row.completion_tokens) }),
    el("td", { text: String(row.errors) }),
  );
}

function drawChart(days) {
  const box = $("usage-chart");
  if (!days.length) {
    chart?.destroy();
    chart = null;
    box.replaceChildren(el("p", { class: "muted", text: "Nothing used yet." }));
    box.setAttribute("data-days", "0");
    return;
  }
  if (typeof window.uPlot !== "function") {
    box.replaceChildren(el("p", { class: "error", text: "The chart library did not load." }));
    return;
  }
  const xs = days.map((d) => Date.parse(`${d.day}T00:00:00Z`) / 1000);
  const data = [xs, days.map((d) => d.prompt_tokens + d.completion_tokens), days.map((d) => d.requests)];
  if (chart) {
    chart.setData(data);
  } else {
    box.replaceChildren();
    const options = {
      title: "Per UTC day",
      width: Math.max(320, Math.min(900, box.clientWidth || 640)),
      height: 200,
      series: [
        {},
        { label: "tokens", stroke: "#2f6fdf", width: 1.5, points: { show: true } },
        { label: "requests", stroke: "#c2410c", width: 1.5, points: { show: true }, scale: "requests" },
      ],
      axes: [{}, { size: 56 }, { side: 1, scale: "requests", grid: { show: false } }],
    };
    chart = new window.uPlot(options, data, box);
  }
  box.setAttribute("data-days", String(days.length));
}

async function refresh() {
  try {
    const [keys, byKey, byDay] = await Promise.all([
      api("GET", "/admin/api-keys"),
      api("GET", "/admin/usage?by=key"),
      api("GET", "/admin/usage?by=day"),
    ]);
    $("key-rows").replaceChildren(...keys.api_keys.map(keyRow));
    $("usage-rows").replaceChildren(...byKey.usage.map(usageRow));
    drawChart(byDay.usage);
    setText($("keys-error"), "");
    setText($("keys-status"), `${keys.api_keys.length} key(s).`);
  } catch (error) {
    setText($("keys-error"), errorText(error));
  }
}

function numberOrNull(text) {
  const value = text.trim();
  return value === "" ? null : Number(value);
}

$("key-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const form = new FormData(event.target);
  const deployments = String(form.get("deployments") || "").split(",").map((s) => s.trim()).filter(Boolean);
  const body = {
    name: String(form.get("name") || ""),
    deployments: deployments.length ? deployments : null,
    rpm: numberOrNull(String(form.get("rpm") || "")),
    tokens_per_day: numberOrNull(String(form.get("tokens_per_day") || "")),
    expires: String(form.get("expires") || "").trim() || null,
  };
  try {
    const made = await api("POST", "/admin/api-keys", body);
    setText($("key-form-error"), "");
    setText($("key-secret-value"), made.secret);
    $("key-secret").hidden = false;
    event.target.reset();
    await refresh();
  } catch (error) {
    setText($("key-form-error"), errorText(error));
  }
});

$("key-secret-done").addEventListener("click", () => {
  setText($("key-secret-value"), ""); // the secret leaves the page
  $("key-secret").hidden = true;
});

refresh();
window.setInterval(refresh, REFRESH_SECONDS * 1000);
