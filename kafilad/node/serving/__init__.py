"""kafilad.node.serving: requests, admission, the ring's stages and the head's scheduling."""
