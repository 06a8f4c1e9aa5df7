"""--log-straggler on 2 gloo ranks: a rank slowed on purpose (a sleep before each of its forwards) is named at the
first report (within two report intervals); an even run names nobody. Mutation record: docs/testing.md."""
import time

import pytest

from lab.testing import spawn
from tests.training_helpers import TINY, train_config

MODEL = TINY.__class__(**{**TINY.__dict__, "num_layers": 2})
INTERVAL, STEPS = 2, 4


def _slow_rank1(engine, groups):
    if groups.rank == 1:
        engine.module.register_forward_pre_hook(lambda module, args: time.sleep(0.1))


def _worker():
    from mtds.training import run
    cfg = dict(model=MODEL, tp=2, steps=STEPS, log_straggler=True, straggler_interval=INTERVAL)
    even = run(train_config(**cfg))
    slowed = run(train_config(**cfg), on_engine_ready=(_slow_rank1,))
    return even.stragglers, slowed.stragglers


@pytest.fixture(scope="module")
def reports():
    return spawn(_worker, 2, timeout=200)


def test_a_slowed_rank_is_named_within_two_report_intervals(reports):
    for _, slowed in reports:           # every rank gathers the same numbers
        assert slowed[0] == (INTERVAL, [1]) or slowed[1] == (2 * INTERVAL, [1]), slowed
        assert all(named in ([], [1]) for _, named in slowed), slowed


def test_an_even_run_names_no_rank(reports):
    for even, _ in reports:
        assert [step for step, _ in even] == [INTERVAL, 2 * INTERVAL] and all(not named for _, named in even), even
