"""Context parallelism through the trainer (--context-parallel-size, --cp-comm-type; mtds.cp): every layout
below trains 10 clipped AdamW steps (fp32) of a Llama-3 model with grouped-query attention at seq 1024 and
matches transformers' LlamaForCausalLM + torch AdamW on the same batches within 1e-5 relative, in the loss
and in the pre-clip grad norm of every step. The split changes the order of the attention's sums (blocks
merged by log-sum-exp) and of the gradient reduction (over d·c ranks), so the results are close, not
bit-equal: measured 2026-11-26 within 5e-7 of transformers.

The kernels themselves (ring and all-to-all against one-process attention, forward and backward, the
mutations of the mask and the chunk order) are tested in tests/test_cp_attention.py; this file holds what
only the whole model shows: positions of the whole sequence (RoPE with Llama 3's scaling, GPT-2's learned
table), the labels each rank keeps, the loss weighting with --eod-mask-loss and packed documents, the
gradients summed over d·c, ZeRO-1 partitions over d·c, TP + sequence parallelism, a 1F1B pipeline and
selective recomputation of the ring; and the one-line refusals."""
import dataclasses

import pytest

from lab.testing import spawn
from tests.bounds import within
from tests.test_hf_families import family_training_config
from tests.training_helpers import ds_config, hf_reference, max_rel_diff, run_layouts, train_config

REL_TOL = 1e-5
SEQ = 1024
BATCH = (2, 1)        # global, micro: two sequences of 1024 tokens a step
LR = 1e-3
SAVE_AT = 5


@dataclasses.dataclass(frozen=True)
class Case:
    t: int
    c: int
    p: int
    comm: str
    zero: int = 0
    switches: tuple = ()       # extra TrainConfig fields, as (name, value) pairs

    @property
    def d(self) -> int:
        return self.world // (self.t * self.c * self.p)

    world: int = 0


# world -> cases; together both comm types at c = 2 and 4, TP 2 + SP, d = 2 with ZeRO-1 over d·c, a 1F1B
# pipeline, the ring recomputed (selective) and whole blocks with Ulysses inside recomputed (full)
TRACED = (("trace_comm", True),)     # the world-2 cases also count their bytes (cp_bytes_per_step)
CASES = {
    2: [Case(1, 2, 1, "p2p", switches=TRACED, world=2), Case(1, 2, 1, "a2a", zero=1, switches=TRACED, world=2)],
    4: [Case(2, 2, 1, "p2p", zero=1, switches=(("sequence_parallel", True),), world=4),
        Case(1, 4, 1, "p2p", switches=(("recompute", "selective"),), world=4),
        Case(1, 4, 1, "a2a", world=4),
        Case(1, 2, 1, "a2a", zero=1, switches=(("recompute", "full"),), world=4),
        Case(1, 2, 2, "p2p", world=4)],
}


def llama():
    """Llama 3.1's RoPE scaling, 8 query heads sharing 4 KV heads (so a2a splits heads at c = 4 and at t = 2
    with c = 2), 2 blocks, room for 1024 positions."""
    return dataclasses.replace(family_training_config("llama_rope_llama3"), max_position_embeddings=SEQ,
                               num_heads=8, num_kv_heads=4, num_layers=2)


def _config(case: Case, model):
    ds = ds_config(zero=case.zero, train_batch_size=BATCH[0], train_micro_batch_size_per_gpu=BATCH[1])
    return train_config(model=model, tp=case.t, pp=case.p, seq_length=SEQ, deepspeed_config=ds,
                        context_parallel_size=case.c, cp_comm_type=case.comm, lr=LR, min_lr=LR / 10,
                        **dict(case.switches))


def _documents_configs(prefix: str):
    """Packed documents with --reset-attention-mask and --eod-mask-loss (the c ranks then hold different
    numbers of tokens with a loss) at c = 2, both comm types, against d = 2 without context parallelism."""
    from tests.test_parity import _short_documents
    _short_documents(prefix)
    docs = dict(data_path=(prefix,), steps=3, seq_length=64, reset_attention_mask=True, eod_mask_loss=True)
    return [train_config(**docs), train_config(context_parallel_size=2, **docs),
            train_config(context_parallel_size=2, cp_comm_type="a2a", **docs)]


# bf16 at c = 2 against bf16 at d = 2: the same bf16 roundings in another order (blocks merged in fp32 by the
# ring, the reduction over other ranks); measured 2026-11-29 under native, avx2 and default kernels: loss 3.9e-6,
# 9.0e-6, 1.7e-5, grad norm 2.8e-4, 3.6e-4, 4.8e-4 relative (6x / 4x room)
BF16_TOL = {"loss": 1e-4, "norm": 2e-3}


