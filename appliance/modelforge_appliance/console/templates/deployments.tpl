% rebase('layout', title='Deployments', modules=['deployments.js'], stylesheets=['deployments.css'])
<section class="page" id="deployments" data-api-origin="{{api_origin}}">
  <div class="toolbar">
    <h1>Deployments</h1>
  </div>
  <p class="muted">A deployment runs one model revision on the nodes you name: one server per node,
    started by that node's agent on the model's replicated files, with the GPUs it was given.
    Nodes can be added and removed while it serves; clients keep calling it by its name.</p>
  <p id="deployments-error" class="error" data-testid="deployments-error" role="alert"></p>
  <div id="deployments-empty" class="card empty" data-testid="deployments-empty" hidden>
    <h2>Nothing deployed yet</h2>
    <p>Deploy a model that is present on the nodes that should serve it, from the control-plane
      host or anywhere with an admin token:</p>
    <pre class="command" data-testid="deployments-deploy-hint">{{deploy_command}}</pre>
    <p class="muted">Add <code>--replicate</code> to copy the model to those nodes first; the
      <a href="/console/models">Models</a> page shows where it is present.</p>
  </div>
  <div id="deployment-list" data-testid="deployment-list"></div>
  <p id="deployments-status" class="muted" data-testid="deployments-status">Loading…</p>
</section>
