"""Weight sync from the trainer to the engine (sees only (HF name, full tensor) pairs)."""
