"""Expected bytes each rank communicates per optimizer step, for one parallel dimension at a time.

Payload convention of ``mtds.observe.comm_trace`` (the tensor a rank hands to the collective), fp32 (4 B),
micro batch b, sequence s, hidden h, layers l, padded vocabulary V, m micro-batches per rank per step:

* TP (Megatron, Shoeybi et al. 2019 §3): per micro-batch each layer all-reduces its [b, s, h] output
  twice forward (attention, MLP) and twice backward (their inputs' gradients) = 4 l b s h; the
  vocab-parallel embedding adds one forward all-reduce and the tied LM head one backward all-reduce
  (2 b s h); vocab-parallel cross entropy all-reduces 3 [b, s] tensors (max, target logit, sum exp).
      tp all_reduce = 4 m ((4 l + 2) b s h + 3 b s)  + 4   (the last 4 B: the grad-norm scalar)
* PP (Narayanan et al. 2021 §2.2): each stage boundary carries [b, s, h] forward and its gradient
  backward, per micro-batch:  send = recv = 4 m b s h  per rank of a 2-stage pipeline.
  Extras: the tied embedding's gradient all-reduce between first and last stage, 4 V h / t.
* DP (textbook): all-reduce of the rank's gradients, 4 P.  DeepSpeed ZeRO-1 instead all-reduces the
  gradients and then all-gathers the updated parameter partitions: payload 4 P + 4 P / d, ring bus
  bytes 2 (d-1)/d 4P + (d-1)/d 4P = 1.5 x 4P at d = 2 (vs 1.0 x for plain DP).
Ring bus bytes (what crosses a link): mtds.parallel.ring (all-reduce 2 (n-1)/n x payload, all-gather (n-1) x shard).
"""
from __future__ import annotations

from mtds.parallel import ring
from mtds.parallel.vocab import padded_vocab_size
from mtds.plan.model_spec import ModelSpec

FP32 = 4


def params_per_rank(layers: int, hidden: int, padded_vocab: int, positions: int, tp: int = 1, pp: int = 1,
                    stage: int = 0) -> int:
    """Parameters one rank holds, from the planner's count (mtds.plan.model_spec): per layer 12h^2/t + 7h/t
    sharded + 6h replicated (out-proj and fc_out biases, two LayerNorms); embedding V h / t + positions x h;
    final LayerNorm 2h. With p = 2 stages the blocks split evenly, the last stage holds the final norm and a
    tied embedding copy."""
    spec = ModelSpec(layers=layers, hidden=hidden, heads=1, vocab=padded_vocab, seq=positions)
    h, t = hidden, tp
    layer = int(spec.sharded_params_per_layer()) // t + int(spec.replicated_params_per_layer())
    embedding = padded_vocab * h // t + positions * h
    if pp == 1:
        return embedding + layers * layer + spec.norm_params
    per_stage = layers // pp
    total = per_stage * layer
    if stage == 0:
        total += embedding
    if stage == pp - 1:
        total += embedding + spec.norm_params
    return total


def tp_bytes(layers: int, hidden: int, micro_batch: int, seq: int, micro_batches: int) -> int:
    b, s, h = micro_batch, seq, hidden
    return FP32 * micro_batches * ((4 * layers + 2) * b * s * h + 3 * b * s) + FP32


def pp_bytes(hidden: int, micro_batch: int, seq: int, micro_batches: int) -> int:
    return FP32 * micro_batches * micro_batch * seq * hidden


def expected_rows(shape, tp: int, pp: int, dp: int, micro_batches: int, stage: int = 0) -> list[dict]:
    """One row per traffic kind the layout introduces: what the formula says a rank moves per step."""
    padded_vocab = padded_vocab_size(shape.vocab, tp)
    P = params_per_rank(shape.layers, shape.hidden, padded_vocab, shape.seq, tp, pp, stage)
    b, s, h, l, m = shape.micro_batch, shape.seq, shape.hidden, shape.layers, micro_batches
    rows = []
    if tp > 1:
        rows.append({"traffic": "all_reduce/tp", "formula": "4m((4l+2)bsh + 3bs) + 4",
                     "expected_bytes": tp_bytes(l, h, b, s, m), "exact": True})
    if pp > 1:
        for kind in ("send", "recv"):
            rows.append({"traffic": f"{kind}/pp", "formula": "4 m b s h", "expected_bytes": pp_bytes(h, b, s, m),
                         "exact": True})
        # DeepSpeed's pipeline grid has its own groups (traced as "other"): the tied-embedding gradient
        # all-reduce between the end stages, and ZeRO-1's gradient all-reduce in a data-parallel group of
        # one (a local no-op, but counted). The last stage's tied copy never uses its position table,
        # so those parameters have no gradient; then two grad-norm / overflow scalars.
        unused = s * h if stage == pp - 1 else 0
        rows.append({"traffic": "all_reduce/other", "formula": "4 V h / t (tied grad) + 4 P_grad (ZeRO, d=1) + 8",
                     "expected_bytes": FP32 * (padded_vocab * h // tp + P - unused) + 8, "exact": False})
    if dp == 1 and pp == 1:
        rows.append({"traffic": "all_reduce/dp", "formula": "4 P + 4 (ZeRO-1 grads, group of one: moves nothing)",
                     "expected_bytes": FP32 * P + 4, "exact": False})
    if dp > 1:
        rows.append({"traffic": "all_reduce/dp", "formula": "4 P (textbook DP gradient all-reduce)",
                     "expected_bytes": FP32 * P, "exact": False,
                     "bus_bytes": ring.payload_link_bytes("all_reduce", FP32 * P, dp)})
        rows.append({"traffic": "all_gather/dp", "formula": "4 P / d (ZeRO-1 parameter all-gather)",
                     "expected_bytes": FP32 * P // dp, "exact": False,
                     "bus_bytes": ring.payload_link_bytes("all_gather", FP32 * P // dp, dp)})
    for row in rows:
        row["params_per_rank"] = P
    return rows
