"""Ranks waiting for a leader poll the rendezvous store on a schedule that bounds the whole job's request
rate: short work is noticed quickly, long work costs at most ~STORE_RATE requests/s at any world size."""
from __future__ import annotations

import itertools

from mtds.safety.leader import STORE_RATE, poll_intervals


def _first(n, **kw):
    return list(itertools.islice(poll_intervals(**kw), n))


def test_short_work_is_noticed_within_a_tenth_of_a_second():
    assert _first(1, poll_s=0.5, world=8) == [0.05]
    # doubling up to the interval the caller asked for
    assert _first(6, poll_s=0.5, world=8) == [0.05, 0.1, 0.2, 0.4, 0.5, 0.5]


def test_the_store_load_stays_bounded_at_any_world_size():
    for world in (2, 64, 1024, 16384):
        steady = _first(40, poll_s=0.5, world=world)[-1]
        if world <= STORE_RATE * 0.5:
            assert steady == 0.5, (world, steady)              # few ranks: the caller's interval
        else:
            assert world / steady <= STORE_RATE * 1.0001, (world, steady)   # all waiting ranks together
    assert _first(40, poll_s=0.5, world=1024)[-1] == 1024 / STORE_RATE      # 5.12 s, not 0.5 s


def test_a_first_interval_longer_than_the_cap_is_cut():
    assert _first(2, poll_s=0.01, world=1, first_s=0.05) == [0.01, 0.01]
