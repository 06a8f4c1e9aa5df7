"""mtds.training.cpu_allocator: on glibc, a large freed block stays in the process for the next step instead of being
unmapped (and page-faulted in again); left alone when the user opts out or tuned glibc themselves."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mtds.training.cpu_allocator import tune_cpu_allocator

PROBE = r"""
import json, sys
import torch
from mtds.training.cpu_allocator import tune_cpu_allocator

def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))

said = tune_cpu_allocator()
x = torch.ones(64 * 2 ** 20 // 4)       # 64 MiB, every page touched
before = rss()
del x
print(json.dumps({"said": said, "released": before - rss()}))
"""


def _probe(**env) -> dict:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "MTDS_CPU_MALLOC"))}
    full.update(env)
    out = subprocess.run([sys.executable, "-c", PROBE], env=full, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_a_freed_64_mib_block_stays_for_reuse_only_when_tuned():
    tuned, default = _probe(), _probe(MTDS_CPU_MALLOC="0")
    assert tuned["said"] and "256 MiB" in tuned["said"], tuned
    assert default["said"] is None
    # glibc's default serves 64 MiB with mmap and unmaps it on free; tuned, the heap keeps it
    assert default["released"] > 60 * 2 ** 20, default
    assert tuned["released"] < 4 * 2 ** 20, tuned


def test_left_alone_when_the_user_tuned_glibc_or_opted_out():
    assert tune_cpu_allocator({"MTDS_CPU_MALLOC": "0"}) is None
    assert tune_cpu_allocator({"MALLOC_MMAP_THRESHOLD_": "131072"}) is None
    assert tune_cpu_allocator({"MALLOC_TRIM_THRESHOLD_": "0"}) is None
