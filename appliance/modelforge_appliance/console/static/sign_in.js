// Sign-in: post the password as JSON; the answer sets the HttpOnly session cookie.
const form = document.getElementById("sign-in");
if (form) {
  const password = document.getElementById("password");
  const error = document.getElementById("sign-in-error");
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    error.textContent = "";
    const response = await fetch("/console/sign-in", {
      method: "POST",
      headers: { "Content-Type": "application/json", Accept: "application/json" },
      credentials: "same-origin",
      body: JSON.stringify({ password: password.value }),
    });
    const body = await response.json().catch(() => ({}));
    if (response.ok) {
      password.value = "";
      window.location.assign(body.next || "/console/");
      return;
    }
    const refusal = body.error || {};
    error.textContent =
      response.status === 401 ? "Wrong password." : refusal.message || `HTTP ${response.status}`;
    if (refusal.next_step && response.status !== 401) error.textContent += ` ${refusal.next_step}`;
    password.select();
  });
}
