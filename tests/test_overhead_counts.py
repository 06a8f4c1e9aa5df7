"""Per-step and per-layer overhead held as counts, not timings (issue 21): collectives and tensor copies of
one transformer layer per micro-batch at t = 2, and the host reads of a whole training step. A count that
grows is overhead someone added; if the growth is meant, the expected numbers here change with it."""
from lab.testing import spawn


def _layer_counts(llama: bool):
    import torch
    import torch.distributed as dist

    from mtds.observe.comm_trace import CommTracer
    from mtds.model.config import ModelConfig
    from mtds.model.layer import TransformerLayer
    from lab.testing.op_counts import OpCounts

    extra = dict(position_embedding="rotary", normalization="rmsnorm", activation="swiglu", num_kv_heads=2,
                 linear_bias=False) if llama else {}
    cfg = ModelConfig(vocab_size=256, hidden_size=32, num_layers=1, num_heads=4, max_position_embeddings=16,
                      hidden_dropout=0.0, attention_dropout=0.0, **extra)
    group = dist.new_group([0, 1])
    layer = TransformerLayer(cfg, 1, tp_group=group)
    x = torch.randn(2, 16, 32, requires_grad=True)
    layer(x).sum().backward()                    # first call: per-instance caches (rotary cos/sin)
    tracer = CommTracer()
    tracer.name_group(group, "tp")
    with tracer, OpCounts() as forward:
        y = layer(x)
    with tracer, OpCounts() as backward:
        y.sum().backward()
    calls = {key: s["calls"] for key, s in tracer.summary().items()}
    return calls, forward.copies(), backward.copies()


def _both_layers():
    return _layer_counts(False), _layer_counts(True)


def test_collectives_and_copies_per_layer_per_micro_batch():
    gpt2, llama = spawn(_both_layers, 2)[0]
    # Megatron's four: the row-parallel all-reduce of attention and of the MLP forward, and the two
    # column-parallel input-gradient all-reduces backward. Nothing else, no copy of the partial sums.
    for calls, _, _ in (gpt2, llama):
        assert calls == {"all_reduce/tp": 4}, calls
    assert gpt2[1:] == ({}, {"aten.cat.default": 1}), gpt2       # backward: the gradient of the q|k|v split
    # forward: rotate_half of q and k; backward: the gradients of rotate_half (q, k), of the gate|up and the
    # q|k|v splits, and the [b, s, heads, d] -> [b, heads, s, d] view of this rank's two query heads
    assert llama[1:] == ({"aten.cat.default": 2}, {"aten.clone.default": 1, "aten.cat.default": 4}), llama


def _host_reads_and_mfu():
    from lab.testing.op_counts import HostReads
    from mtds.training import run, train_loop
    from tests.training_helpers import train_config

    reads, records, active = [], [], {}

    class Edge:          # first and last hook of the step: count from before the step to after its hooks
        def __init__(self, first):
            self.first = first

        def before_step(self, step):
            if self.first:
                active["mode"] = HostReads().__enter__()

        def after_step(self, step, record):
            if not self.first:
                active["mode"].__exit__(None, None, None)
                reads.append(active.pop("mode").count)
                records.append(record)

        def at_end(self, step, completed):
            pass

    hooks = train_loop.step_hooks
    train_loop.step_hooks = lambda *a, **k: [Edge(True)] + hooks(*a, **k) + [Edge(False)]
    try:
        run(train_config(steps=2, eval_split=0.0))
    finally:
        train_loop.step_hooks = hooks
    return reads, [r["mfu"] for r in records]


def test_host_reads_per_step_and_cpu_mfu():
    reads, mfu = spawn(_host_reads_and_mfu, 1, timeout=300)[0]
    # 5 per step, none per micro-batch (4 micro-batches here): DeepSpeed ZeRO-1's overflow check and norm
    # (2), mtds's loss and grad norm for the record (2) and the one read of the flags every rank agrees on
    # (non-finite loss/norm, own non-finite gradients, stop signal). (torch's unfused AdamW read its step
    # count too; mtds asks DeepSpeed for the fused kernel on CPU, which keeps it in a tensor.)
    assert reads == [5, 5], reads
    # MFU on CPU: model FLOP/s over the GEMM peak this rank measured at start-up
    # (a bound, not an exact value: a start-up peak measured while other processes share the cores reads
    # low, and MFU above 1 follows -- 1.59 seen in a run beside 8 busy processes on 2 cores)
    assert all(isinstance(m, float) and 0.0 < m < 10.0 for m in mfu), mfu


def test_fp32_zero1_bookkeeping_has_no_per_parameter_operators():
    # fp32, ZeRO-1, d = 1, t = 1, one micro-batch, fused AdamW, clipping: what one more GPT-2 layer (12
    # parameters) adds to a step. On 2026-11-27 the bookkeeping ran 4 operators per parameter: the non-finite
    # check's sum per gradient (a hook), the reduce-scatter fill's copy per gradient, and DeepSpeed's norm
    # loop (a float64 copy and a norm per gradient): 80 computing operators a layer. Now the fill writes each
    # run of gradients with one cat and sums each bucket, and the norm is one _foreach_norm: the layer's own
    # forward and backward remain, 32 (fp32 gradients are handed over, not accumulated, at one micro-batch).
    import collections

    from tests.test_bf16_flat import VIEWS, _ops_per_step
    counts = spawn(_ops_per_step, 1, (2, 4), "fp32")[0]
    per_layer = collections.Counter(counts[4])
    per_layer.subtract(counts[2])
    computing = {op: n // 2 for op, n in per_layer.items()
                 if n and op not in VIEWS and not op.startswith("profiler.")}
    for op in ("aten.linalg_vector_norm.default", "aten._to_copy.default", "aten.sum.default", "aten.copy_.default"):
        assert computing.get(op, 0) == 0, (op, computing)
    assert sum(computing.values()) <= 32, computing
    # Views and detaches too (cheap, but each a dispatch on the host): 150 a layer since DeepSpeed's re-pointing
    # of every parameter after a step is skipped when none moved (zero_repoint.py; 4 a parameter: 198) and the
    # fill and the norm stopped slicing and detaching whole gradients; 126 since the gradient partition's
    # per-parameter views come from one split_with_sizes (compact_partition.py; DeepSpeed's narrow + view each);
    # 114 since DeepSpeed's per-parameter gradient hooks are removed under mtds's reducer (their count of the
    # parameters in the backward took a view_as each: zero1_reduce.drop_gradient_hooks).
    every = {op: n // 2 for op, n in per_layer.items() if n and not op.startswith("profiler.")}
    assert sum(every.values()) <= 114, every
