"""The nodes: liveness, heartbeats, inventory, telemetry, readiness, alerts and the node-agent image check."""
