"""Hold out part of a packed dataset for validation."""
import numpy as np

from mtds.data.errors import DataError


def split_train_eval(ds, eval_fraction: float, seed: int):
    """Return (train, eval) views of `ds`; eval is None when eval_fraction is 0.

    The held-out samples are a seeded random subset (at least one sample), so
    evaluation covers the whole corpus rather than only its last document. Both
    views keep the stream order. Adjacent windows share one boundary token, so a
    held-out window may share its first/last token with a training window.
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise DataError(f"eval fraction must be in [0, 1), got {eval_fraction}")
    if eval_fraction == 0.0:
        return ds, None
    n = len(ds)
    n_eval = max(1, int(round(eval_fraction * n)))
    if n_eval >= n:
        raise DataError(f"cannot hold out {eval_fraction:.0%} of {n} samples for evaluation and "
                        f"keep any for training; use more data or a smaller --eval-split")
    order = np.random.default_rng(seed).permutation(n)
    return ds.subset(np.sort(order[n_eval:])), ds.subset(np.sort(order[:n_eval]))


def build_train_eval(build, data_spec, eval_spec, eval_fraction: float, seed: int):
    """(train, eval) from a separate eval spec when given (the fraction is then
    ignored, so a default --eval-split never conflicts), else by holding out
    `eval_fraction` of the training data.

    `build(spec)` is a one-argument wrapper around build_packed_dataset, so the
    tokenizer, seq_length and cache settings stay with the caller.
    """
    train = build(data_spec)
    if eval_spec is not None:
        return train, build(eval_spec)
    return split_train_eval(train, eval_fraction, seed)
