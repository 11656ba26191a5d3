"""ModelForge control plane and console."""
