"""ModelForge Node Agent: outbound-only publisher for a GPU host."""
