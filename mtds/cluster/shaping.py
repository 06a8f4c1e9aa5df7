"""Link speeds and latencies as ``tc`` spells them, and the qdiscs that impose them.

Each node's interface shapes what the node sends: an HTB class at the link rate (the node's NIC),
and below it a netem queue that delays every packet by the one-way latency. Traffic from node A to
node B is therefore shaped once (on A's side); the bridge between them forwards without limit, like
a non-blocking switch. Latency needs the netem qdisc; kernels built without it (CONFIG_NET_SCH_NETEM
unset, as on the machine this was developed on) can only run with latency 0, and say so.
"""
from __future__ import annotations

import re

from mtds.cluster.netns import ClusterError, run

_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit)$")
_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}   # tc's SI units
_TIME = re.compile(r"^(\d+(?:\.\d+)?)(s|ms|us)$")
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


def rate_bits(text: str) -> float:
    """'1gbit' -> 1e9 (bits per second, SI as in tc)."""
    m = _RATE.match(text.strip().lower())
    if not m:
        raise ValueError(f"bad link rate {text!r}: use a number and one of bit, kbit, mbit, gbit (e.g. 1gbit)")
    return float(m.group(1)) * _RATE_UNITS[m.group(2)]


def seconds(text: str) -> float:
    """'0.2ms' -> 2e-4."""
    if text.strip() == "0":
        return 0.0
    m = _TIME.match(text.strip().lower())
    if not m:
        raise ValueError(f"bad latency {text!r}: use a number and one of s, ms, us (e.g. 0.2ms)")
    return float(m.group(1)) * _TIME_UNITS[m.group(2)]


def shape(namespace: str, device: str, rate: str, latency: str) -> None:
    """Rate-limit and delay what `device` sends (HTB root class + netem leaf)."""
    bits = rate_bits(rate)
    # Burst of ~1 ms at the line rate (at least 64 KiB, one GSO segment), so HTB reaches the rate
    # with coarse timers; netem's queue holds a bandwidth-delay product of large segments.
    burst = max(65536, int(bits / 8 * 1e-3))
    usec = round(seconds(latency) * 1e6)
    run("ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device, "root", "handle", "1:", "htb",
        "default", "10")
    run("ip", "netns", "exec", namespace, "tc", "class", "add", "dev", device, "parent", "1:", "classid", "1:10",
        "htb", "rate", rate, "ceil", rate, "burst", str(burst), "cburst", str(burst))
    if usec == 0:
        return
    try:
        run("ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device, "parent", "1:10", "handle", "10:",
            "netem", "delay", f"{usec}us", "limit", "100000")
    except ClusterError as err:
        if "unknown" not in str(err):
            raise
        raise ClusterError(f"this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM), so latency {latency} cannot be "
                           f"added; use --latency 0 (links are then only rate-shaped)") from None


def describe(namespace: str, device: str) -> str:
    """One line per qdisc/class on the device, as tc prints them."""
    q = run("ip", "netns", "exec", namespace, "tc", "qdisc", "show", "dev", device, check=False)
    c = run("ip", "netns", "exec", namespace, "tc", "class", "show", "dev", device, check=False)
    return " | ".join(line.strip() for line in (q + c).splitlines() if line.strip())
