"""ModelForge Runtime Worker: runs capabilities for the node agent, over a unix socket only."""

from __future__ import annotations

from modelforge_contract import __version__

__all__ = ["__version__"]
