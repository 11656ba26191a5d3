<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="referrer" content="no-referrer">
% if session is not None:
<meta name="csrf-token" content="{{session.csrf_token}}">
% end
<title>{{title}} · ModelForge</title>
<link rel="stylesheet" href="/console/static/console.css">
% for sheet in get('stylesheets', []):
<link rel="stylesheet" href="/console/static/{{sheet}}">
% end
</head>
<body>
<header class="top">
  <a class="brand" href="/console/">ModelForge</a>
% if session is not None:
  <nav><a href="/console/">Hardware</a> <a href="/console/work">Work</a> <a href="/console/models">Models</a> <a href="/console/deployments">Deployments</a> <a href="/console/keys">API keys</a> <a href="/console/users">Users</a></nav>
  <button type="button" class="link" id="logout" data-testid="logout">Sign out</button>
% end
</header>
<main>
{{!base}}
</main>
<footer class="bottom">ModelForge {{version}}</footer>
% for script in get('scripts', []):
<script src="/console/static/{{script}}"></script>
% end
% for module in get('modules', []):
<script type="module" src="/console/static/{{module}}"></script>
% end
</body>
</html>
