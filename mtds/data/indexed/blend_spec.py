"""Megatron's blend syntax and the blending index.

`--data-path A` is one dataset; `--data-path 0.3 A 0.7 B` mixes them by weight (normalized).
The blending index assigns global sample n to a dataset: dataset k's j-th sample is placed at
time (j + 1/2) / w_k and all datasets' samples are merged by time (a stable sort, so ties go to
the earlier dataset). Every prefix of n samples then holds within one sample of w_k * n from each
dataset, as Megatron's greedy helper gives, and it is vectorized numpy. The order of the first n
does not depend on how many are asked for.
"""
import math

import numpy as np

from mtds.data.errors import DataError


def parse_blend(args, flag="--data-path"):
    """['A'] or ['0.3', 'A', '0.7', 'B'] -> [(weight, prefix), ...] with weights summing to 1."""
    args = [str(a) for a in (args or [])]
    if not args:
        raise DataError(f"{flag} needs a dataset prefix, or weight prefix pairs")
    if len(args) == 1:
        return [(1.0, args[0])]
    if len(args) % 2:
        raise DataError(f"{flag} takes one prefix, or weight prefix pairs; got {len(args)} arguments "
                        f"(e.g. {flag} 0.3 data/a_text_document 0.7 data/b_text_document)")
    pairs = []
    for w, prefix in zip(args[::2], args[1::2]):
        try:
            weight = float(w)
        except ValueError:
            raise DataError(f"{flag}: {w!r} is not a weight; write weight prefix pairs "
                            f"(e.g. {flag} 0.3 A 0.7 B)") from None
        if not math.isfinite(weight) or weight <= 0:
            raise DataError(f"{flag}: weight {w} of {prefix} must be a positive number")
        pairs.append((weight, prefix))
    total = sum(w for w, _ in pairs)
    return [(w / total, p) for w, p in pairs]


def blending_index(weights, num_samples: int):
    """(dataset_index int16[n], dataset_sample_index int64[n]) for n = num_samples."""
    weights = np.asarray(weights, dtype=np.float64)
    per = [np.arange(math.ceil(w * num_samples) + 1) for w in weights]
    times = np.concatenate([(j + 0.5) / w for j, w in zip(per, weights)])
    which = np.concatenate([np.full(len(j), k, dtype=np.int16) for k, j in enumerate(per)])
    order = np.argsort(times, kind="stable")[:num_samples]
    return which[order], np.concatenate(per)[order].astype(np.int64)