def _bf16_configs(model):
    """bf16 (DeepSpeed's BF16_Optimizer, ZeRO-1) at seq 256, 5 steps: d = 2, then c = 2 p2p and a2a."""
    ds = ds_config(zero=1, precision="bf16", train_batch_size=BATCH[0], train_micro_batch_size_per_gpu=BATCH[1])
    kw = dict(model=model, seq_length=256, deepspeed_config=ds, lr=LR, min_lr=LR / 10, steps=5)
    return [train_config(**kw), train_config(context_parallel_size=2, **kw),
            train_config(context_parallel_size=2, cp_comm_type="a2a", **kw)]


def _dropout_configs():
    """Hidden dropout 0.1 (embedding and residual branches; attention dropout cannot split, refused): t = 2
    (replicated activations: the masks of one rank), then c = 2 p2p and c = 2 p2p with --recompute full --
    each c = 2 rank keeps its positions of the whole sequence's masks (drawn outside the attention, so the
    comm type does not enter: a2a was run by hand on 2026-11-27, within 1e-5 too)."""
    from tests.training_helpers import TINY
    model = dataclasses.replace(TINY, hidden_dropout=0.1)
    return [train_config(model=model, tp=2), train_config(model=model, context_parallel_size=2),
            train_config(model=model, context_parallel_size=2, recompute="full")]


def _assert_dropout(results, without) -> None:
    unsplit, ring, ring_recomputed = results
    assert max_rel_diff(unsplit.losses, without.losses) > 10 * REL_TOL, "dropout was not on"
    _assert_close(ring, unsplit, "hidden dropout 0.1 at c = 2 p2p against t = 2")
    # the same masks replayed: recomputation is exact
    assert (ring_recomputed.losses, ring_recomputed.grad_norms) == (ring.losses, ring.grad_norms)


def _assert_close(got, want, what: str) -> None:
    loss, norm = max_rel_diff(got.losses, want.losses), max_rel_diff(got.grad_norms, want.grad_norms)
    assert loss < REL_TOL and norm < REL_TOL, \
        f"{what}: max rel diff loss {loss:.2e} grad norm {norm:.2e}\n{got.losses}\n{want.losses}\n" \
        f"{got.grad_norms}\n{want.grad_norms}"


def cp_bytes_per_step(comm: str, c: int, model, micro_batches: int, b: int = BATCH[1], w: int = 4) -> int:
    """What one rank sends over its context-parallel group in a step (docs/long_context.md), per layer and
    micro-batch of b sequences, sl = s/c local tokens, e = head dim, w bytes per value (fp32: 4):
    p2p: forward (c-1) hops of K and V, backward (c-1) again plus c hops of dK and dV (always fp32):
         2 b sl h_kv e ((c-1) w + (c-1) w + 4 c);
    a2a: four all-to-alls (q, k, v in; the output back) forward and four backward, each of the whole local
         tensor: 2 * 2 b sl (h_q + h_kv) e w (the tracer's payload; (c-1)/c of it leaves the rank)."""
    sl, e, hq, hkv = SEQ // c, model.head_dim, model.num_heads, model.kv_heads
    if comm == "p2p":
        per_layer = 2 * b * sl * hkv * e * (2 * (c - 1) * w + 4 * c)
    else:
        per_layer = 2 * 2 * b * sl * (hq + hkv) * e * w
    return per_layer * model.num_layers * micro_batches


