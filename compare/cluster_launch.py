"""Launch one scheme on an emulated cluster (mtds.cluster) the way a real cluster is used: DeepSpeed's
launcher once per node (``--hostfile --no_ssh --node_rank i``), each inside its node's namespace; the
ranks run ``compare.entry`` (train.py's CLI with the collective counter) and also read their node's
link counters around every step."""
from __future__ import annotations

import os
import time

from mtds.cluster import Cluster
from mtds.cluster.cluster import DEVICE
from mtds.cluster.launch import failure_summary, launch as launch_nodes

from .launch import effective_config, entry_args
from .schemes import REPO, Scheme


def launch_on_cluster(cluster: Cluster, scheme: Scheme, *, model: str, steps: int, seq_length: int, out_dir: str,
                      global_batch: int | None = None, micro_batch: int | None = None, extra: list[str] = (),
                      timeout: float = 3600.0, echo=print) -> dict:
    """Run the scheme on every node of the cluster; same return value as compare.launch.launch."""
    scheme.data_parallel(cluster.spec.world)
    os.makedirs(out_dir, exist_ok=True)
    config = effective_config(scheme, out_dir, global_batch, micro_batch)
    script = entry_args(scheme, config=config, model=model, steps=steps, seq_length=seq_length, out_dir=out_dir,
                        extra=extra)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
           "MTDS_LINK_DEVICE": DEVICE, "MTDS_RANKS_PER_NODE": str(cluster.spec.ranks_per_node)}
    start = time.monotonic()
    runs = launch_nodes(cluster, script, out_dir=out_dir, module=True, env=env, timeout=timeout, echo=echo, cwd=REPO)
    problem = failure_summary(runs)
    if problem:
        raise RuntimeError(f"{scheme.name} failed on the cluster: {problem}")
    return {"scheme": scheme, "log": os.path.join(out_dir, "log.jsonl"), "probe_dir": os.path.join(out_dir, "probe"),
            "config": config, "wall_s": time.monotonic() - start, "commands": [r.command for r in runs]}
