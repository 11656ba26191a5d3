% rebase('layout', title='Hardware', modules=['hardware.js', 'wizard.js'])
<section class="page">
  <div class="toolbar">
    <h1>Hardware</h1>
    <button type="button" id="enroll-open" data-testid="enroll-open">Enroll node</button>
  </div>
  <div id="alerts" class="alerts" data-testid="alerts"></div>
  <p id="fleet-status" class="muted" data-testid="fleet-status">Loading…</p>
  <div id="fleet-empty" class="empty card" data-testid="fleet-empty" hidden>
    <h2>No node is enrolled yet</h2>
    <p>Press <strong>Enroll node</strong> above: it mints a one-time token and shows the
      commands to run on the node. Or, on the control-plane host:</p>
    <pre class="command">modelforge enroll --name "GPU Node" --accelerator nvidia   # or --accelerator cpu</pre>
    <p>and run the join command it prints on the node. A node shows here once its agent has
      enrolled, and is ready for work once every readiness check passes.</p>
  </div>
  <table class="fleet" id="fleet-table">
    <thead>
      <tr><th>Liveness</th><th>Ready</th><th>Name</th><th>Hostname</th><th>GPUs</th>
          <th>Last heartbeat</th><th>Cordoned</th><th>Production eligible</th></tr>
    </thead>
    <tbody id="fleet-rows"></tbody>
  </table>
</section>

<dialog id="enroll" class="wizard" data-testid="enroll-dialog">
  <div class="wizard-head">
    <h2>Enroll node</h2>
    <button type="button" class="link" id="enroll-close" data-testid="enroll-close">Close</button>
  </div>
  <nav class="steps" id="enroll-steps">
    <button type="button" data-step-button="mint" class="current">1 · Token</button>
    <button type="button" data-step-button="settings" disabled>2 · Settings</button>
    <button type="button" data-step-button="image" disabled>3 · Image</button>
    <button type="button" data-step-button="readiness" disabled>4 · Readiness</button>
  </nav>

  <section data-step="mint">
    <label for="enroll-name">Display name</label>
    <input id="enroll-name" data-testid="enroll-name" maxlength="120" value="GPU Node" required>
    <label for="enroll-expiry">Token expires after</label>
    <select id="enroll-expiry" data-testid="enroll-expiry">
% for seconds, label in expiry_choices:
      <option value="{{seconds}}"{{' selected' if seconds == 900 else ''}}>{{label}}</option>
% end
    </select>
    <label for="enroll-accelerator">Accelerator mode of the node</label>
    <select id="enroll-accelerator" data-testid="enroll-accelerator">
      <option value="nvidia" selected>nvidia — require NVML and at least one GPU</option>
      <option value="auto">auto — NVIDIA when the node has NVIDIA devices</option>
      <option value="cpu">cpu — a CPU-only node</option>
    </select>
% if api_origin == "unknown":
    <p class="error" data-testid="enroll-origin-unusable">This page was opened through an address no agent can use
      (a wildcard such as 0.0.0.0), so no token can be locked to it: open the console through the address the
      agents use, or set <code>MODELFORGE_PUBLIC_API_ORIGIN</code>.</p>
% else:
    <p>The token is locked to the API origin
      <code id="enroll-origin" data-testid="enroll-origin">{{api_origin}}</code>: the agent must use exactly it.</p>
% end
    <p>Nodes enrolled here start with <code>production_eligible=false</code>.</p>
    <button type="button" id="enroll-submit" data-testid="enroll-submit">Mint enrollment token</button>
    <p id="enroll-error" class="error" role="alert"></p>
  </section>

  <section data-step="settings" hidden>
    <p>Enrollment <code id="enroll-id" data-testid="enroll-id"></code> · expires
      <span id="enroll-expires"></span> (<span id="enroll-countdown" data-testid="enroll-countdown"></span>)</p>
    <div class="token-box">
      <span>One-time token:</span>
      <code id="enroll-token" data-testid="enroll-token" class="token"></code>
      <button type="button" id="enroll-reveal" data-testid="enroll-reveal">Reveal</button>
      <button type="button" id="enroll-copy" data-testid="enroll-copy">Copy</button>
    </div>
    <p class="muted">Shown only while this wizard is open. Closing it, revoking the token, its
      expiry, or checking readiness once a node has enrolled with it clears it.</p>
    <h3>modelforge-node.env <span class="muted">(no secrets)</span></h3>
    <pre id="enroll-env" data-testid="enroll-env" class="command"></pre>
    <h3>Start command for Bash</h3>
    <p class="muted">Run it beside modelforge-node.env; it asks for the token without echo.</p>
    <pre id="enroll-start-command" data-testid="enroll-start-command" class="command"></pre>
    <h3>Runtime Worker for the start command</h3>
    <p class="muted">The node is ready only while its Runtime Worker answers beside the agent.
      Start it first, in another terminal in the same directory, as the same user; it listens
      on the socket modelforge-node.env names.</p>
    <pre id="enroll-worker-command" data-testid="enroll-worker-command" class="command"></pre>
    <div id="enroll-more-commands" data-testid="enroll-more-commands"></div>
    <div class="actions">
      <button type="button" id="enroll-revoke" data-testid="enroll-revoke" class="danger">Revoke unused token</button>
      <button type="button" data-goto="image">Next: image</button>
    </div>
  </section>

  <section data-step="image" hidden>
    <label for="image-mode">Node agent image</label>
    <select id="image-mode" data-testid="image-mode">
      <option value="bundle" selected>Local release bundle ({{image_version}})</option>
      <option value="registry">Registry image pinned by digest</option>
    </select>
    <div id="image-bundle">
      <ol class="plain">
% for step in bundle_steps:
        <li>{{step['title']}}:<pre class="command">{{step['text']}}</pre></li>
% end
        <li>Paste <code>images.modelforge-node-agent</code> from
          <code>modelforge-{{image_version}}-manifest.json</code>:</li>
      </ol>
      <textarea id="manifest-entry" data-testid="manifest-entry" rows="8" spellcheck="false"
        placeholder='{"tag": "modelforge-node-agent:{{image_version}}", "architecture": "amd64", …}'></textarea>
    </div>
    <div id="image-registry" hidden>
      <label for="registry-image">Image reference (REPOSITORY@sha256:…)</label>
      <input id="registry-image" data-testid="registry-image" spellcheck="false">
    </div>
    <button type="button" id="manifest-check" data-testid="manifest-check">Check</button>
    <div id="manifest-result" data-testid="manifest-result" class="result"></div>
    <div id="image-commands" data-testid="image-commands"></div>
    <div class="actions"><button type="button" data-goto="readiness">Next: readiness</button></div>
  </section>

  <section data-step="readiness" hidden>
    <p>Start the agent on the node, then check. Readiness is tied to the node id this
      enrollment produced; once a node has enrolled with the token, checking clears it from
      this page (while the enrollment is pending, the token stays).</p>
    <button type="button" id="enroll-readiness" data-testid="enroll-readiness">Check node readiness</button>
    <div id="readiness-result" data-testid="readiness-result" class="result"></div>
    <div id="recreate" data-testid="enroll-recreate" hidden>
      <h3>Drop the token from the container</h3>
      <p>The token is used. If the agent runs in a container (the image step's files), recreate
        it without the token, beside those files; the state volume keeps the node's identity and
        credential. The same command starts the node again after a stop:</p>
      <pre class="command">{{recreate_command}}</pre>
    </div>
  </section>
</dialog>
