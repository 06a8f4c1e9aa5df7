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


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    from lab.testing import ranks
    stats = testing.pool_stats()
    if stats:
        text = ", ".join(f"world {w}: {bodies} bodies / {starts} starts" for w, (bodies, starts) in stats.items())
        terminalreporter.write_line(f"rank pools: {text}")
    pooled = sum(w * starts for w, (_, starts) in stats.items())
    terminalreporter.write_line(
        f"processes started by the suite: {pooled} pooled ranks, {ranks.fresh_ranks_started()} fresh ranks, "
        f"{_launches['subprocess']} subprocesses (launchers and CLIs; the ranks they start are not counted)")


def pytest_unconfigure(config):
    subprocess.Popen.__init__ = _popen_init
    testing.close_pools()
