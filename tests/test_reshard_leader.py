"""A resharded --load: rank 0 converts to universal while the others wait on the rendezvous store (not
in a collective), then every rank verifies its byte-balanced share of the universal files and all ranks
agree -- an unsafe file found by any rank, or a failed conversion, is one line on every rank."""
from __future__ import annotations

import collections

from lab.testing import spawn


class _Evil:
    def __reduce__(self):
        return (print, ("this would run code",))


def _body(root: str, case: str):
    import os
    import time

    import torch
    import torch.distributed as dist

    from mtds.checkpoint.errors import CheckpointFormatError
    from mtds.checkpoint import lifecycle as ck

    rank = dist.get_rank()
    calls, times = [], {}

    def fake_convert(directory, tag):
        calls.append(tag)
        if case == "fails":
            raise CheckpointFormatError(f"{directory}/{tag} has no ZeRO optimizer files (partial checkpoint?)")
        time.sleep(1.0)                  # the others must not start verifying before the files exist
        out = os.path.join(directory, tag + "_universal", "zero", "p")
        os.makedirs(out, exist_ok=True)
        for i in range(6):
            torch.save({"param": torch.zeros(10 + 100 * i)}, os.path.join(out, f"safe{i}.pt"))
        if case == "unsafe":
            torch.save({"param": torch.zeros(1), "x": _Evil()}, os.path.join(out, "evil.pt"))
        times["converted"] = time.time()
        return out

    def timed_leader_first(*args, **kwargs):
        out = original_leader_first(*args, **kwargs)
        times["went_on"] = time.time()   # a waiting rank leaves the wait here
        return out

    original_leader_first = ck.leader_first
    ck.ensure_universal, ck.leader_first = fake_convert, timed_leader_first
    lines = []
    dist.barrier()                       # pooled ranks take the body at different times: start together
    try:
        ck._convert_then_verify(root, "global_step5", "cpu", lines.append)
        outcome = "ok"
    except ck.CheckpointError as err:
        outcome = str(err)
    return rank, calls, outcome, times


def test_rank_zero_converts_the_others_wait_and_all_verify(tmp_path):
    results = spawn(_body, 2, str(tmp_path), "ok")
    assert [r[1] for r in results] == [["global_step5"], []], "exactly one converter: rank 0"
    assert all(r[2] == "ok" for r in results)
    # one host, one clock (a wait measured from each rank's own start would depend on when the pool
    # handed it the body)
    assert results[1][3]["went_on"] >= results[0][3]["converted"], \
        "rank 1 went on before rank 0's conversion had finished"


def test_an_unsafe_universal_file_is_one_line_on_every_rank(tmp_path):
    results = spawn(_body, 2, str(tmp_path), "unsafe")
    outcomes = collections.Counter(r[2] for r in results)
    assert len(outcomes) == 1, outcomes              # the same line everywhere, whoever verified the file
    (line, _), = outcomes.items()
    assert line.startswith("refusing to load ") and "evil.pt" in line and "\n" not in line, line


def test_a_failed_conversion_reaches_the_waiting_rank_as_one_line(tmp_path):
    results = spawn(_body, 2, str(tmp_path), "fails")
    assert results[0][2].endswith("has no ZeRO optimizer files (partial checkpoint?)"), results[0][2]
    assert results[1][2].startswith("rank 0 could not convert global_step5 in "), results[1][2]
    assert results[1][2].endswith("has no ZeRO optimizer files (partial checkpoint?)")
    assert all("\n" not in r[2] for r in results)
