"""The JSON API of the control plane, split by caller: ``admin`` and ``agent`` routes
(with the work plane's routes beside each, in ``admin_work`` and ``agent_work``).
``runtime.app.make_app`` mounts them, and the console's routes, on one application.
"""
