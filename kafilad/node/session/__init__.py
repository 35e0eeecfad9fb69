"""kafilad.node.session: one daemon's life in a session (host, member, their driver, state dir, coming back)."""
