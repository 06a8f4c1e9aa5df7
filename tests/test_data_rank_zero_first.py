"""The token cache is built by local rank 0 first while the node's other ranks wait on the rendezvous
store (not in a timed barrier); a builder's failure reaches them as one line."""
from __future__ import annotations

import time

from lab.testing import spawn


def _ordered():
    import torch.distributed as dist

    from mtds.data.rank_zero_first import local_rank_zero_first

    def build():
        start = time.time()
        if dist.get_rank() == 0:
            time.sleep(1.5)
        return start, time.time()
    return local_rank_zero_first(build, what="a test cache", poll_s=0.05)


def test_the_others_build_after_local_rank_zero_has_finished():
    (start0, end0), (start1, _) = spawn(_ordered, 2)
    assert start1 >= end0 > start0 + 1.4


def _builder_fails():
    import torch.distributed as dist

    from mtds.data.rank_zero_first import local_rank_zero_first

    def build():
        if dist.get_rank() == 0:
            raise ValueError("corpus.txt: unreadable line 7\nmore detail")
        return "built"
    try:
        return local_rank_zero_first(build, what="the token cache", poll_s=0.05)
    except ValueError as err:        # DataError on the waiting rank, the builder's own error on rank 0
        return type(err).__name__, str(err)


def test_a_failed_build_is_one_line_on_the_waiting_ranks():
    (kind0, text0), (kind1, text1) = spawn(_builder_fails, 2, timeout=120)
    assert kind0 == "ValueError" and kind1 == "DataError"
    assert text1 == "local rank 0 could not build the token cache: corpus.txt: unreadable line 7", text1