def _assert_cases(world: int, results, model) -> None:
    ref = hf_reference(model, lr=LR, seq=SEQ, batch=BATCH)
    assert sum(n > 0.5 for n in ref.grad_norms) >= 8, ref.grad_norms     # clipped steps
    for case, result in zip(CASES[world], results):
        what = f"{case} at seq {SEQ}"
        assert result.layout.startswith(f"(tp={case.t}, pp={case.p}, dp={case.d}") and f"cp={case.c}" in \
            result.layout, (what, result.layout)
        _assert_close(result, ref, what)
        if case.switches == TRACED:     # the collective tracer's bytes on the cp group = the formula
            key = "send/cp" if case.comm == "p2p" else "all_to_all/cp"
            want = cp_bytes_per_step(case.comm, case.c, model, micro_batches=BATCH[0] // BATCH[1] // case.d)
            assert result.comm[key]["bytes"] == want, (what, result.comm, want)
            assert result.comm[key]["group_size"] == case.c, (what, result.comm)


def test_two_ranks_match_transformers_and_packed_documents(tmp_path):
    """c = 2 both comm types against transformers at seq 1024; GPT-2's learned positions at c = 2 against
    its transformers reference (seq 32), saved at step 5 and resumed at c = 1 x d = 2 (checkpoints hold no
    c; ZeRO-1's partitions are over d·c = 2 either way), and with ZeRO-3 (partitions over d·c); packed documents with the EOD loss mask at c = 2
    against d = 2; bf16 at c = 2, both comm types, against bf16 at d = 2."""
    from tests.test_parity import reference
    from tests.training_helpers import TINY
    model = llama()
    configs = [_config(case, model) for case in CASES[2]]
    ckpt = str(tmp_path / "ckpt")
    # learned positions, c = 2, saving at step 5; resumed from there at c = 1 (d = 2)
    configs.append(train_config(model=TINY, context_parallel_size=2, save=ckpt, save_interval=SAVE_AT))
    configs.append(train_config(model=TINY, load=f"{ckpt}/global_step{SAVE_AT}"))
    # ZeRO-3 partitions the parameters over d·c = 2 with c = 2, d = 1 (ZeRO-2 run by hand, docs/long_context.md)
    configs.append(train_config(model=TINY, context_parallel_size=2, deepspeed_config=ds_config(zero=3)))
    configs += _documents_configs(str(tmp_path / "docs"))
    configs += _bf16_configs(model)
    configs += _dropout_configs()
    results = run_layouts(2, configs)[0]
    n = len(CASES[2])
    _assert_dropout(results[-len(_dropout_configs()):], results[n])
    results = results[:-len(_dropout_configs())]
    _assert_cases(2, results[:n], model)
    ref = reference()
    _assert_close(results[n], ref, "gpt2 learned positions, c = 2")
    resumed = results[n + 1]
    assert resumed.layout.startswith("(tp=1, pp=1, dp=2)"), resumed.layout
    _assert_close(resumed, dataclasses.replace(ref, losses=ref.losses[SAVE_AT:], grad_norms=ref.grad_norms[SAVE_AT:]),
                  f"saved at c = 2 step {SAVE_AT}, resumed at c = 1 d = 2")
    _assert_close(results[n + 2], ref, "gpt2 c = 2 ZeRO-3")
    plain, *split = results[n + 3:n + 6]
    for comm, result in zip(("p2p", "a2a"), split):
        _assert_close(result, plain, f"packed documents + eod mask loss, c = 2 {comm}")
    plain, *split = results[n + 6:]
    for comm, result in zip(("p2p", "a2a"), split):
        assert "cp=2" in result.layout and plain.layout.startswith("(tp=1, pp=1, dp=2)"), (result.layout, plain.layout)
        loss, norm = max_rel_diff(result.losses, plain.losses), max_rel_diff(result.grad_norms, plain.grad_norms)
        assert all([within("context_parallel.bf16.loss", loss, BF16_TOL["loss"]),
                    within("context_parallel.bf16.norm", norm, BF16_TOL["norm"])]), (f"bf16 c = 2 {comm}", loss, norm)


def _schedule_configs():
    """The other pipeline schedules with c = 2 x p = 2 (the stage boundary carries [b, s/c, h]), both comm
    types, a 4-block Llama at seq 128, 4 steps, against d = 4 (ZeRO-1)."""
    model = dataclasses.replace(llama(), num_layers=4)
    ds = ds_config(zero=1, train_batch_size=4, train_micro_batch_size_per_gpu=1)
    kw = dict(model=model, seq_length=128, deepspeed_config=ds, lr=LR, min_lr=LR / 10, steps=4)
    return [train_config(**kw)] + [
        train_config(context_parallel_size=2, pp=2, pipeline_schedule=name, virtual_stages=v, cp_comm_type=comm, **kw)
        for name, v, comm in SCHEDULES]


SCHEDULES = [("interleaved", 2, "p2p"), ("zb-h1", 1, "a2a"), ("dualpipev", 1, "p2p")]


def test_four_ranks_match_transformers():
    """TP 2 + SP with c = 2, c = 4 with the ring recomputed, c = 2 x d = 2 (ZeRO-1 over d·c, full
    recomputation), a 1F1B
    pipeline of 2 stages with c = 2: all against transformers at seq 1024; interleaved, zb-h1 and DualPipeV
    with c = 2 against d = 4."""
    model = llama()
    configs = [_config(case, model) for case in CASES[4]] + _schedule_configs()
    per_rank = run_layouts(4, configs)
    n = len(CASES[4])
    _assert_cases(4, per_rank[0][:n], model)
    last = per_rank[-1][n:]     # the last stage reports a pipeline's loss (DualPipeV: every rank)
    plain = last[0]
    for (name, _, comm), result in zip(SCHEDULES, last[1:]):
        assert "pp=2" in result.layout and "cp=2" in result.layout, (name, result.layout)
        _assert_close(result, plain, f"{name} c = 2 {comm}")


LLAMA_SHAPE = dict(num_heads=4, kv_heads=2)


@pytest.mark.parametrize("layout, options, message", [
    (dict(cp=4), dict(seq_length=1020), "--context-parallel-size 4 needs --seq-length divisible by 2*C = 8"),
    (dict(cp=2), dict(seq_length=1025), "--context-parallel-size 2 needs --seq-length divisible by 2*C = 4"),
    (dict(cp=2, tp=4), dict(seq_length=36, sequence_parallel=True),
     "--sequence-parallel with --cp 2 splits each rank's 18 tokens over --tp 4: use a --seq-length divisible by 8"),
    (dict(cp=4, tp=2), dict(comm_type="a2a"), "--cp-comm-type a2a needs the 4 query heads per TP rank and 2 "
                                              "key/value heads per TP rank divisible by C=4: use --cp-comm-type p2p"),
    (dict(cp=2), dict(dropout=0.1), "--cp 2 with attention dropout (0.1) is not supported (the attention kernel"),
    (dict(cp=2, tp=2), dict(hidden_dropout=0.1, sequence_parallel=True, seq_length=1024),
     "--cp 2 with --sequence-parallel and hidden dropout (0.1) is not supported yet"),
    (dict(cp=2), dict(reset_position_ids=True), "--reset-position-ids with --cp 2 is not supported yet"),
])
def test_refusals_are_one_line(layout, options, message):
    """The rulebook's context-parallel rules (mtds.rules.context; train.py, mtds-eval and the planner ask them) on
    the real Llama's facts."""
    from mtds import rules
    model = llama()
    if options.pop("dropout", None):
        model = dataclasses.replace(model, hidden_dropout=0.1, attention_dropout=0.1)
    if options.get("hidden_dropout"):
        model = dataclasses.replace(model, hidden_dropout=options.pop("hidden_dropout"))
    kw = {"seq_length": 1024, "cp_comm_type": options.pop("comm_type", "p2p"), **options}
    world = layout.get("tp", 1) * layout["cp"]
    found = rules.problems(rules.Job(model.facts(), world, **layout, **kw))
    assert found and found[0].rule.startswith("cp-"), found
    assert message in found[0].message and "\n" not in found[0].message, found[0].message


MEM_SEQ, MEM_H = 8192, 32


def _layer_memory_worker():
    """Bytes one transformer layer keeps for backward at seq 8192 on each rank, for c = 1 (rank 0 alone: the
    others wait), 2 and 4 (the whole world), both comm types; no parameters counted."""
    import torch
    import torch.distributed as dist

    from lab.activation_memory import saved_bytes
    from mtds.cp.context import ContextParallel
    from mtds.model import TransformerLayer
    from mtds.model.config import ModelConfig
    from mtds.training.distributed import group_device, init_distributed

    init_distributed()      # a2a runs DeepSpeed's DistributedAttention, through deepspeed.comm
    cfg = ModelConfig(vocab_size=256, hidden_size=MEM_H, num_layers=1, num_heads=4, num_kv_heads=4,
                      max_position_embeddings=MEM_SEQ, position_embedding="rotary", normalization="rmsnorm",
                      activation="swiglu", ffn_hidden_size=64)
    rank, dev = dist.get_rank(), group_device()
    groups = {1: [dist.new_group([r]) for r in range(4)][rank], 2: [dist.new_group(g) for g in ([0, 1], [2, 3])][rank // 2],
              4: dist.new_group([0, 1, 2, 3])}
    out = {}
    for c in (1, 2, 4) if rank == 0 else (2, 4):
        for comm in ("p2p", "a2a") if c > 1 else ("p2p",):
            ctx = ContextParallel(groups[c], c, rank % c, comm) if c > 1 else None
            layer = TransformerLayer(cfg, 1, context=ctx).to(dev).train()
            x = torch.randn(1, MEM_SEQ // c, MEM_H, device=dev, requires_grad=True)
            _, nbytes = saved_bytes(layer, x, exclude=list(layer.parameters()))
            out[c, comm] = nbytes
    return out


def test_activation_bytes_per_rank_fall_as_one_over_c():
    """At seq 8192 a layer's saved activations per rank are 1/c of the unsplit layer's, within 10%: nothing
    of size s (let alone s x s) is kept whole on any rank."""
    per_rank = spawn(_layer_memory_worker, 4, timeout=300)
    whole = per_rank[0][1, "p2p"]
    for rank, out in enumerate(per_rank):
        for (c, comm), nbytes in out.items():
            assert abs(nbytes * c / whole - 1) < 0.10, (rank, c, comm, nbytes, whole)
    print({key: round(n / whole, 4) for key, n in per_rank[1].items()})
