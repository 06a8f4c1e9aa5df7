"""``--compile``: torch.compile each transformer layer, on CPU (Inductor's C++ backend) and CUDA alike.

One layer at a time rather than the whole model: every layer has the same code and shapes, so Inductor
compiles the forward and backward graph once and the other layers reuse it; the pipeline's stage
boundaries and DeepSpeed's engine stay outside the compiled graphs. The tensor-parallel collectives inside
a layer are in its graph: traced, :mod:`mtds.tp.mappings` calls torch's functional collectives (its eager
``async_op=True`` calls were graph breaks: 14 in two GPT-2 layers at t = 2, 22 with sequence
parallelism). What is compiled is the layer's computation (``TransformerLayer._forward``); its profiler
range and the keying of its dropout streams stay outside.
With dropout a layer is still one graph: the replicated masks are drawn before it and the sharded stream
sits in the default generator while it runs (mtds.tp.random), so no generator swap breaks it; selective
recomputation inside it is torch's own checkpoint, which Dynamo traces. Inductor draws dropout masks from
torch's generators (``fallback_random``), so the keyed masks are the eager ones. ZB-H1 is refused (its
backward defers weight GEMMs, which AOTAutograd cannot trace). An MoE block runs eagerly inside its compiled
layer (``MoEBlock.forward`` is ``torch.compiler.disable``d: one break per MoE layer). Parameters, their names
and checkpoints are untouched.
"""
from __future__ import annotations

import torch
from torch import nn


def compile_layers(model: nn.Module, backend: str = "inductor") -> int:
    """Compile every :class:`~mtds.model.layer.TransformerLayer` inside ``model``; how many. ``backend``:
    torch.compile's (tests use "aot_eager": the same graph capture and autograd split, no code generation)."""
    from mtds.model.layer import TransformerLayer
    import torch._inductor.config as inductor_config
    inductor_config.fallback_random = True    # dropout masks from the (keyed) torch generators
    layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]
    for layer in layers:
        layer._forward = torch.compile(layer._forward, backend=backend)   # instance attribute: the module's own forward calls it
    return len(layers)
