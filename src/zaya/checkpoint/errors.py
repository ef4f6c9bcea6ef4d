"""The checkpoint package's error type (its own module so every part can raise it without import cycles)."""


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, corrupt, or made for another model."""
