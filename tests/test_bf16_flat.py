"""BF16_Optimizer's bookkeeping on flat buffers (mtds.deepspeed_compat.bf16_flat): the same numbers as
DeepSpeed's per-parameter loops, bit for bit on CPU, at the layouts whose gradients take different roads
(tied weights across pipeline stages, data-parallel reduce-scatter, several micro-batches); and the
operators it saves, held as counts."""
import collections
import dataclasses
import math

from lab.testing import spawn
from tests.bounds import same
from tests.training_helpers import TINY, ds_config, train_config

STEPS = 3
SEQ = 16     # bf16 GEMMs run at ~1 GFLOP/s on a CPU without bf16 instructions: half the suite's tokens
FP32_ACC = {"data_types": {"grad_accum_dtype": "fp32"}}


def _flat_and_loops(layouts):
    import mtds.deepspeed_compat.bf16_flat as flat
    from mtds.training import run
    gather, bound = flat.accumulate_flat, []

    def watched(owner, clear_lp_grads):
        # after each gather every 16-bit gradient is a view of its group's buffer: the tensors autograd
        # handed over are not kept alive beside it between micro-batches
        gather(owner, clear_lp_grads)
        storages = {f.untyped_storage().data_ptr() for f in owner.flats}
        bound.append(all(lp.grad is None or lp.grad.untyped_storage().data_ptr() in storages
                         for group in owner.opt.bf16_groups for lp in group))

    out = []
    flat.accumulate_flat = watched
    try:
        for tp, pp in layouts:
            runs = {}
            for on in (True, False):
                flat.FLAT = on
                try:
                    cfg = train_config(tp=tp, pp=pp, steps=STEPS, seq_length=SEQ,
                                       deepspeed_config=ds_config(precision="bf16", **FP32_ACC))
                    runs[on] = run(cfg)
                finally:
                    flat.FLAT = True
            out.append(runs)
    finally:
        flat.accumulate_flat = gather
    return out, bound


def test_flat_bookkeeping_equals_deepspeeds_loops_bit_for_bit():
    # (1,2,1): the tied embedding's gradient summed across stages through _hp_grad; (1,1,2): reduce-scattered
    # at d = 2 with 2 micro-batches per rank accumulating. Clipped most steps (CLIP 0.5).
    layouts = [(1, 2), (1, 1)]
    per_rank = spawn(_flat_and_loops, 2, layouts)
    for rank_runs, bound in per_rank:
        assert bound and all(bound), bound
        for (tp, pp), runs in zip(layouts, rank_runs):
            flat, loops = runs[True], runs[False]
            if not flat.losses:     # not the reporting rank of this layout
                continue
            assert same("bf16_flat.flat_vs_loops.losses", flat.losses, loops.losses), \
                ((tp, pp), flat.losses, loops.losses)
            assert same("bf16_flat.flat_vs_loops.norms", flat.grad_norms, loops.grad_norms), \
                ((tp, pp), flat.grad_norms, loops.grad_norms)
            assert len(flat.losses) == STEPS and flat.grad_norms[0] > 0.5, flat.grad_norms   # clipped


def _ops_per_step(layers_list, precision="bf16"):
    from lab.testing.op_counts import OpCounts
    from mtds.training import run, train_loop
    counts, active = {}, {}

    class Edge:
        def __init__(self, first):
            self.first = first

        def before_step(self, step):
            if self.first and step == STEPS:
                active["mode"] = OpCounts().__enter__()

        def after_step(self, step, record):
            if not self.first and "mode" in active:
                mode = active.pop("mode")
                mode.__exit__(None, None, None)
                counts[active["layers"]] = mode.counts

        def at_end(self, step, completed):
            pass

    hooks = train_loop.step_hooks
    train_loop.step_hooks = lambda *a, **k: [Edge(True)] + hooks(*a, **k) + [Edge(False)]
    try:
        for layers in layers_list:
            active["layers"] = layers
            model = dataclasses.replace(TINY, num_layers=layers, hidden_dropout=0.0, attention_dropout=0.0)
            extra = FP32_ACC if precision == "bf16" else {}
            ds = ds_config(precision=precision, train_batch_size=1, train_micro_batch_size_per_gpu=1, **extra)
            ds["optimizer"]["params"]["fused"] = True
            run(train_config(model=model, steps=STEPS, deepspeed_config=ds))
    finally:
        train_loop.step_hooks = hooks
    return counts


