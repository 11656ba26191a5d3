"""Deployments: model servers started on chosen nodes by their agents.

See docs/architecture.md §11: the admin side (servers.py), where each server may run and
with which GPUs (placement.py), and the agents' serve leases (leases.py).
"""
