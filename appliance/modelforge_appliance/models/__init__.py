"""Models: manifests, the seed cache, replicas and presence (docs/architecture.md §10)."""
