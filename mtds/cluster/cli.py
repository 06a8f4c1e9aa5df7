"""`mtds-cluster`: an emulated multi-node cluster on this machine (root + iproute2).

  up        create the nodes (network namespaces), links and shaping; they stay until `down`
  down      stop processes inside and delete every namespace with the prefix (also a crashed run's)
  status    addresses, shaping, link byte counters, processes per node
  run       up, launch a script on every node with DeepSpeed's multi-node launcher, report link
            bytes, down (also on Ctrl-C)
  selftest  up, all-reduce across the nodes, compare link bytes with the ring formula, down
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import textwrap

from mtds.parallel import ring

from mtds.cluster.cluster import Cluster, ClusterSpec, status
from mtds.cluster.launch import failure_summary, launch, node_commands, node_env, printable, write_hostfile
from mtds.cluster.netns import ClusterError, remove_namespaces

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # has mtds/

EXAMPLES = textwrap.dedent("""\
    examples:
      mtds-cluster up --nodes 2 --ranks-per-node 2 --inter-node 1gbit
      mtds-cluster status
      mtds-cluster down
      mtds-cluster selftest --nodes 2 --ranks-per-node 2 --inter-node 100mbit
      mtds-cluster run --nodes 2 --ranks-per-node 2 --inter-node 1gbit -- train.py \\
          --deepspeed_config ds_configs/cpu_fp32.json --tp 2 --pp 2 --steps 5
    """)


def _spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=1)
    p.add_argument("--inter-node", default="1gbit", help="link rate per node and direction, tc units [1gbit]")
    p.add_argument("--latency", default="0", help="one-way delay per packet, e.g. 0.2ms (needs netem) [0]")
    p.add_argument("--prefix", default="mtds-", help="namespace name prefix [mtds-]")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mtds-cluster", description=__doc__, epilog=EXAMPLES,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    _spec_args(sub.add_parser("up", help="create the emulated nodes"))
    for name in ("down", "status"):
        sub.add_parser(name).add_argument("--prefix", default="mtds-")
    run = sub.add_parser("run", help="launch a script on every node (deepspeed --no_ssh per node)")
    _spec_args(run)
    run.add_argument("--module", action="store_true", help="the script is a module (deepspeed --module)")
    run.add_argument("--out", default="runs/cluster", help="hostfile and per-node logs [runs/cluster]")
    run.add_argument("--timeout", type=float, default=1800.0)
    run.add_argument("script", nargs=argparse.REMAINDER, help="-- script.py [its arguments]")
    st = sub.add_parser("selftest", help="all-reduce across the nodes and check the link bytes")
    _spec_args(st)
    st.add_argument("--numel", type=int, default=1 << 20, help="fp32 values all-reduced [1048576]")
    return ap


def _spec(args) -> ClusterSpec:
    return ClusterSpec(nodes=args.nodes, ranks_per_node=args.ranks_per_node, inter_node=args.inter_node,
                       latency=args.latency, prefix=args.prefix)


def cmd_up(args) -> int:
    cluster = Cluster(_spec(args)).up()
    cluster.detach()               # stays up after we exit; `mtds-cluster down` removes it
    spec = cluster.spec
    hostfile = write_hostfile(spec, os.path.join(tempfile.gettempdir(), f"{spec.prefix}hostfile"))
    print(status(spec.prefix))
    print(f"hostfile {hostfile}; start one launcher per node, e.g. for train.py:")
    for i, cmd in enumerate(node_commands(spec, hostfile, ["train.py", "..."])):
        print("  " + printable(cluster, i, cmd, node_env()))
    return 0


def cmd_run(args) -> int:
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script:
        raise ValueError("nothing to run: give the script after --, e.g. `-- train.py --tp 2`")
    with Cluster(_spec(args)) as cluster:
        runs = launch(cluster, script, out_dir=args.out, module=args.module, timeout=args.timeout,
                      env={"PYTHONPATH": os.pathsep.join(dict.fromkeys(filter(None, [
                          os.getcwd(), *os.environ.get("PYTHONPATH", "").split(os.pathsep)])))})
        stats = cluster.link_stats()
    for i, st in enumerate(stats):
        print(f"[cluster] node {i} link: sent {st['tx_bytes']:,} B, received {st['rx_bytes']:,} B")
    problem = failure_summary(runs)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    return 0


def ring_allreduce_node_bytes(spec: ClusterSpec, nbytes: int) -> float:
    """Bytes each node's link sends in a ring all-reduce over all ranks (ranks numbered node by node):
    every ring edge carries 2 (n-1)/n x nbytes (mtds.parallel.ring), and exactly one edge leaves each node."""
    return ring.all_reduce(nbytes, spec.world) if spec.nodes > 1 else 0.0


def cmd_selftest(args) -> int:
    spec = _spec(args)
    with tempfile.TemporaryDirectory() as out, Cluster(spec) as cluster:
        runs = launch(cluster, ["mtds.cluster.selftest", out, str(args.numel)], out_dir=out, module=True,
                      timeout=300, env={"PYTHONPATH": PACKAGE_ROOT})
        problem = failure_summary(runs)
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 1
        nodes = [json.load(open(os.path.join(out, f"node{i}.json"))) for i in range(spec.nodes)]
    expected = ring_allreduce_node_bytes(spec, 4 * args.numel)
    for n in nodes:
        print(f"node {n['node']}: all-reduce of {4 * args.numel:,} B over {n['world']} ranks: link sent "
              f"{n['tx_bytes']:,} B (ring formula {expected:,.0f} B, {n['tx_bytes'] / expected - 1:+.2%}), "
              f"{n['seconds'] * 1e3:.1f} ms, result {'correct' if n['correct'] else 'WRONG'}")
    return 0 if all(n["correct"] for n in nodes) else 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "down":
            removed = remove_namespaces(args.prefix)
            print(f"removed {', '.join(removed)}" if removed else f"nothing to remove (no {args.prefix}* namespace)")
            return 0
        if args.command == "status":
            print(status(args.prefix))
            return 0
        return {"up": cmd_up, "run": cmd_run, "selftest": cmd_selftest}[args.command](args)
    except (ClusterError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

