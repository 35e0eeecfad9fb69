"""kafilad.node.shards: the model's files, served by the host and fetched by members (DESIGN §6)."""
