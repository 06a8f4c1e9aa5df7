"""--pipeline-layout and --pipeline-balance on real ranks (2, one launch): every schedule builds the
layers the layout names on each rank -- including a stage with no transformer block -- and matches the
single-process HuggingFace reference (losses and pre-clip grad norms, 1e-5, fp32, 5 clipped steps);
--pipeline-balance cost builds the planner's partition, and its checkpoint resumes under another layout
(global layer indices)."""
import functools
import os
import tempfile

from tests.training_helpers import TINY, hf_reference, max_rel_diff, run_layouts, train_config

REL_TOL = 1e-5
STEPS = 5           # the LR schedule spans the run: the reference trains as many steps
SAVE_AT = 2

# (what, config kwargs, global layers per rank: 0 embedding (and its tied copy on the head's rank),
#  1..4 blocks, 5 final norm; None: the planner's cost partition, checked below)
CASES = [
    ("1f1b --pipeline-balance cost", dict(pipeline_balance="cost"), None),
    ("1f1b E|t*4L (stage 0 holds no block), resumed", dict(pipeline_layout="E|t*4L"), [[0], [0, 1, 2, 3, 4, 5]]),
    ("interleaved E|t*2|t|tL", dict(pipeline_layout="E|t*2|t|tL", pipeline_schedule="interleaved",
                                    virtual_stages=2), [[0, 3], [0, 1, 2, 4, 5]]),
    ("zb-h1 Et|t*3L", dict(pipeline_layout="Et|t*3L", pipeline_schedule="zb-h1"), [[0, 1], [0, 2, 3, 4, 5]]),
    ("dualpipev Et|t*2|t|L (rank 0: stages 0 and 3)", dict(pipeline_layout="Et|t*2|t|L",
                                                            pipeline_schedule="dualpipev"), [[0, 1, 5], [2, 3, 4]]),
]


@functools.lru_cache(maxsize=1)
def layout_runs():
    ckpt = os.path.join(tempfile.mkdtemp(prefix="mtds-layout-ckpt-"), "ck")
    configs = []
    for k, (_, kwargs, _) in enumerate(CASES):
        extra = dict(save=ckpt, save_interval=SAVE_AT) if k == 0 else {}
        if k == 1:
            extra = dict(load=os.path.join(ckpt, f"global_step{SAVE_AT}"))
        configs.append(train_config(pp=2, steps=STEPS, **kwargs, **extra))
    return run_layouts(2, configs)


def test_layouts_build_their_layers_and_match_hf():
    per_rank = layout_runs()
    ref = hf_reference(TINY, steps=STEPS)
    for k, (what, _, layers) in enumerate(CASES):
        if layers is not None:
            assert [per_rank[r][k].layers for r in (0, 1)] == layers, what
        result = per_rank[1][k]                 # the last stage reports (dualpipev: every rank has the loss)
        start = SAVE_AT if "resumed" in what else 0
        for name, got, want in (("losses", result.losses, ref.losses[start:]),
                                ("grad norms", result.grad_norms, ref.grad_norms[start:])):
            diff = max_rel_diff(got, want)
            assert diff < REL_TOL, f"{what}: {name} max rel diff {diff:.2e}\n{got}\n{want}"


def test_balance_cost_builds_the_planners_partition():
    from mtds.parallel.layout import ParallelLayout
    from mtds.parallel.pipeline_layout import uniform_layout
    from mtds.plan.balance import balanced_layout
    from mtds.training.ds_config import BatchPlan
    from mtds.training.stage_plan import planner_view
    cfg = train_config(pp=2, pipeline_balance="cost")
    view = planner_view(cfg, TINY, ParallelLayout(pp=2), BatchPlan(8, 2, 4), "fp32", 1)
    expected = balanced_layout(*view)
    # the case must move something, and differ from the layout its checkpoint resumes under
    assert expected != uniform_layout(4, 2) and str(expected) != "E|t*4L"
    built = [layout_runs()[r][0].layers for r in (0, 1)]
    blocks = [len([i for i in layers if 1 <= i <= 4]) for layers in built]
    assert tuple(blocks) == expected.blocks, (built, expected)
