"""Session set-up of the test-suite: where multi-rank bodies run, and on which device.

``MTDS_TEST_DEVICE``: ``cpu`` (default; gloo, and CUDA hidden from every process of the suite so that
training cannot pick a GPU the harness does not use) or ``cuda`` (NCCL, one rank per GPU; tests whose
world size exceeds the GPUs present are skipped with that reason; TF32 off through
``NVIDIA_TF32_OVERRIDE=0``, since the suite holds fp32 to 1e-5 of the fp32 reference and mtds's fp32 runs
use TF32 on CUDA by default -- an H100 showed a 1.2e-4 grad-norm difference with it on).
``MTDS_TEST_POOL=0``: start fresh processes for every multi-rank body instead of the live pools.
``MTDS_TEST_CPU_REPORT=FILE``: each test's wall and machine-wide CPU seconds as JSON lines (lab/testing/cpu_report.py).
"""
import os
import subprocess

import pytest

from lab import testing

_launches = {"subprocess": 0}
_popen_init = subprocess.Popen.__init__


def _counting_popen_init(self, *args, **kwargs):
    _launches["subprocess"] += 1
    _popen_init(self, *args, **kwargs)


def pytest_configure(config):
    device = os.environ.get("MTDS_TEST_DEVICE", "cpu")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"MTDS_TEST_DEVICE must be cpu or cuda, got {device!r}")
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    else:
        os.environ["NVIDIA_TF32_OVERRIDE"] = "0"     # read by cuBLAS/cuDNN in every rank: exact fp32 products
    os.environ["MTDS_TEST_DEVICE"] = device
    if os.environ.get("MTDS_TEST_CPU_REPORT"):       # where the time goes (lab/testing/cpu_report.py)
        from lab.testing.cpu_report import CpuReport
        config.pluginmanager.register(CpuReport(os.environ["MTDS_TEST_CPU_REPORT"], lambda: _launches["subprocess"]),
                                      "mtds-cpu-report")
    if os.environ.get("MTDS_TEST_POOL", "1") != "0":
        testing.use_pools(device)
    subprocess.Popen.__init__ = _counting_popen_init     # counted for the summary line only
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_WorkerCounts(), "mtds-worker-counts")


# Two workers (pytest-xdist, ``make test``): one file's tests run on one worker, in order, so its module
# fixtures run once; these files share a group, so never run at the same time as each other.
GROUPS = {
    # the emulated cluster: namespaces, bridges and shaped links of the root network namespace
    "tests/test_cluster.py": "netns", "tests/test_compare.py": "netns",
}


# The longest files first, so that the two workers, which take files in collection order as they come free, end
# together: the 40 longest by their wall time in a clean-clone run (2026-11-29, re-ranked after the suite cuts
# and the new ZeRO/MoE runs; the netns group counts as one
# unit of both its files, the longest), the rest after them in collection order; the order of tests inside a file
# is kept. Against the earlier list of 19 (an unlisted 47 s test_recovery came late, one worker waited) the
# measured per-test times simulate to 667 s instead of 680 s natively and 1307 s instead of 1325 s under
# test-slow (xdist's loadfile scheduling replayed: a worker gets its next file when two tests of its own remain).
LONGEST_FIRST = ("test_compare", "test_cluster", "test_pipe_parity", "test_parity", "test_reliability_faults",
                 "test_recovery", "test_moe_families", "test_context_parallel", "test_cli", "test_training_features",
                 "test_compare_peers", "test_moe", "test_pipe_matrix", "test_megatron_checkpoints",
                 "test_hf_families", "test_reshard", "test_megatron_lm", "test_zero2_pipeline", "test_first_hour",
                 "test_moe_schedules", "test_eval", "test_harness", "test_gpucheck", "test_reliability",
                 "test_plan_check_local", "test_compile", "test_gpu_bench", "test_bench", "test_moe_checkpoint",
                 "test_pool", "test_bad_input", "test_pipe_layouts", "test_async_save", "test_recompute",
                 "test_heartbeat", "test_bf16_flat", "test_fused_cross_entropy", "test_package_contents",
                 "test_plan_pipeline", "test_convert")


def pytest_collection_modifyitems(config, items):
    if not config.pluginmanager.hasplugin("xdist"):
        return
    rank = {f"tests/{name}.py": i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))      # stable: file order kept


# A scheduler of our own rather than xdist_group marks: xdist 3.8 groups by rewriting an item's _nodeid, which
# pytest 9.2 no longer reads (its nodeid is built from _id), so every test became a scope of its own, a file's
# tests ran on both workers and each worker paid the runs the file shares between its tests.
@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadFileScheduling

    class FilesAndGroups(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::")[0]
            return GROUPS.get(path, path)

    return FilesAndGroups(config, log)


def _this_process() -> dict:
    from lab.testing import ranks
    return {"pools": {str(w): list(v) for w, v in testing.pool_stats().items()},
            "fresh": ranks.fresh_ranks_started(), "subprocesses": _launches["subprocess"]}


_workers: list[dict] = []       # what each xdist worker started (the controller's summary adds them up)


def pytest_sessionfinish(session, exitstatus):
    if hasattr(session.config, "workeroutput"):       # an xdist worker: tell the controller
        session.config.workeroutput["mtds"] = _this_process()


class _WorkerCounts:
    def pytest_testnodedown(self, node, error):
        if getattr(node, "workeroutput", None) and "mtds" in node.workeroutput:
            _workers.append(node.workeroutput["mtds"])


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    counts = _workers or [_this_process()]
    pools: dict[int, list[int]] = {}
    for c in counts:
        for w, (bodies, starts) in c["pools"].items():
            acc = pools.setdefault(int(w), [0, 0])
            acc[0], acc[1] = acc[0] + bodies, acc[1] + starts
    if pools:
        text = ", ".join(f"world {w}: {b} bodies / {s} starts" for w, (b, s) in sorted(pools.items()))
        terminalreporter.write_line(f"rank pools{f' ({len(counts)} workers)' if _workers else ''}: {text}")
    pooled = sum(w * starts for w, (_, starts) in pools.items())
    terminalreporter.write_line(
        f"processes started by the suite: {pooled} pooled ranks, {sum(c['fresh'] for c in counts)} fresh ranks, "
        f"{sum(c['subprocesses'] for c in counts)} subprocesses (launchers and CLIs; the ranks they start are not "
        f"counted)")


def pytest_unconfigure(config):
    subprocess.Popen.__init__ = _popen_init
    testing.close_pools()
