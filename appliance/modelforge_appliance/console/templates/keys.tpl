% rebase('layout', title='API keys', modules=['keys.js'], scripts=['vendor/uPlot.iife.min.js'], stylesheets=['vendor/uPlot.min.css'])
<section class="page" id="keys">
  <div class="toolbar">
    <h1>API keys and usage</h1>
  </div>
  <p class="muted">Clients of the OpenAI-compatible API send a key as
    <code>Authorization: Bearer mfk_…</code>. A key may be limited to some deployments, to
    requests a minute and to tokens a day (docs/clients.md); one without limits may call
    everything.</p>
  <p id="keys-error" class="error" data-testid="keys-error" role="alert"></p>
  <section class="card" data-testid="key-form-card">
    <h2>New key</h2>
    <form id="key-form" class="pull-form" data-testid="key-form" autocomplete="off">
      <label for="key-name">Name</label>
      <input id="key-name" name="name" data-testid="key-name" required maxlength="120"
             placeholder="chat frontend" spellcheck="false">
      <label for="key-deployments">Only these deployments <span class="muted">(comma-separated; empty: every one)</span></label>
      <input id="key-deployments" name="deployments" data-testid="key-deployments" spellcheck="false">
      <label for="key-rpm">Requests a minute <span class="muted">(empty: no limit)</span></label>
      <input id="key-rpm" name="rpm" data-testid="key-rpm" inputmode="numeric">
      <label for="key-tokens">Tokens a day <span class="muted">(prompt and completion, UTC days; empty: no limit)</span></label>
      <input id="key-tokens" name="tokens_per_day" data-testid="key-tokens" inputmode="numeric">
      <label for="key-expires">Expires <span class="muted">(30d, 12h, 2027-01-31; empty: never)</span></label>
      <input id="key-expires" name="expires" data-testid="key-expires" spellcheck="false">
      <div class="actions"><button type="submit" data-testid="key-submit">Create</button></div>
    </form>
    <p id="key-form-error" class="error" role="alert" data-testid="key-form-error"></p>
    <div id="key-secret" class="card" data-testid="key-secret" hidden>
      <p><strong>Copy this key now: it is not shown again.</strong></p>
      <pre class="command" id="key-secret-value" data-testid="key-secret-value"></pre>
      <button type="button" class="link" id="key-secret-done" data-testid="key-secret-done">I have stored it</button>
    </div>
  </section>
  <section class="card">
    <h2>Keys</h2>
    <table class="list" data-testid="key-table">
      <thead><tr><th>Key id</th><th>Name</th><th>Limits</th><th>Last used</th><th>State</th><th></th></tr></thead>
      <tbody id="key-rows"></tbody>
    </table>
  </section>
  <section class="card">
    <h2>Usage</h2>
    <p class="muted">Tokens as the runtimes reported them, per UTC day; the control plane
      writes its counts every few seconds.</p>
    <div id="usage-chart" data-testid="usage-chart"></div>
    <table class="list" data-testid="usage-table">
      <thead><tr><th>Key</th><th>Requests</th><th>Prompt tokens</th><th>Completion tokens</th><th>Errors</th></tr></thead>
      <tbody id="usage-rows"></tbody>
    </table>
  </section>
  <p id="keys-status" class="muted" data-testid="keys-status">Loading…</p>
</section>
