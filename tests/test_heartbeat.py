"""The heartbeat's store load stays flat per rank as the world grows (ring neighbours + one alarm key),
and it still names a dead, frozen or failed rank on every rank. Real ``TCPStore`` clients, threads as
ranks, synthetic clocks (no sleeping)."""
from __future__ import annotations

import datetime

import torch.distributed as dist

from mtds.safety.heartbeat import FAILED, Heartbeat
from lab.heartbeat_load import measure


def test_store_requests_per_rank_do_not_grow_with_the_world():
    small, large = measure(8), measure(24)
    for m in (small, large):
        assert m["keys_read_per_rank_per_beat"] <= 5, m
    # all-to-all watching read world² keys per beat; the ring ~4 per rank (3.7 measured)
    assert large["store_keys_read_per_beat"] < large["all_ranks_formula_keys_per_beat"] / 4, large
    assert abs(small["keys_read_per_rank_per_beat"] - large["keys_read_per_rank_per_beat"]) < 0.5


def _ring(world: int, timeout_s: float = 10.0):
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=30))
    beats = []
    for rank in range(world):
        hb = Heartbeat(timeout_s=timeout_s)
        hb.attach(dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=datetime.timedelta(seconds=30)),
                  "t/", rank, world)
        beats.append(hb)
    return master, beats


def test_a_silent_rank_is_named_on_every_rank():
    _, beats = _ring(16)
    silent = 9
    messages = {}
    for now in range(0, 14):         # every rank but 9 beats once per second; 9 beat only at t=0
        for rank, hb in enumerate(beats):
            if rank == silent and now > 0:
                continue
            message = hb.beat_once(float(now))
            if message is not None:
                messages.setdefault(rank, message)
    assert set(messages) == set(range(16)) - {silent}, sorted(messages)
    assert len(set(messages.values())) == 1 and "rank 9 has not been heard from" in messages[0], messages


def test_a_failed_rank_stops_the_others_and_finished_ranks_are_skipped():
    master, beats = _ring(6, timeout_s=30.0)
    master.set("t/4", "done")          # rank 4 finished: 3 and 5 watch past it
    master.set("t/5", FAILED + "ValueError")
    messages = {}
    for now in range(0, 8):
        for rank, hb in enumerate(beats):
            if rank in (4, 5):
                continue
            message = hb.beat_once(float(now))
            if message is not None:
                messages.setdefault(rank, message)
    assert set(messages) == {0, 1, 2, 3}, messages
    assert all("rank 5 left training with an error (ValueError" in m for m in messages.values()), messages
    assert sorted(r for r, _ in beats[3]._watched()) == [2, 5]
