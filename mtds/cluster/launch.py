"""DeepSpeed's multi-node launch, node by node, as on a real cluster without ssh (under a scheduler):

    hostfile:   node0 slots=R          (one line per node; R ranks per node)
                node1 slots=R
    node i:     deepspeed --hostfile H --no_ssh --node_rank i --master_addr <node 0> --master_port P script ...

Here "node i" is network namespace i, entered with ``ip netns exec``; ``GLOO_SOCKET_IFNAME`` points gloo
at the node's link (NCCL_SOCKET_IFNAME likewise on GPUs), so traffic between nodes uses that interface
and traffic inside a node its loopback.
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

from mtds.cluster.cluster import DEVICE, Cluster, ClusterSpec
from mtds.cluster.netns import kill_pids

DEFAULT_PORT = 29500     # ports are per namespace: no clash with anything on the host


def write_hostfile(spec: ClusterSpec, path: str) -> str:
    """DeepSpeed hostfile: `nodeI slots=R` per node (names only label nodes when --no_ssh is used)."""
    with open(path, "w") as f:
        f.writelines(f"node{i} slots={spec.ranks_per_node}\n" for i in range(spec.nodes))
    return path


def deepspeed_executable() -> list[str]:
    """The `deepspeed` launcher beside this Python (a venv's bin/), else the one on PATH."""
    local = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    if os.path.exists(local):
        return [local]
    found = shutil.which("deepspeed")
    return [found] if found else [sys.executable, "-m", "deepspeed.launcher.runner"]


def node_env(extra: dict | None = None) -> dict[str, str]:
    """What every node's launcher gets: the node's link for gloo/NCCL bootstrap sockets, one thread
    per rank unless set, this Python's bin/ first on PATH, plus `extra`."""
    env = {"GLOO_SOCKET_IFNAME": DEVICE, "NCCL_SOCKET_IFNAME": DEVICE,
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])}
    env.update(extra or {})
    return env


def node_commands(spec: ClusterSpec, hostfile: str, script: list[str], *, master_port: int = DEFAULT_PORT,
                  module: bool = False) -> list[list[str]]:
    """The deepspeed command of every node (without the namespace/env prefix)."""
    return [deepspeed_executable() + ["--hostfile", hostfile, "--no_ssh", "--node_rank", str(i),
                                      "--master_addr", spec.address(0), "--master_port", str(master_port),
                                      *(["--module"] if module else []), *script]
            for i in range(spec.nodes)]


def printable(cluster: Cluster, i: int, cmd: list[str], env: dict[str, str]) -> str:
    shown = {k: v for k, v in env.items() if k != "PATH"}
    return " ".join(cluster.exec_prefix(i) + ["env"] + [f"{k}={shlex.quote(v)}" for k, v in shown.items()]
                    + [shlex.quote(c) for c in cmd])


@dataclass
class NodeRun:
    node: int
    command: str
    log: str
    returncode: int | None


def launch(cluster: Cluster, script: list[str], *, out_dir: str, module: bool = False,
           env: dict | None = None, timeout: float = 1800.0, master_port: int = DEFAULT_PORT,
           echo=print, cwd: str | None = None) -> list[NodeRun]:
    """Start every node's launcher inside its namespace, wait for all; node i's output goes to
    out_dir/node{i}.log. When a node fails, the others get 20 s to notice, then are stopped; on
    timeout all are stopped (returncode None)."""
    spec = cluster.spec
    os.makedirs(out_dir, exist_ok=True)
    hostfile = write_hostfile(spec, os.path.join(out_dir, "hostfile"))
    full_env = node_env(env)
    runs, procs = [], []
    for i, cmd in enumerate(node_commands(spec, hostfile, script, master_port=master_port, module=module)):
        log = os.path.join(out_dir, f"node{i}.log")
        line = printable(cluster, i, cmd, full_env)
        if echo:
            echo(f"[cluster] node {i}: {line}")
        with open(log, "w") as f:
            procs.append(cluster.popen(i, ["env", *[f"{k}={v}" for k, v in full_env.items()], *cmd],
                                       stdout=f, stderr=subprocess.STDOUT, cwd=cwd))
        runs.append(NodeRun(i, line, log, None))
    wait_for_nodes(procs, timeout)
    for run, proc in zip(runs, procs):
        run.returncode = proc.poll()
    return runs


def failure_summary(runs: list[NodeRun], lines: int = 25) -> str:
    """'' when every node exited 0; else which failed and the tail of the first failing log."""
    bad = [r for r in runs if r.returncode != 0]
    if not bad:
        return ""
    with open(bad[0].log) as f:
        tail = "".join(f.readlines()[-lines:])
    codes = ", ".join(f"node {r.node}: {'timeout' if r.returncode is None else r.returncode}" for r in bad)
    return f"{codes}; last output of node {bad[0].node}:\n{tail}"


def wait_for_nodes(procs, timeout: float, grace: float = 20.0) -> None:
    """Wait for every node's launcher; past ``timeout``, or ``grace`` seconds after one node failed (the others
    would wait for it in a collective), kill the ones still running."""
    deadline, failed_at = time.monotonic() + timeout, None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
            failed_at = now
        if now > deadline or (failed_at is not None and now - failed_at > grace):
            kill_pids([p.pid for p in procs if p.poll() is None])
            break
        time.sleep(0.1)
