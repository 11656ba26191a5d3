"""The relay: client requests carried to a node's runtime over the tunnel its agent opened.

See docs/architecture.md §12: the hub of tunnels and streams (hub.py); the client routes that
use it are in api/client.py.
"""
