"""The tensor-parallel collectives one GPU runs, as counts the tracer can check.

Per micro-batch and per transformer layer (Megatron TP, arXiv 1909.08053 Section 3; sequence
parallelism, Korthikanti et al. 2022 Section 4.2.2), with A = one [b, s, h] activation:
  without SP: 2 all-reduces of A in forward (after the attention projection and fc2) and 2 in
              backward (the input gradients of QKV and fc1); full recomputation repeats the 2 forward ones.
  with SP:    each all-reduce becomes an all-gather before a column-parallel linear and a
              reduce-scatter after a row-parallel one (forward 2 + 2, backward 2 + 2), plus the 2 extra
              all-gathers of the trade mtds makes like Megatron: QKV and fc1 keep only their sequence slice
              for backward and gather it again there (mtds.tp.sequence_linear). Recompute: + 2 + 2.
Ends of the model:
  first stage: the vocab-parallel embedding's output (all-reduce of A; SP: reduce-scatter, and in
               backward the all-gather of its gradient, + an all-gather of the [s/t, h] position gradient
               when positions are learned).
  last stage:  the LM head's input (backward all-reduce of A; SP: all-gather forward, reduce-scatter
               backward, re-gather backward) and the vocab-parallel cross entropy's 3 all-reduces of
               s b fp32 values (max logit, target logit, sum of exponentials).
Per step with SP, the gradients of the parameters every TP rank holds whole (norms, row-parallel
biases) are summed over TP: one flat all-reduce under ZeRO-0/1, one per tensor per micro-batch under
ZeRO-2/3 (DeepSpeed reduces each gradient as backward produces it).

With context parallelism (c > 1) every A and every per-token tensor is the rank's s/c tokens' (the
context-parallel traffic itself is mtds.plan.cp_comm's).

Bytes are those of the full tensor S (all-reduce: the buffer; all-gather: the gathered result;
reduce-scatter: the input); what a ring moves per rank (mtds.parallel.ring: 2(n-1)/n S for an all-reduce,
(n-1)/n S for the other two) is the "bus bytes" of mtds.observe.comm_trace.
"""
from __future__ import annotations

from dataclasses import dataclass

from mtds.parallel import ring
from mtds.plan import comm, compute
from mtds.plan.candidate import Candidate, Workload
from mtds.plan.hardware import Cluster
from mtds.plan.model_spec import ModelSpec

@dataclass(frozen=True)
class Collective:
    kind: str       # all_reduce | all_gather | reduce_scatter
    nbytes: float   # the full tensor S
    calls: float
    regather: bool = False   # SP's backward re-gather of a column-parallel linear's input

    def bus_bytes(self, n: int) -> float:
        """Bytes on each rank's link for all ``calls`` on a ring of n ranks."""
        return self.calls * ring.link_bytes(self.kind, self.nbytes, n)

    def time(self, n: int, cluster: Cluster) -> float:
        return self.calls * comm.ring_time(self.kind, self.nbytes, n, 1, cluster)


def layer_collectives(model: ModelSpec, layout: Candidate, work: Workload) -> list[Collective]:
    """One transformer layer, one micro-batch (see the module docstring)."""
    activation = layout.local_seq(model.seq) * layout.microbatch * model.hidden * work.bytes_per_value
    recompute = 1 if layout.recompute == "full" else 0
    if not layout.sequence_parallel:
        return [Collective("all_reduce", activation, 4 + 2 * recompute)]
    return [Collective("all_gather", activation, 4 + 2 * recompute),
            Collective("reduce_scatter", activation, 4 + 2 * recompute),
            Collective("all_gather", activation, 2, regather=True)]


def layer_time(model: ModelSpec, layout: Candidate, work: Workload, cluster: Cluster) -> float:
    """Exposed time of one layer's collectives, one micro-batch. The two backward re-gathers run while
    the input-gradient GEMM of the same linear (QKV, fc1) computes (mtds.tp.sequence_linear, as
    Megatron), so only what the GEMM does not cover is exposed."""
    total = 0.0
    s, b, h, t = layout.local_seq(model.seq), layout.microbatch, model.hidden, layout.tp
    w = work.bytes_per_value
    for c in layer_collectives(model, layout, work):
        one = c.time(t, cluster) / c.calls
        if not c.regather:
            total += c.calls * one
            continue
        # input-gradient GEMMs [bs x (h+2h_kv)/t]@[.. x h] and [bs x f'/t]@[.. x h]: forward shapes
        for width in (h + 2 * model.kv_width, model.ffn * (model.mlp_matrices - 1)):
            total += max(0.0, one - compute.gemm_time(s * b, width / t, h, cluster, elem_bytes=w))
    return total


