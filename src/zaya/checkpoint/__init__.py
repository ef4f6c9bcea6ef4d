"""Training checkpoints: distributed, atomic, verified (see store.py)."""
