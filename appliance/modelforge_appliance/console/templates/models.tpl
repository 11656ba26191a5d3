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
    <p class="muted">Or pull one from a hub with the form below. Then replicate it here to the
      nodes that should hold it.</p>
  </div>
  <section class="card pull" id="pull-card" data-testid="pull-card">
    <h2>Pull from a hub</h2>
    <p class="muted">The control plane downloads the files itself, once (its <code>HF_ENDPOINT</code>
      names a mirror), resumes where a pull stopped, and checks every file against the hub's
      hashes before the model is listed here. Gated and private repositories need a token:
      <code>{{hub_token_command}}</code> on its host.</p>
    <form id="pull-form" class="pull-form" data-testid="pull-form" autocomplete="off">
      <label for="pull-name">Name</label>
      <input id="pull-name" name="name" data-testid="pull-name" required maxlength="120"
             placeholder="tiny-q4" spellcheck="false">
      <label for="pull-repo">Repository</label>
      <input id="pull-repo" name="repo" data-testid="pull-repo" required maxlength="220"
             placeholder="hf://ORG/REPO or hf://ORG/REPO@REVISION" spellcheck="false">
      <label for="pull-include">Only files matching <span class="muted">(globs, comma-separated; empty: all)</span></label>
      <input id="pull-include" name="include" data-testid="pull-include" placeholder="*Q4_K_M.gguf"
             spellcheck="false">
      <label for="pull-exclude">Leaving out <span class="muted">(globs, comma-separated)</span></label>
      <input id="pull-exclude" name="exclude" data-testid="pull-exclude" spellcheck="false">
      <div class="actions"><button type="submit" data-testid="pull-submit">Pull</button></div>
    </form>
    <p id="pull-error" class="error" role="alert" data-testid="pull-error"></p>
    <div id="pull-list" data-testid="pull-list"></div>
  </section>
  <div id="model-list" data-testid="model-list"></div>
  <p id="models-status" class="muted" data-testid="models-status">Loading…</p>
</section>
