"""Keeping a long run alive and honest: loading files without running their code (loading.py),
durable writes (durable.py), and, in a running job, signals, NaN checks and hang detection."""
from .loading import UnreadableFileError, UnsafeCheckpointError, allowed_globals, safe_load, verify_loadable

__all__ = ["UnreadableFileError", "UnsafeCheckpointError", "allowed_globals", "safe_load", "verify_loadable"]