VIEWS = ("aten.view.default", "aten.t.default", "aten.transpose.int", "aten.detach.default",
         "aten._unsafe_view.default", "aten.slice.Tensor", "aten.alias.default")


def test_operators_per_layer_per_step():
    # bf16, d = 1, t = 1, one micro-batch, fused AdamW, clipping: the operators one more GPT-2 layer adds to
    # a training step (its 12 parameters). DeepSpeed's loops and the per-gradient non-finite sum cost
    # 6 per parameter (sum, cast + add, norm, clip multiply, flag cast): 106 computing operators a layer
    # on 2026-11-26; 44 that evening (the layer's own 32, and autograd adding each gradient into the bound,
    # zeroed 16-bit buffer: 12); since 2026-11-27 32: autograd hands the gradients over (cleared to None)
    # and one cat per group gathers them.
    counts = spawn(_ops_per_step, 1, (2, 4))[0]
    per_layer = collections.Counter(counts[4])
    per_layer.subtract(counts[2])
    computing = {op: n // 2 for op, n in per_layer.items()
                 if n and op not in VIEWS and not op.startswith("profiler.")}
    assert sum(computing.values()) <= 32, computing
    for op in ("aten.linalg_vector_norm.default", "aten._to_copy.default", "aten.sum.default", "aten.mul_.Tensor"):
        assert computing.get(op, 0) == 0, (op, computing)      # nothing per parameter in the bookkeeping


def _zero1_norm_foreach_and_loop():
    import torch

    import mtds.deepspeed_compat.compact_partition as compact_partition
    import mtds.deepspeed_compat.zero_norm as zero_norm
    from mtds.training import run
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    runs = {}
    # every gradient partition starts as NaN: an element the reduce-scatter leaves unwritten shows
    compact_partition.ALLOC = lambda n, **kw: torch.full((n,), float("nan"), **kw)
    # DeepSpeed's first gradient hook of a run allocates its (here unused) reduction bucket in setup_buckets
    setup_buckets, calls = DeepSpeedZeroOptimizer.setup_buckets, []
    DeepSpeedZeroOptimizer.setup_buckets = lambda self: calls.append(1) or setup_buckets(self)
    for on in (True, False):
        zero_norm.FOREACH = on
        try:
            runs[on] = run(train_config(tp=1, pp=1, steps=STEPS, deepspeed_config=ds_config(zero=1)))
        finally:
            zero_norm.FOREACH = True
            compact_partition.ALLOC = torch.empty
            DeepSpeedZeroOptimizer.setup_buckets = setup_buckets
    runs["setup_buckets"] = len(calls)
    return runs


def test_zero1_foreach_norm_equals_deepspeeds_loop_bit_for_bit():
    # fp32 ZeRO-1 at d = 2 (the gradients reduce-scattered, two micro-batches per rank), clipped: the norm
    # from one _foreach_norm(dtype=float64) is DeepSpeed's per-gradient float64 loop's, bit for bit. The
    # gradient partitions are allocated without zeroing (compact_partition.py), here filled with NaN: the
    # reduce-scatter writes every element, padding included, or the norms and losses are not finite.
    # DeepSpeed's per-parameter gradient hooks are gone (zero1_reduce.drop_gradient_hooks): its reduction
    # bucket is never allocated.
    every = spawn(_zero1_norm_foreach_and_loop, 2)
    assert [runs["setup_buckets"] for runs in every] == [0, 0], every
    reporting = [runs for runs in every if runs[True].losses]
    assert reporting
    for runs in reporting:
        on, off = runs[True], runs[False]
        assert all([same("bf16_flat.zero1_foreach_norm.losses", on.losses, off.losses),
                    same("bf16_flat.zero1_foreach_norm.norms", on.grad_norms, off.grad_norms)]), \
            (on.grad_norms, off.grad_norms)
        assert len(on.grad_norms) == STEPS and on.grad_norms[0] > 0.5, on.grad_norms
        assert all(math.isfinite(x) for x in on.losses + on.grad_norms), (on.losses, on.grad_norms)
