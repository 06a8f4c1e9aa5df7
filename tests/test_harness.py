"""The multi-rank runner itself: results come back, failures and hangs surface as RankFailure."""
import os
import time

import pytest
import torch.distributed as dist

from tests.dist import RankFailure, spawn


def _rank_and_world():
    return dist.get_rank(), dist.get_world_size()


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")
    return "ok"


def _hang_on_rank_zero():
    if dist.get_rank() == 0:
        time.sleep(120)
    return "ok"


def _die_hard():
    if dist.get_rank() == 1:
        os._exit(3)
    time.sleep(60)


@pytest.mark.parametrize("n", [1, 3])
def test_results_in_rank_order(n):
    assert spawn(_rank_and_world, n) == [(r, n) for r in range(n)]


def test_failing_rank_reports_its_traceback():
    with pytest.raises(RankFailure) as err:
        spawn(_fail_on_rank_one, 2, timeout=60)
    assert "rank 1 failed" in str(err.value) and "boom on rank one" in str(err.value)


def test_hanging_rank_times_out():
    spawn(_rank_and_world, 2)      # live ranks first: the clock times the timeout, not the start of a new pool
    start = time.monotonic()
    with pytest.raises(RankFailure, match="did not finish within 5 s"):
        spawn(_hang_on_rank_zero, 2, timeout=5)
    assert time.monotonic() - start < 40


def test_killed_rank_is_noticed_quickly():
    spawn(_rank_and_world, 2)      # live ranks first (the previous test's failure took its pool down)
    start = time.monotonic()
    with pytest.raises(RankFailure, match="rank 1 failed"):
        spawn(_die_hard, 2, timeout=50)
    assert time.monotonic() - start < 40


def test_a_rendezvous_port_taken_meanwhile_is_retried(monkeypatch):
    import socket

    import mtds.local_ranks.spawn as testing
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy = taken.getsockname()[1]
    try:
        ports = iter([busy, testing.free_port()])
        monkeypatch.setattr(testing, "free_port", lambda: next(ports))
        assert spawn(_rank_and_world, 2, fresh=True) == [(0, 2), (1, 2)]
        # a port that stays taken is a failure, named, after the last attempt
        monkeypatch.setattr(testing, "free_port", lambda: busy)
        with pytest.raises(RankFailure, match="EADDRINUSE"):
            spawn(_rank_and_world, 2, timeout=60, fresh=True)
    finally:
        taken.close()


_FORKSERVER_ENV_CHILD = """
import os
from lab.testing import spawn

def body():
    # a forked CPU rank's parent is the forkserver; its environment is what the preloaded imports saw
    with open(f"/proc/{os.getppid()}/environ", "rb") as f:
        env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\\0") if b"=" in kv)
    return env.get(b"CUDA_VISIBLE_DEVICES")

if __name__ == "__main__":
    print("forkserver CUDA_VISIBLE_DEVICES=%r" % spawn(body, 1, on="cpu", timeout=120)[0])
    print("parent CUDA_VISIBLE_DEVICES=%r" % os.environ.get("CUDA_VISIBLE_DEVICES"))
"""


def test_cpu_ranks_forkserver_starts_with_gpus_hidden(tmp_path):
    """CPU ranks fork from a forkserver that preloads DeepSpeed, which asks torch for the device count. Started
    where a GPU is visible (``python -m mtds.gpucheck --device cpu`` on a GPU machine), it must already hide
    the GPUs, or every rank forked from it fails "No CUDA GPUs are available" (seen on an H100). A fresh
    interpreter with CUDA_VISIBLE_DEVICES unset stands in for that machine; the caller's own value is kept."""
    import subprocess
    import sys
    script = tmp_path / "child.py"
    script.write_text(_FORKSERVER_ENV_CHILD)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))
    env["MTDS_TEST_POOL"] = "0"
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "forkserver CUDA_VISIBLE_DEVICES=b''" in out.stdout, out.stdout
    assert "parent CUDA_VISIBLE_DEVICES=None" in out.stdout, out.stdout
