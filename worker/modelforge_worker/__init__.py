"""ModelForge runtime worker: executes capabilities on the node (see issue for the worker)."""
