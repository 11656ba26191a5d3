% rebase('layout', title='Work item', modules=['work_item.js'])
<section class="page" id="work-item" data-work-id="{{work_id}}">
  <div class="toolbar">
    <h1>Work item <code>{{work_id}}</code> <span id="item-state" class="badge" data-testid="item-state"></span></h1>
    <a href="/console/work">← Work</a>
  </div>
  <dl class="facts" id="item-facts" data-testid="item-facts"></dl>
  <p id="item-error" class="error" role="alert" data-testid="item-error"></p>

  <div class="actions">
    <button type="button" id="item-cancel" data-testid="item-cancel" class="danger" disabled>Cancel</button>
    <span class="muted">Only a queued or leased item can be cancelled; a running node stops at
      its next lease renewal.</span>
  </div>

  <h2>Input</h2>
  <div id="item-input" data-testid="item-input"></div>
  <h2>Constraints</h2>
  <div id="item-constraints" data-testid="item-constraints"></div>
  <h2>Result</h2>
  <div id="item-result" data-testid="item-result"></div>
  <h2>Log tail</h2>
  <pre id="item-log" class="command log" data-testid="item-log"></pre>
</section>
