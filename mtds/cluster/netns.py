"""Thin wrappers over iproute2 (``ip``, ``tc``) for the namespaces an emulated cluster owns.

Every object this module creates lives inside a network namespace whose name starts with the
cluster's prefix (``mtds-`` by default); nothing is added to the root namespace, so removing those
namespaces removes everything, and no traffic can reach a real network.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time


class ClusterError(RuntimeError):
    """A cluster cannot be built or used here; the message says why in one line."""


def unavailable_reason() -> str | None:
    """Why an emulated cluster cannot run on this machine, or None when it can."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (`ip`, `tc`) is not installed; install it (e.g. `apt-get install -y iproute2`)"
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, or in a container with CAP_NET_ADMIN)"
    return None


def run(*args: str, check: bool = True) -> str:
    """Run one iproute2 command; raise ClusterError with its message when it fails."""
    proc = subprocess.run(list(args), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise ClusterError(f"`{' '.join(args)}` failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def namespaces(prefix: str) -> list[str]:
    """Names of the existing network namespaces that start with `prefix`."""
    out = run("ip", "-j", "netns", "list", check=False).strip()
    names = [entry["name"] for entry in json.loads(out)] if out else []
    return sorted(n for n in names if n.startswith(prefix))


def pids_in(namespace: str) -> list[int]:
    return [int(p) for p in run("ip", "netns", "pids", namespace, check=False).split()]


def kill_pids(pids: list[int], grace_s: float = 3.0) -> None:
    """SIGTERM the given processes, then SIGKILL whatever is still alive after `grace_s`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = []
        for pid in pids:
            try:
                os.kill(pid, sig)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive or sig == signal.SIGKILL:
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(_alive(p) for p in alive):
            time.sleep(0.05)
        pids = [p for p in alive if _alive(p)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:   # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def remove_namespaces(prefix: str) -> list[str]:
    """Kill the processes left inside every `prefix` namespace, then delete the namespaces (and with
    them their veth ends and bridge). Idempotent: returns the names removed, [] when none were left."""
    names = namespaces(prefix)
    for name in names:
        kill_pids(pids_in(name))
    for name in names:
        run("ip", "netns", "del", name, check=False)
    return names


def link_stats(namespace: str, device: str) -> dict[str, int]:
    """Bytes and packets the device sent and received (kernel counters, ``ip -s -j link``)."""
    out = run("ip", "-n", namespace, "-s", "-j", "link", "show", "dev", device)
    stats = json.loads(out)[0]["stats64"]
    return {"tx_bytes": stats["tx"]["bytes"], "rx_bytes": stats["rx"]["bytes"],
            "tx_packets": stats["tx"]["packets"], "rx_packets": stats["rx"]["packets"]}


def own_link_stats(device: str) -> dict[str, int]:
    """The same counters read from inside the namespace the caller runs in (sysfs, no subprocess)."""
    base = f"/sys/class/net/{device}/statistics"
    out = {}
    for key in ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets"):
        with open(os.path.join(base, key)) as f:
            out[key] = int(f.read())
    return out


def boundary_link_stats(device: str, barrier) -> dict[str, int]:
    """``own_link_stats`` at a point every rank has reached, between two calls of ``barrier`` (e.g.
    ``torch.distributed.barrier``). One rank's own step edges are no such point: a node's link also
    carries what the node's other ranks send (on a ring, the node's last rank sends across), and a rank
    that starts the next step while the reader is still between steps has its first sends counted in
    no step at all. After the first barrier every earlier collective has finished on every rank (its
    bytes were received, so they passed the counter); the second keeps every rank from sending what
    comes next until every node's reader has read."""
    barrier()
    stats = own_link_stats(device)
    barrier()
    return stats
