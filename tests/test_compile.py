"""--compile (torch.compile of each transformer layer) keeps HF parity: logits, loss and every parameter
gradient of GPT-2 and Llama (GQA, RoPE, RMSNorm, SwiGLU, untied head) within the fp32 tolerance of the eager
parity tests (1e-5 absolute), one process.

The suite compiles with the "aot_eager" backend: Dynamo's capture of the layer (the tensor-parallel autograd
functions, the rotary cache, the profiler range outside) and AOTAutograd's forward/backward split, without
Inductor's C++ code generation, which costs ~20 s warm and ~55 s cold here. The Inductor parity check
(``MTDS_TEST_INDUCTOR=1``) is run and reported in docs/benchmarks.md."""
import os

from tests.dist import spawn
from tests.test_hf_parity import TOL

BACKEND = "inductor" if os.environ.get("MTDS_TEST_INDUCTOR") else "aot_eager"


def _compiled_parity():
    from mtds.model import compile as mtds_compile
    from tests import test_hf_parity
    import mtds.model

    compiled = []

    class CompiledGPT(mtds.model.GPTModel):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            compiled.append(mtds_compile.compile_layers(self, backend=BACKEND))

    import torch._dynamo
    torch._dynamo.reset()
    original = test_hf_parity.GPTModel
    test_hf_parity.GPTModel = CompiledGPT
    try:
        results = {name: test_hf_parity.compare_case(name, None) for name in ("gpt2", "llama")}
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        torch._dynamo.reset()
        return results, compiled, graphs
    finally:
        test_hf_parity.GPTModel = original


def test_compiled_layers_match_hf():
    results, compiled, graphs = spawn(_compiled_parity, 1, timeout=600, fresh=bool(os.environ.get("MTDS_TEST_INDUCTOR")))[0]
    assert compiled and all(n > 0 for n in compiled), compiled
    assert graphs >= 2, graphs       # Dynamo captured the layers of both models
    for name, r in results.items():
        assert r["grads_checked"] == r["n_params"], (name, r)
        for key in ("logits", "loss", "grad"):
            assert r[key] < TOL, (name, key, r[key])


def _selective_recompute_with_dropout():
    import dataclasses
    import functools

    import torch._dynamo

    import mtds.model.compile as mtds_compile
    from mtds.training import run
    from tests.training_helpers import TINY, train_config
    original = mtds_compile.compile_layers
    mtds_compile.compile_layers = functools.partial(original, backend="aot_eager")
    try:
        out = {}
        for compiled in (False, True):
            torch._dynamo.reset()
            model = dataclasses.replace(TINY, hidden_dropout=0.1, attention_dropout=0.1)
            result = run(train_config(model=model, steps=3, recompute="selective", compile=compiled))
            out[compiled] = (result.losses, result.grad_norms)
        return out
    finally:
        mtds_compile.compile_layers = original
        torch._dynamo.reset()


def test_compile_with_selective_recompute_and_dropout_equals_eager():
    # Dynamo cannot trace the tracker-replaying checkpoint (it crashed: "checkpoint not implemented for ...
    # context_fn"); the recomputed attention core now runs eagerly inside the compiled layer and replays the
    # same dropout masks. Equal to the eager run within 1e-6 (AOTAutograd's graphs, another op order).
    out = spawn(_selective_recompute_with_dropout, 1, timeout=600)[0]
    (eager_losses, eager_norms), (losses, norms) = out[False], out[True]
    for got, want in ((losses, eager_losses), (norms, eager_norms)):
        assert len(got) == 3 and all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(got, want)), (got, want)
