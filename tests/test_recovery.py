"""Recovery without a person, under a real ``torchrun --max-restarts``: two faults in one run (kill -9 of a rank
while training with its background checkpoint write in flight, SIGSTOP of a rank found by the heartbeat) are
each followed by the agent's restart from the newest complete checkpoint, and the run's losses equal an
uninterrupted run's. A third fault, kill -9 while training with no write in flight, was dropped (2026-11-29, one
restart of two ranks less): the first fault is that kill with a write in flight too. With no restarts left the
job exits non-zero with one clear line: asserted on the killed launch of tests/test_reliability_faults.py's
test_kill_9_of_one_rank (torchrun's default, no restarts), which this file launched a job of its own for until
2026-11-29. ``python -m lab.faults --restarts`` runs more (random ranks and steps, all three kinds) and times each
recovery."""
from lab.faults.restarts import run_with_faults
from lab.testing import needs_ranks, spawn

STEPS = 10


def _reference(argv):
    from mtds.training import run
    from mtds.training.cli import build_parser, config_from_args
    result = run(config_from_args(build_parser().parse_args(argv)))
    return list(zip(range(1, len(result.losses) + 1), result.losses, result.grad_norms))


def test_two_faults_under_max_restarts_2_end_with_the_uninterrupted_losses(tmp_path):
    needs_ranks(2)
    work = str(tmp_path)
    run = run_with_faults(work, 7, ["kill-save", "stop"], steps=STEPS, max_restarts=2)
    where = f"faults {run.faults}; output {work}/out.txt"
    assert run.returncode == 0, where
    assert len(run.error_lines) == 2, run.error_lines
    for k, line in enumerate(run.error_lines, start=1):
        assert f"restart {k} of 2" in line, run.error_lines
    assert "has not been heard from" in run.error_lines[1], run.error_lines     # the SIGSTOP: the heartbeat
    # the same job uninterrupted, on warm pooled ranks (the same flags as train.py parses them)
    argv = ["--deepspeed_config", f"{work}/ds.json", "--model", f"{work}/config.json", "--tp", "2",
            "--seq-length", "32", "--eval-split", "0", "--steps", str(STEPS), "--no-progress"]
    want = spawn(_reference, 2, argv, timeout=200)[0]
    assert [(s, *run.steps[s]) for s in sorted(run.steps)] == want, where
