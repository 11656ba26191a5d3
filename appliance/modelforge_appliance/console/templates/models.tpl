% rebase('layout', title='Models', modules=['models.js'])
<section class="page" id="models">
  <div class="toolbar">
    <h1>Models</h1>
  </div>
  <p class="muted">A model goes only to the nodes you choose; a replica counts as present once its
    node has reported it, verified, since its enrollment or the last restore.</p>
  <p id="models-error" class="error" data-testid="models-error" role="alert"></p>
  <div id="models-empty" class="card empty" data-testid="models-empty" hidden>
    <h2>No model imported yet</h2>
    <p>Models are imported on the control-plane host, from a file, a directory or a Hugging Face
      cache snapshot:</p>
    <pre class="command" data-testid="models-import-hint">{{import_command}}</pre>
    <p class="muted">Then replicate it here to the nodes that should hold it.</p>
  </div>
  <div id="model-list" data-testid="model-list"></div>
  <p id="models-status" class="muted" data-testid="models-status">Loading…</p>
</section>
