"""Model layers as pure functions over explicit parameter dicts."""
