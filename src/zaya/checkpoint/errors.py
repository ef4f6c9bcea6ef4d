"""The checkpoint package's error type (zaya.errors.CheckpointError, exit code 5), importable from here too."""

from zaya.errors import CheckpointError

__all__ = ["CheckpointError"]
