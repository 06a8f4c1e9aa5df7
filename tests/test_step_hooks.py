"""The step hooks' schedule on real one-rank runs (tiny model, a few steps): evaluation and checkpoints
at their intervals and once more at the end unless the last step had one; nothing at the end of a run
resumed at --steps; the caller's probes called once, with the engine, before the first step."""
import os

from lab.testing import spawn
from tests.training_helpers import train_config


def _runs(root):
    from mtds.training import run
    seen = []

    def probe(engine, groups):
        seen.append((type(engine).__name__, engine.global_steps, groups.layout.tp))

    common = dict(eval_split=0.05, eval_iters=1, eval_interval=2, save_interval=2, save=f"{root}/ck")
    odd = run(train_config(steps=3, **common), on_engine_ready=(probe,))
    even = run(train_config(steps=4, load=f"{root}/ck", **common))       # one step, 4, on both intervals
    resumed = run(train_config(steps=4, load=f"{root}/ck", **common))    # already at --steps
    return seen, [(r.final_step, len(r.losses), [step for step, _ in r.eval_losses]) for r in (odd, even, resumed)]


def _saved(path):
    return sorted(int(name[len("global_step"):]) for name in os.listdir(path) if name.startswith("global_step"))


def test_eval_and_save_at_intervals_and_once_at_the_end(tmp_path):
    seen, (odd, even, resumed) = spawn(_runs, 1, str(tmp_path), timeout=300)[0]
    assert seen == [("DeepSpeedEngine", 0, 1)]                # once, before any step
    assert odd == (3, 3, [2, 3]), odd                         # step 3 is not on the interval: once more
    assert even == (4, 1, [4]), even                          # the last step had one: not twice
    assert resumed == (4, 0, []), resumed                     # nothing ran: no final evaluation or save
    assert _saved(tmp_path / "ck") == [2, 3, 4]
