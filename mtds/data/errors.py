"""The one exception type of the data pipeline."""


class DataError(ValueError):
    """Bad data input. The message is one actionable line, fit to print as-is.

    A subclass of ValueError so callers that already treat bad arguments as
    ValueError keep working; the CLI prints it without a traceback.
    """
