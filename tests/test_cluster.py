"""The emulated cluster (mtds.cluster): namespaces, links and shaping come up and always go away; bytes
on the node links are what a ring all-reduce must move; DeepSpeed's multi-node launcher trains across
nodes with the losses of the same run on one host, and the link carries what the formulas say.

Needs root and iproute2 (CI runs as root); without them every test here skips with that reason."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from mtds.cluster import Cluster, ClusterError, ClusterSpec, remove_namespaces, unavailable_reason
from mtds.cluster import netns
from mtds.cluster.cli import ring_allreduce_node_bytes
from mtds.cluster.launch import failure_summary, launch
from mtds.cluster.shaping import describe

REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"emulated cluster unavailable: {REASON}")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREFIX = f"mtds-t{os.getpid()}-"      # never touches a cluster someone else has up
# What TCP/IP adds on the veth counters to a payload (measured 0.26-0.31% for 4 MiB at 2x1 and 2x2:
# the counters see GSO segments of up to 64 KiB, so headers are counted once per segment).
LINK_OVERHEAD = 0.01


def _alive(pid):
    return netns._alive(pid)


def _leftovers(prefix=PREFIX):
    return netns.namespaces(prefix)


def test_up_down_nothing_left_after_a_killed_process():
    spec = ClusterSpec(nodes=2, ranks_per_node=1, inter_node="100mbit", prefix=PREFIX)
    with Cluster(spec) as c:
        assert _leftovers() == [f"{PREFIX}br", f"{PREFIX}n0", f"{PREFIX}n1"]
        addr = netns.run("ip", "-n", spec.node_ns(1), "-br", "addr", "show", "dev", "eth0")
        assert "10.77.0.2/24" in addr
        assert "rate 100Mbit" in describe(spec.node_ns(0), "eth0")
        victim = c.popen(1, ["sleep", "300"])
        survivor = c.popen(0, ["sleep", "300"])
        time.sleep(0.2)
        assert victim.pid in netns.pids_in(spec.node_ns(1))
        os.kill(victim.pid, signal.SIGKILL)          # a rank dies inside a node
        victim.wait()
    assert _leftovers() == [] and not _alive(survivor.pid)
    Cluster(spec).down()                             # idempotent


def test_latency_needs_netem_and_fails_cleanly_without_it():
    spec = ClusterSpec(nodes=2, inter_node="1gbit", latency="0.2ms", prefix=PREFIX)
    try:
        with Cluster(spec):
            assert "netem" in describe(spec.node_ns(0), "eth0") and "delay 200us" in describe(spec.node_ns(0), "eth0")
    except ClusterError as err:       # this kernel lacks sch_netem: one line, nothing left behind
        assert "netem" in str(err) and "--latency 0" in str(err)
    assert _leftovers() == []


_HOLDER = """
import sys, time
from mtds.cluster import Cluster, ClusterSpec
c = Cluster(ClusterSpec(nodes=2, prefix=sys.argv[1])).up()
p = c.popen(0, ["sleep", "300"])
print(p.pid, flush=True)
time.sleep(300)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_signal_tears_down_and_down_cleans_a_crashed_run(sig):
    """SIGTERM: the holder's handler tears the cluster down. SIGKILL: nothing can run, the namespaces
    and the process inside survive, and `mtds-cluster down` removes both."""
    env = {**os.environ, "PYTHONPATH": REPO}
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, PREFIX], stdout=subprocess.PIPE, text=True, env=env)
    inner = int(holder.stdout.readline())
    assert len(_leftovers()) == 3 and _alive(inner)
    holder.send_signal(sig)
    holder.wait(timeout=30)
    if sig == signal.SIGKILL:
        assert len(_leftovers()) == 3 and _alive(inner)           # a crashed run's leftovers
        down = subprocess.run([sys.executable, "-m", "mtds.cluster", "down", "--prefix", PREFIX],
                              capture_output=True, text=True, env=env)
        assert down.returncode == 0 and f"{PREFIX}n0" in down.stdout
    time.sleep(0.2)
    assert _leftovers() == [] and not _alive(inner)
    assert remove_namespaces(PREFIX) == []


def test_allreduce_link_bytes_match_the_ring(tmp_path):
    """2 nodes x 2 ranks, gloo through DeepSpeed's launcher: each node's link sends 2(n-1)/n x S."""
    spec = ClusterSpec(nodes=2, ranks_per_node=2, inter_node="1gbit", prefix=PREFIX)
    numel = 1 << 20
    with Cluster(spec) as c:
        runs = launch(c, ["mtds.cluster.selftest", str(tmp_path), str(numel)], module=True, out_dir=str(tmp_path),
                      env={"PYTHONPATH": REPO}, timeout=180, echo=None)
    assert failure_summary(runs) == ""
    expected = ring_allreduce_node_bytes(spec, 4 * numel)
    assert expected == 1.5 * 4 * numel
    for i in range(2):
        node = json.loads((tmp_path / f"node{i}.json").read_text())
        assert node["correct"] and node["world"] == 4
        assert expected <= node["tx_bytes"] <= expected * (1 + LINK_OVERHEAD), (node, expected)
    assert _leftovers() == []
