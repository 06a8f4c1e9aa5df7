"""An emulated multi-node cluster on one Linux machine: one network namespace per node.

    with Cluster(ClusterSpec(nodes=2, ranks_per_node=2, inter_node="1gbit")) as c:
        c.run_in(0, ["ping", "-c1", c.address(1)])

Layout (all names start with the prefix, default ``mtds-``):

    mtds-n0: lo, eth0 10.77.0.1/24 ─┐                        ┌─ eth0 10.77.0.2/24, lo :mtds-n1
                  (htb rate + netem delay on egress)  mtds-br: br0 [n0, n1, ...]

The bridge sits in a namespace of its own rather than the root namespace: then the cluster adds no
interface, address or route to the host, the host's firewall (br_netfilter) never sees the traffic,
and deleting the namespaces removes everything. Ranks of one node talk over that node's loopback (the
kernel routes a node's own address through ``lo``); only traffic between nodes crosses ``eth0``,
whose byte counters are therefore the inter-node traffic.

Tear-down is guaranteed three ways: ``__exit__``, an ``atexit`` hook, and SIGINT/SIGTERM handlers
(installed while the cluster is up, from the main thread); ``remove_namespaces(prefix)`` (``mtds-cluster
down``) also clears what a killed process left behind, including processes still inside.
"""
from __future__ import annotations

import atexit
import signal
import subprocess
import threading
from dataclasses import dataclass

from mtds.cluster import netns, shaping

DEVICE = "eth0"          # a node's interface to the bridge (names are per namespace)


@dataclass(frozen=True)
class ClusterSpec:
    nodes: int = 2
    ranks_per_node: int = 1
    inter_node: str = "1gbit"      # tc rate of every node's link to the switch (each direction)
    latency: str = "0"             # one-way delay added to every packet leaving a node (needs netem)
    prefix: str = "mtds-"
    subnet: str = "10.77.0"        # /24, used only inside the namespaces

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.ranks_per_node < 1:
            raise ValueError("--nodes and --ranks-per-node must be at least 1")
        if self.nodes > 250:
            raise ValueError("at most 250 nodes fit the /24 subnet")
        shaping.rate_bits(self.inter_node)
        shaping.seconds(self.latency)

    @property
    def bridge_ns(self) -> str:
        return f"{self.prefix}br"

    def node_ns(self, i: int) -> str:
        return f"{self.prefix}n{i}"

    def address(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def link_bytes_per_s(self) -> float:
        return shaping.rate_bits(self.inter_node) / 8


class Cluster:
    """Context manager: bring the namespaces, links and shaping up; always take them down."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self._up = False
        self._procs: list[subprocess.Popen] = []
        self._old_handlers: dict = {}

    # -- lifecycle -------------------------------------------------------------------------------
    def up(self) -> "Cluster":
        reason = netns.unavailable_reason()
        if reason:
            raise netns.ClusterError(reason)
        s = self.spec
        if netns.namespaces(s.prefix):
            raise netns.ClusterError(f"namespaces with prefix {s.prefix!r} exist already "
                                     f"({', '.join(netns.namespaces(s.prefix))}); run `mtds-cluster down` first")
        self._up = True
        atexit.register(self.down)
        self._install_signal_handlers()
        try:
            self._build_network()
        except BaseException:
            self.down()
            raise
        return self

    def _build_network(self) -> None:
        s = self.spec
        names = [s.bridge_ns] + [s.node_ns(i) for i in range(s.nodes)]
        for name in names:
            netns.run("ip", "netns", "add", name)
            # No IPv6: its autoconfiguration chatter would show up on the link counters.
            netns.run("ip", "netns", "exec", name, "sh", "-c",
                      "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6; "
                      "echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6", check=False)
            netns.run("ip", "-n", name, "link", "set", "lo", "up")
        netns.run("ip", "-n", s.bridge_ns, "link", "add", "br0", "type", "bridge")
        netns.run("ip", "-n", s.bridge_ns, "link", "set", "br0", "up")
        for i in range(s.nodes):
            node, port = s.node_ns(i), f"n{i}"
            netns.run("ip", "-n", s.bridge_ns, "link", "add", port, "type", "veth", "peer", "name", DEVICE,
                      "netns", node)
            netns.run("ip", "-n", s.bridge_ns, "link", "set", port, "master", "br0")
            netns.run("ip", "-n", s.bridge_ns, "link", "set", port, "up")
            netns.run("ip", "-n", node, "addr", "add", f"{s.address(i)}/24", "dev", DEVICE)
            netns.run("ip", "-n", node, "link", "set", DEVICE, "up")
            shaping.shape(node, DEVICE, s.inter_node, s.latency)

    def down(self) -> None:
        """Stop what we launched, delete every namespace with our prefix. Safe to call twice."""
        for proc in self._procs:
            if proc.poll() is None:
                netns.kill_pids([proc.pid])
        self._procs.clear()
        if self._up:
            self._up = False
            netns.remove_namespaces(self.spec.prefix)
            self._restore_signal_handlers()
            atexit.unregister(self.down)

    def detach(self) -> None:
        """Leave the cluster up after this process ends (`mtds-cluster up`); `down` removes it."""
        self._up = False
        self._restore_signal_handlers()
        atexit.unregister(self.down)

    def __enter__(self) -> "Cluster":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old_handlers[sig] = signal.getsignal(sig)
            signal.signal(sig, self._on_signal)

    def _restore_signal_handlers(self) -> None:
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()

    def _on_signal(self, signum, frame) -> None:
        self.down()
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    # -- using it --------------------------------------------------------------------------------
    def address(self, i: int) -> str:
        return self.spec.address(i)

    def exec_prefix(self, i: int) -> list[str]:
        """The command prefix that runs a program inside node i."""
        return ["ip", "netns", "exec", self.spec.node_ns(i)]

    def popen(self, i: int, cmd: list[str], **kwargs) -> subprocess.Popen:
        """Start `cmd` inside node i; it is killed at tear-down if still running."""
        proc = subprocess.Popen(self.exec_prefix(i) + list(cmd), start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def run_in(self, i: int, cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.exec_prefix(i) + list(cmd), **kwargs)

    def link_stats(self) -> list[dict[str, int]]:
        """Per node: bytes/packets its link sent and received since the cluster came up."""
        return [netns.link_stats(self.spec.node_ns(i), DEVICE) for i in range(self.spec.nodes)]

    def status(self) -> str:
        return status(self.spec.prefix)


def status(prefix: str = "mtds-") -> str:
    """Human-readable state of every namespace with the prefix: addresses, shaping, counters."""
    names = netns.namespaces(prefix)
    if not names:
        return f"no emulated cluster (no network namespace starts with {prefix!r})"
    lines = []
    for name in names:
        if name.endswith("br"):
            lines.append(f"{name}: bridge br0")
            continue
        addr = netns.run("ip", "-n", name, "-br", "addr", "show", "dev", DEVICE, check=False).split()
        try:
            st = netns.link_stats(name, DEVICE)
            counters = f"tx {st['tx_bytes']:,} B, rx {st['rx_bytes']:,} B"
        except (netns.ClusterError, IndexError, KeyError, ValueError):
            counters = "no counters"
        pids = netns.pids_in(name)
        lines.append(f"{name}: {' '.join(addr[2:]) or 'no address'}; {counters}; {len(pids)} processes; "
                     f"{shaping.describe(name, DEVICE)}")
    return "\n".join(lines)
