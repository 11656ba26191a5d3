% rebase('layout', title='Users', modules=['users.js'])
<section class="page" id="users">
  <div class="toolbar">
    <h1>Users</h1>
  </div>
  <p class="muted">Everyone who signs in, with a role: a viewer reads, an operator also changes
    nodes, models, deployments and work and mints its own API keys, an admin also manages users.
    You are <strong data-testid="me">{{session.user}}</strong>.</p>
  <p id="users-error" class="error" data-testid="users-error" role="alert"></p>
  <section class="card">
    <h2>New user</h2>
    <form id="user-form" class="pull-form" data-testid="user-form" autocomplete="off">
      <label for="user-name">Name <span class="muted">(lower-case letters, digits, . _ -)</span></label>
      <input id="user-name" name="name" data-testid="user-name" required maxlength="64" spellcheck="false">
      <label for="user-role">Role</label>
      <select id="user-role" name="role" data-testid="user-role">
        <option value="viewer">viewer</option>
        <option value="operator">operator</option>
        <option value="admin">admin</option>
      </select>
      <label for="user-password">Password <span class="muted">(at least 12 characters; empty: cannot sign in)</span></label>
      <input id="user-password" name="password" type="password" data-testid="user-password" autocomplete="new-password">
      <div class="actions"><button type="submit" data-testid="user-submit">Add</button></div>
    </form>
    <p id="user-form-error" class="error" role="alert" data-testid="user-form-error"></p>
  </section>
  <section class="card">
    <table class="list" data-testid="user-table">
      <thead><tr><th>Name</th><th>Role</th><th>State</th><th>Password</th><th></th></tr></thead>
      <tbody id="user-rows"></tbody>
    </table>
  </section>
</section>
