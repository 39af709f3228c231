"""Model families: shared decoder layers, vision towers and projectors, image preprocessing,
checkpoint reading, and the registry that picks a family from a checkpoint's config.json."""
