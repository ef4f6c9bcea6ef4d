"""Training. ``skeleton`` is the walking-skeleton trainer (AdamW on byte tokens of the built-in corpus)."""