def end_collectives(model: ModelSpec, layout: Candidate, work: Workload, stage: str) -> list[Collective]:
    """The embedding (stage "first"), the LM head and loss (stage "last"), or both ("all", p = 1);
    one micro-batch."""
    s, b, h = layout.local_seq(model.seq), layout.microbatch, model.hidden
    activation = s * b * h * work.bytes_per_value
    out = []
    if stage in ("first", "all"):
        if layout.sequence_parallel:
            out += [Collective("reduce_scatter", activation, 1), Collective("all_gather", activation, 1)]
            if not model.rotary:   # the position-embedding gradient: [s/t, h] per rank, gathered in fp32/16
                out.append(Collective("all_gather", s * h * work.bytes_per_value, 1))
        else:
            out.append(Collective("all_reduce", activation, 1))
    if stage in ("last", "all"):
        if layout.sequence_parallel:
            out += [Collective("all_gather", activation, 2), Collective("reduce_scatter", activation, 1)]
        else:
            out.append(Collective("all_reduce", activation, 1))
        out.append(Collective("all_reduce", s * b * 4, 3))   # cross entropy: fp32 per token
    return out


def shared_gradient_collectives(model: ModelSpec, layout: Candidate, grad_bytes: float,
                                microbatches: int) -> list[Collective]:
    """Per step, SP only: the TP sum of the replicated parameters' gradients (h values per tensor:
    per layer 2 norms' weights (+ biases for LayerNorm) and, with biases, the attention-projection and
    fc2 biases; + the final norm). The q/k norms' head_dim-wide sums (any t > 1, SP or not) are left out:
    2 head_dim values per layer, next to these h-wide ones."""
    if not layout.sequence_parallel or layout.tp == 1:
        return []
    norm_tensors = 1 if model.rmsnorm else 2
    per_layer = 2 * norm_tensors + int(model.has_out_proj_bias) + int(model.linear_bias)
    tensors = per_layer * model.layers / layout.pp + norm_tensors
    if layout.zero_stage <= 1 or (layout.zero_stage == 2 and layout.pp > 1):   # ZeRO-2 at p > 1: stage-1 engine
        return [Collective("all_reduce", tensors * model.hidden * grad_bytes, 1)]
    return [Collective("all_reduce", model.hidden * grad_bytes, microbatches * tensors)]


def per_step_collectives(model: ModelSpec, layout: Candidate, work: Workload, stage: str, microbatches: int,
                         grad_bytes: float) -> list[Collective]:
    """Everything above for one step of one GPU of ``stage``: the layers of one pipeline stage and the
    stage's ends, for every micro-batch, plus the per-step shared-gradient sum."""
    layers = model.layers / layout.pp
    out = [Collective(c.kind, c.nbytes, c.calls * layers * microbatches, c.regather)
           for c in layer_collectives(model, layout, work)]
    out += [Collective(c.kind, c.nbytes, c.calls * microbatches)
            for c in end_collectives(model, layout, work, stage)]
    return out + shared_gradient_collectives(model, layout, grad_bytes, microbatches)


def collectives_time(collectives: list[Collective], tp: int, cluster: Cluster) -> float:
    return sum(c.time(tp, cluster) for c in collectives)


def per_step_time(model: ModelSpec, layout: Candidate, work: Workload, cluster: Cluster, stage: str,
                  microbatches: int, grad_bytes: float) -> float:
    """Exposed seconds of :func:`per_step_collectives` (re-gathers partly hidden, see layer_time)."""
    ends = end_collectives(model, layout, work, stage)
    return (microbatches * (model.layers / layout.pp * layer_time(model, layout, work, cluster)
                            + collectives_time(ends, layout.tp, cluster))
            + collectives_time(shared_gradient_collectives(model, layout, grad_bytes, microbatches), layout.tp,
                               cluster))
