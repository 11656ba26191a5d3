"""Leased work: the items, placement on measured inventory, and the leases agents claim."""
