"""Sequence parallelism sums the gradients of parameters shared by the sequence shards (norms,
row-parallel biases) over the TP group in one all-reduce per step under ZeRO-0/1, and per use under
ZeRO-2 (which reduce-scatters each gradient as soon as backward produces it). Loss parity of these
paths is in tests/test_parity.py (sequence-parallel layouts at ZeRO-0, 1, 2 and 3)."""
import pytest

from tests.training_helpers import BATCH, SEQ, TINY, ds_config, run_layouts, train_config

ZEROS = (0, 1, 2)


@pytest.fixture(scope="module")
def runs():
    """One 2-rank launch: (2,1,1) without and with SP at each ZeRO stage, then (1,1,2) ZeRO-1."""
    configs = [train_config(tp=2, steps=1, sequence_parallel=sp, deepspeed_config=ds_config(zero=z))
               for z in ZEROS for sp in (False, True)]
    configs.append(train_config(tp=1, steps=1, deepspeed_config=ds_config(zero=1)))
    return run_layouts(2, configs)[0]


def test_shared_parameter_gradients_all_reduce_once_per_step_under_zero_0_and_1(runs):
    results = runs[:-1]
    m = BATCH["train_batch_size"] // BATCH["train_micro_batch_size_per_gpu"]     # micro-batches per step (d=1)
    L, h = TINY.num_layers, TINY.hidden_size
    activation = BATCH["train_micro_batch_size_per_gpu"] * SEQ * h * 4          # one fp32 [b, s, h]
    # Without SP each micro-batch all-reduces [b, s, h] over TP 4 times per layer, after the embedding
    # and for the LM head's input gradient; SP replaces all of those by all-gathers/reduce-scatters.
    replaced_calls, replaced_bytes = m * (4 * L + 2), m * (4 * L + 2) * activation
    shared = 6 * L + 2                       # per layer 2 norms x (weight, bias) + 2 biases; final norm
    shared_bytes = (4 * L * h + 2 * L * h + 2 * h) * 4
    for index, zero in enumerate(ZEROS):
        plain, sp = (results[2 * index + i].comm["all_reduce/tp"] for i in (0, 1))
        if zero < 2:    # one flat all-reduce of all shared gradients per step
            calls, nbytes = 1, shared_bytes
        else:           # per parameter per micro-batch
            calls, nbytes = m * shared, m * shared_bytes
        assert sp["calls"] == plain["calls"] - replaced_calls + calls, (zero, plain, sp)
        assert sp["bytes"] == plain["bytes"] - replaced_bytes + nbytes, (zero, plain, sp)
        # what replaces them, per micro-batch: reduce-scatters after the out/fc2 projections and the
        # embedding (forward) and of the QKV/fc1/LM-head input gradients (backward); all-gathers of the
        # QKV/fc1/LM-head inputs in forward and again in backward (only slices are kept), of the
        # out/fc2 output gradients, and of the embedding and position gradients
        comm = results[2 * index + 1].comm
        assert comm["reduce_scatter/tp"]["calls"] == m * (4 * L + 2), comm
        assert comm["all_gather/tp"]["calls"] == m * (6 * L + 4), comm


def test_run_traces_the_collectives_deepspeed_caches(runs):
    # run() installs its tracer before DeepSpeed starts, so ZeRO-1's all-gather of the updated
    # partitions (called through a function DeepSpeed looks up once) is counted
    assert runs[-1].comm.get("all_gather/dp", {}).get("calls", 0) >= 1, runs[-1].comm


def test_planner_counts_the_tensor_parallel_collectives_the_trainer_runs(runs):
    """The planner's per-step TP collectives (mtds.plan.tp_comm, which its time model sums) equal, call
    for call and bus byte for bus byte, what the tracer saw at (2,1,1) with and without SP, ZeRO-0/1/2."""
    from mtds.plan.candidate import Candidate, Workload
    from mtds.plan.model_spec import ModelSpec
    from mtds.plan.tp_comm import per_step_collectives

    model = ModelSpec.from_config(TINY, seq=SEQ)
    b = BATCH["train_micro_batch_size_per_gpu"]
    work = Workload(BATCH["train_batch_size"], precision="fp32")
    for index, (zero, sp) in enumerate((z, sp) for z in ZEROS for sp in (False, True)):
        layout = Candidate(2, 1, 1, b, zero_stage=zero, recompute="none", sequence_parallel=sp)
        predicted = {}
        for c in per_step_collectives(model, layout, work, "all", layout.microbatches(work.global_batch), 4):
            calls, bus = predicted.get(c.kind, (0, 0))
            predicted[c.kind] = (calls + c.calls, bus + c.bus_bytes(2))
        measured = {key.split("/")[0]: (s["calls"], s["bus_bytes"])
                    for key, s in runs[index].comm.items() if key.endswith("/tp")}
        if zero >= 1:   # ZeRO's grad-norm sum: one fp32 scalar over the model-parallel group (= TP at p = 1)
            calls, bus = predicted["all_reduce"]
            predicted["all_reduce"] = (calls + 1, bus + 4)
        predicted = {kind: (round(calls), round(bus)) for kind, (calls, bus) in predicted.items()}
        assert predicted == measured, (zero, sp, predicted, measured)
