"""The checkpoint package's error type (zaya.core.errors.CheckpointError, exit code 5), importable from here too."""

from zaya.core.errors import CheckpointError

__all__ = ["CheckpointError"]
