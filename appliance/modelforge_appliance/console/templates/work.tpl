% rebase('layout', title='Work', modules=['work.js'])
<section class="page" id="work">
  <div class="toolbar">
    <h1>Work</h1>
  </div>

  <h2>Submit a smoke test</h2>
  <form id="smoke-form" class="inline-form" data-testid="smoke-form" hidden>
    <label for="smoke-node">Node</label>
    <select id="smoke-node" data-testid="smoke-node" required></select>
    <button type="submit" id="smoke-submit" data-testid="smoke-submit">Submit smoke</button>
  </form>
  <p id="smoke-no-nodes" class="muted" data-testid="smoke-no-nodes" hidden>No node is enrolled:
    enroll one on the <a href="/console/">Hardware</a> page (<strong>Enroll node</strong>) or with
    <code>modelforge enroll</code>, then come back.</p>
  <p id="smoke-queued" data-testid="smoke-queued" role="status"></p>
  <p id="smoke-error" class="error" data-testid="smoke-error" role="alert"></p>
  <p class="muted">A smoke runs on exactly the chosen node (<code>node_ids</code>); it stays
    queued until that node claims it.</p>

  <h2>Queue</h2>
  <div class="actions">
    <label for="work-state" class="inline">Show</label>
    <select id="work-state" data-testid="work-state" class="narrow-select">
      <option value="" selected>every state</option>
% for state in states:
      <option value="{{state}}">{{state}}</option>
% end
    </select>
  </div>
  <p id="work-status" class="muted" data-testid="work-status">Loading…</p>
  <table class="small">
    <thead>
      <tr><th>State</th><th>Work item</th><th>Capability</th><th>Node</th><th>Attempts</th>
          <th>Created</th><th>Started</th><th>Finished</th></tr>
    </thead>
    <tbody id="work-rows" data-testid="work-rows"></tbody>
  </table>
</section>
