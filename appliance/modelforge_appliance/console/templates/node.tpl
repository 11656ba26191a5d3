% rebase('layout', title=display_name, modules=['node.js'], scripts=['vendor/uPlot.iife.min.js'], stylesheets=['vendor/uPlot.min.css'])
<section class="page" id="node" data-node-id="{{node_id}}">
  <div class="toolbar">
    <h1><span id="node-name">{{display_name}}</span> <span id="node-liveness" class="badge" data-testid="node-liveness"></span></h1>
    <a href="/console/">← Hardware</a>
  </div>
  <dl class="facts" id="node-facts" data-testid="node-facts"></dl>
  <p id="node-error" class="error" role="alert"></p>

  <h2>Actions</h2>
  <div class="actions">
    <button type="button" id="cordon" data-testid="node-cordon">Cordon</button>
    <button type="button" id="uncordon" data-testid="node-uncordon">Uncordon</button>
    <button type="button" id="revoke-credential" data-testid="node-revoke-credential" class="danger">Revoke credential</button>
    <button type="button" id="decommission-preview" data-testid="decommission-preview" class="danger">Decommission…</button>
  </div>
  <div id="hardware-change" data-testid="hardware-change" hidden>
    <p>This node published other accelerators than those accepted <span id="hardware-since"></span>. It gets no new work until an administrator accepts them:</p>
    <ul id="hardware-difference" data-testid="hardware-difference"></ul>
    <button type="button" id="accept-hardware" data-testid="accept-hardware">Accept hardware</button>
  </div>
  <div id="decommission" data-testid="decommission-panel" hidden>
    <p>Decommissioning will:</p>
    <ul id="decommission-effects" data-testid="decommission-effects"></ul>
    <button type="button" id="decommission-execute" data-testid="decommission-execute" class="danger">Decommission now</button>
    <button type="button" id="decommission-cancel" class="link">Cancel</button>
  </div>

  <h2>Readiness</h2>
  <ul id="readiness" class="checks" data-testid="node-readiness"></ul>

  <h2>Serving</h2>
  <table class="small"><thead><tr><th>Deployment</th><th>Model</th><th>Server</th><th>Since</th><th>Restarts</th><th>Why</th></tr></thead>
    <tbody id="servers" data-testid="node-servers"></tbody></table>
  <p id="servers-none" class="muted" data-testid="node-servers-none" hidden>No deployment has a server on this node (<a href="/console/deployments">Deployments</a>).</p>

  <h2>Models held</h2>
  <table class="small"><thead><tr><th>Model</th><th>Replica</th><th>Bytes</th><th>Why</th></tr></thead>
    <tbody id="replicas" data-testid="node-replicas"></tbody></table>
  <p id="replicas-none" class="muted" data-testid="node-replicas-none" hidden>No model is replicated to this node (<a href="/console/models">Models</a>).</p>

  <h2>GPUs over the last hour</h2>
  <div id="charts" class="charts" data-testid="node-charts"></div>

  <h2>Credentials</h2>
  <p id="credential-counts" data-testid="credential-counts"></p>
  <table class="small"><thead><tr><th>Credential</th><th>Created</th><th>Last used</th><th>Revoked</th></tr></thead>
    <tbody id="credentials"></tbody></table>

  <h2>Audit trail</h2>
  <table class="small"><thead><tr><th>When</th><th>Who</th><th>What</th><th>Detail</th></tr></thead>
    <tbody id="audit" data-testid="node-audit"></tbody></table>
</section>
