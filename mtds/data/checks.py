"""Small argument checks shared by the training entry point and the pipeline."""
from mtds.data.errors import DataError


def check_seq_length(seq_length: int, max_positions: int) -> None:
    """A sequence longer than the position table would index past it."""
    if not isinstance(seq_length, int) or seq_length < 1:
        raise DataError(f"seq_length must be a positive integer, got {seq_length!r}")
    if seq_length > max_positions:
        raise DataError(
            f"seq_length {seq_length} exceeds the model's max_position_embeddings "
            f"{max_positions}; lower --seq-length or use a model with more positions")
