% rebase('layout', title='Sign in', modules=[])
<section class="card narrow">
  <h1>Sign in</h1>
% if not password_set:
  <p class="notice" data-testid="password-unset">No admin password is set yet. On the control-plane host, run:</p>
  <pre class="command">{{command}}</pre>
  <p>then reload this page.</p>
% else:
  <form id="sign-in" method="post" action="/console/sign-in" autocomplete="off">
    <label for="user">User name</label>
    <input id="user" name="user" value="{{user}}" required maxlength="64" autocapitalize="none"
           autocomplete="username" spellcheck="false" data-testid="login-user">
    <label for="password">Password</label>
    <input id="password" name="password" type="password" required autofocus
           autocomplete="current-password" data-testid="login-password">
    <button type="submit" data-testid="login-submit">Sign in</button>
    <p id="sign-in-error" class="error" role="alert" data-testid="login-error">{{error}}</p>
  </form>
% end
</section>
