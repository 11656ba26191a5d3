"""Who may call: enrollment tokens, node credentials, admin tokens, console sessions and the join commands."""
