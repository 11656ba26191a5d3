"""The ``modelforge`` command line (click), one module per command group."""

from __future__ import annotations

from .main import main

__all__ = ["main"]
