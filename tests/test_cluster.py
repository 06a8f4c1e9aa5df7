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
        # `ip netns exec` joins the namespace once it gets a CPU: wait for that, not for a fixed time
        deadline = time.monotonic() + 30
        while victim.pid not in netns.pids_in(spec.node_ns(1)) and time.monotonic() < deadline:
            time.sleep(0.05)
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


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_signal_tears_down_and_down_cleans_a_crashed_run(sig):
    """SIGINT (Ctrl-C) / SIGTERM: the holder's handler tears the cluster down. SIGKILL: nothing can run, the namespaces
    and the process inside survive, and `mtds-cluster down` removes both."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
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


TINY_GPT2 = {"model_type": "gpt2", "vocab_size": 8192, "n_embd": 64, "n_layer": 2, "n_head": 2, "n_positions": 64,
             "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
TINY_PARAMS = 8192 * 64 + 64 * 64 + 2 * (12 * 64 * 64 + 13 * 64) + 2 * 64     # wte, wpe, 2 blocks, final norm
# Link bytes above the formulas: TCP/IP headers (0.3%, see LINK_OVERHEAD) plus the small collectives the
# formulas leave out (loss broadcast, grad-norm scalars, DeepSpeed's activation-partition metadata).
# Measured +0.7% (PTD-P) and +1.4% (ZeRO-3) per step; the bound is 3%.
STEP_OVERHEAD = 0.03


def _host_losses(flags):
    from mtds.training import run
    from mtds.training.cli import build_parser, config_from_args
    return run(config_from_args(build_parser().parse_args(flags))).losses


def _ranks(out_dir):
    return [json.loads(p.read_text()) for p in sorted((out_dir / "probe").glob("rank*.json"))]


def test_launcher_trains_across_nodes_with_single_host_losses_and_formula_link_bytes(tmp_path):
    """2 nodes x 2 ranks through `deepspeed --hostfile --no_ssh --node_rank i` in each namespace:
    PTD-P (t=2 in a node, p=2 across) and ZeRO-3 (d=4) train with the losses of the same model, data and
    seed on one host (1 rank), and each node's link carries the formula's bytes per step."""
    from compare.cluster_launch import launch_on_cluster
    from compare.launch import effective_config, entry_args
    from compare.schemes import parse_scheme
    from compare.sweep import link_formula
    from lab.testing import spawn
    from mtds.cluster.formulas import ptdp_link_bytes, zero3_link_bytes
    model = tmp_path / "config.json"
    model.write_text(json.dumps(TINY_GPT2))
    common = dict(model=str(model), steps=3, seq_length=32, global_batch=8, micro_batch=2, timeout=300)
    # The one-host run: compare.entry's train.py flags for (1,1,1) on a warm pooled rank (a launcher's start-up
    # is what the cluster runs below test; the same flags give the same losses in either process)
    host, one = tmp_path / "host", parse_scheme("ptdp:tp=1")
    host.mkdir()
    flags = entry_args(one, config=effective_config(one, str(host), 8, 2), model=str(model), steps=3, seq_length=32,
                       out_dir=str(host))[2:]
    ref_losses = spawn(_host_losses, 1, flags, timeout=300)[0]
    assert len(ref_losses) == 3
    spec = ClusterSpec(nodes=2, ranks_per_node=2, inter_node="1gbit", prefix=PREFIX)
    expected = {"ptdp:tp=2,pp=2": ptdp_link_bytes(microbatches=4, micro_batch=2, seq=32, hidden=64, vocab=8192,
                                                 tp=2, pp=2, nodes=2),
                "zero3": zero3_link_bytes(params=TINY_PARAMS, world=4, nodes=2)}
    for name, formula in expected.items():     # the formula `compare run --nodes` puts beside its cells
        assert link_formula(parse_scheme(name), str(model), 32, 8, 2, spec) == formula, name
    with Cluster(spec) as c:
        for name, formula in expected.items():
            out = tmp_path / name.replace(":", "_")
            launch_on_cluster(c, parse_scheme(name), out_dir=str(out), echo=None, **common)
            ranks = _ranks(out)
            assert len(ranks) == 4
            for r in ranks:
                assert len(r["losses"]) == 3
                for got, want in zip(r["losses"], ref_losses):
                    assert abs(got - want) <= 1e-5 * abs(want), (name, r["losses"], ref_losses)
            for node in (0, 2):          # global rank 0 and 2 are the first rank of node 0 and node 1
                steps = ranks[node]["link_per_step"][1:]     # step 1 of ZeRO-3 records its fetch order
                per_step = sum(s["tx_bytes"] for s in steps) / len(steps)
                assert formula * 0.99 <= per_step <= formula * (1 + STEP_OVERHEAD), (name, node, per_step, formula)
                # The tracer's placement split: what the node's ranks send to the other node equals the
                # counters (less the protocol overhead) and the formula.
                traced = sum(v["inter_bytes"] for r in ranks[node:node + 2] for step in r["comm_per_step"][1:]
                             for v in step.values()) / len(steps)
                assert traced * 0.99 <= per_step <= traced * (1 + STEP_OVERHEAD), (name, node, per_step, traced)
                assert formula * 0.99 <= traced <= formula * (1 + STEP_OVERHEAD), (name, node, traced, formula)
            _check_split_and_state(name, ranks, out)
    assert _leftovers() == []


def _check_split_and_state(name, ranks, out):
    """Per-collective placement and model-state bytes of the 2 x 2 launches (fp32 AdamW)."""
    from compare.state import formula
    last = ranks[0]["comm_per_step"][-1]
    if name.startswith("ptdp"):
        # t = 2 inside a node: TP all-reduces stay on loopback; the pipeline sends cross; ZeRO-1 at d = 1
        assert last["all_reduce/tp"]["inter_bytes"] == 0 and last["all_reduce/tp"]["intra_bytes"] > 0, last
        assert last["send/world"]["intra_bytes"] == 0 and last["send/world"]["inter_bytes"] > 0, last
        bubble = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()][-1]
        assert 0 < bubble["bubble"] < 1 and len(bubble["bubble_per_stage"]) == 2, bubble
        zero, d = 1, 1
    else:
        # ring over world (0 1 2 3): rank 0 sends to rank 1 (same node), rank 1 to rank 2 (across)
        assert last["all_gather/dp"]["inter_bytes"] == 0 and ranks[1]["comm_per_step"][-1]["all_gather/dp"]["intra_bytes"] == 0
        zero, d = 3, 4
    for r in ranks:
        state = r["model_state"]
        want = formula("fp32", zero, state["psi"], d, state["psi_persistent"])
        for key in ("params", "grads", "optimizer"):      # padded partitions, small buffers: 2%
            assert want[key] <= state[key] <= want[key] * 1.02 + 64, (name, r["rank"], key, state, want)


def _rank_pids(namespace):
    """PIDs of the training ranks (not the launchers) running inside a node."""
    out = []
    for pid in netns.pids_in(namespace):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
        except OSError:
            continue
        if b"mtds.cluster.selftest" in cmd and any(a.startswith(b"--local_rank") for a in cmd):
            out.append(pid)
    return out


def test_a_killed_rank_fails_the_run_and_teardown_leaves_nothing(tmp_path):
    """Kill one rank mid all-reduce (a 128 MB all-reduce over a 100mbit link takes ~20 s): the launch
    returns a failure naming the node instead of hanging, and the cluster goes away completely."""
    spec = ClusterSpec(nodes=2, ranks_per_node=1, inter_node="100mbit", prefix=PREFIX)
    with Cluster(spec) as c:
        import threading
        result = {}
        worker = threading.Thread(target=lambda: result.update(runs=launch(
            c, ["mtds.cluster.selftest", str(tmp_path), str(32 << 20)], module=True, out_dir=str(tmp_path),
            env={"PYTHONPATH": REPO}, timeout=120, echo=None)))
        worker.start()
        deadline = time.monotonic() + 60
        while not (_rank_pids(spec.node_ns(1)) and c.link_stats()[1]["tx_bytes"] > 1 << 20):
            assert time.monotonic() < deadline, "the all-reduce never started"
            time.sleep(0.2)
        victim = _rank_pids(spec.node_ns(1))[0]
        os.kill(victim, signal.SIGKILL)
        worker.join(timeout=90)
        assert not worker.is_alive(), "the launch hung after a rank was killed"
        assert "node 1" in failure_summary(result["runs"]) and not (tmp_path / "node0.json").exists()
    assert _leftovers() == [] and not _alive(victim)
