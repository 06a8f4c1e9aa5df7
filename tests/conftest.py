"""Session set-up of the test-suite: where multi-rank bodies run, and on which device.

``MTDS_TEST_DEVICE``: ``cpu`` (default; gloo, and CUDA hidden from every process of the suite so that
training cannot pick a GPU the harness does not use) or ``cuda`` (NCCL, one rank per GPU; tests whose
world size exceeds the GPUs present are skipped with that reason).
``MTDS_TEST_POOL=0``: start fresh processes for every multi-rank body instead of the live pools.
"""
import os

from mtds import testing


def pytest_configure(config):
    device = os.environ.get("MTDS_TEST_DEVICE", "cpu")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"MTDS_TEST_DEVICE must be cpu or cuda, got {device!r}")
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ["MTDS_TEST_DEVICE"] = device
    if os.environ.get("MTDS_TEST_POOL", "1") != "0":
        testing.use_pools(device)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    stats = testing.pool_stats()
    if stats:
        text = ", ".join(f"world {w}: {bodies} bodies / {starts} starts" for w, (bodies, starts) in stats.items())
        terminalreporter.write_line(f"rank pools: {text}")


def pytest_unconfigure(config):
    testing.close_pools()
