"""The one error type of this package: a one-line message for ``mtds-convert`` (exit status 2)."""


class MegatronCheckpointError(ValueError):
    """A Megatron checkpoint, flag or model this converter cannot use; the message names what and why."""
