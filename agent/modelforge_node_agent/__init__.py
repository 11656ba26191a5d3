"""ModelForge Node Agent: outbound-only publisher for a GPU host."""

__version__ = "0.1.0"
