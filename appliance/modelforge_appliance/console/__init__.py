"""The web console: sign-in, Hardware and node pages, the Enroll node wizard.

A room of its own: routes, templates, static files and vendored libraries live here, and
it calls the same service functions as the JSON API (``routes.py``), never the store.
"""
