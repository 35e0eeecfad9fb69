"""kafilad.node.paths.manager: ring edges, links, NAT classification and hole punching (proto_spec 07)."""
