// The Users page: every user with role and state; an admin adds users, changes roles and
// disables or enables them through the same /api/v1/admin/users calls as the CLI. A refusal
// (ROLE_FORBIDDEN for a non-admin, LAST_ADMIN) is shown with its next step.
import { api, el, errorText, setText } from "./console.js";

const $ = (id) => document.getElementById(id);
const ROLES = ["viewer", "operator", "admin"];

async function change(name, body) {
  try {
    await api("PATCH", `/admin/users/${encodeURIComponent(name)}`, body);
    setText($("users-error"), "");
  } catch (error) {
    setText($("users-error"), errorText(error));
  }
  await refresh();
}

function userRow(user) {
  const role = el("select", { "data-testid": "user-row-role", "aria-label": `role of ${user.name}` },
    ...ROLES.map((r) => el("option", { value: r, selected: r === user.role, text: r })));
  role.addEventListener("change", () => change(user.name, { role: role.value }));
  const disabled = user.state === "disabled";
  const toggle = el("button", { type: "button", class: "link", "data-testid": "user-toggle",
    text: disabled ? "Enable" : "Disable" });
  toggle.addEventListener("click", () => change(user.name, { disabled: !disabled }));
  return el(
    "tr",
    { "data-testid": "user-row", "data-user": user.name, "data-state": user.state, "data-role": user.role },
    el("td", { text: user.name }),
    el("td", {}, role),
    el("td", { text: user.state }),
    el("td", { text: user.password_set ? "set" : "none" }),
    el("td", {}, toggle),
  );
}

async function refresh() {
  try {
    const answer = await api("GET", "/admin/users");
    $("user-rows").replaceChildren(...answer.users.map(userRow));
  } catch (error) {
    setText($("users-error"), errorText(error));
  }
}

$("user-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const form = new FormData(event.target);
  const password = String(form.get("password") || "");
  const body = { name: String(form.get("name") || ""), role: String(form.get("role") || "viewer"),
    password: password || null };
  try {
    await api("POST", "/admin/users", body);
    setText($("user-form-error"), "");
    event.target.reset();
  } catch (error) {
    setText($("user-form-error"), errorText(error));
  }
  await refresh();
});

refresh();
