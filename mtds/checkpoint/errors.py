"""One error type for unusable checkpoints and conversion inputs (a ValueError: CLIs print one line)."""


class CheckpointFormatError(ValueError):
    """Missing/partial files, wrong architecture, a checkpoint of a different model, a bad layout."""
