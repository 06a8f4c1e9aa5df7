"""Megatron-core's MoE layer on CPU ranks (gloo): the Megatron-core side of benchmarks/bench_moe.py.

Runs in the peers' interpreter (Megatron-core 0.19.2; ``PEERS_PYTHON``, see benchmarks/peer_runner.py), never
in mtds's: bench_moe.py writes the job (mtds's block weights at e = 1, each rank's tokens, upstream gradient and
mtds's output for them) with :func:`write_job` and starts this script on e ranks; mtds imports nothing of
Megatron. This file needs nothing of mtds either, except ``mtds.observe.comm_trace`` (plain torch) to count the
all-to-all bytes the same way as on mtds's side.

    $PEERS_PYTHON benchmarks/megatron_moe.py --job DIR --ranks e [--iters 10] [--warmup 2] [--threads 1]
                                             [--out FILE.json] [--grads FILE.pt]

What runs: ``MoELayer`` built by Megatron-core's own spec, ``get_moe_module_spec(use_te=False,
moe_grouped_gemm=False)`` (the local backend, no Transformer Engine): ``TopKRouter`` (softmax score function,
``moe_router_pre_softmax=False``: the top-k of the logits, then a softmax over those k, which is the softmax over
all experts renormalised over the top k: Mixtral's routing; ``moe_router_dtype='fp32'``, no aux loss:
``moe_router_load_balancing_type='none'``, coefficient 0, no z-loss, no jitter, dropless: no capacity factor),
``MoEAlltoAllTokenDispatcher`` (``moe_token_dispatcher_type='alltoall'``, no permute fusion) and ``SequentialMLP``
(E/e ``MLP`` experts of ``ColumnParallelLinear`` fc1 [2F, h] = [gate; up] and ``RowParallelLinear`` fc2 [h, F],
``gated_linear_unit=True``, ``activation_func=F.silu``, no bias, no bias-activation fusion; the routing weight
multiplies each row after the SwiGLU, before fc2). fp32, TP 1, EP = the e ranks
(``initialize_model_parallel(expert_model_parallel_size=e)``).

Grouped GEMM: in 0.19.2 the local backend (``LocalSpecProvider.grouped_mlp_modules``) returns ``SequentialMLP``
whatever ``moe_grouped_gemm`` says; the grouped experts are ``TEGroupedMLP`` (Transformer Engine's GroupedLinear,
not installable on CPU) and, for inference only, ``InferenceGroupedMLP`` (a ``TEGroupedMLP`` whose forward under
``InferenceMode`` may take torch's ``grouped_mm``, bf16, squared-ReLU only). So no torch-grouped-mm training path on
CPU: Megatron-core runs one fc1/fc2 pair per local expert here.

CPU shims (:func:`cpu_shims`, applied in this process only, listed in the JSON under "patches"): a copy of the
shared tools' Megatron shims (../shared/tools/peers/bench_peer.py), cut down to what the MoE layer reaches and
extended by the dispatcher's streams:
- the stub module ``megatron.core.transformer.moe.ops.paged_stash`` (it imports triton at import time, reached from
  ``import megatron.core`` through pipeline_parallel.schedules; never called here) -- shared;
- ``torch.cuda.current_device`` -> cpu (the router moves its weight there in ``gating``; ``_AllToAll`` allocates
  its output there) -- shared;
- ``torch.cuda.current_stream`` -> one no-op stream (shared), extended: the same object on every call, with
  ``record_event`` giving a no-op event; ``torch.cuda.stream(s)`` -> a null context; and
  ``MoEAlltoAllTokenDispatcher.cuda_dtoh_stream`` preset to that stream (its ``__init__`` makes a
  ``torch.cuda.Stream()`` for the device-to-host copies of the split sizes: "torch.cuda.Stream requires CUDA
  support");
- the dispatcher's ``maybe_move_tensor_to_cpu`` (its name in token_dispatcher) turns a host tensor into numpy when
  asked ``as_numpy``, as it does a CUDA one: on CPU the split sizes are already host tensors, which it returned as
  tensors, and ``torch.distributed.all_to_all_single`` (gloo, torch 2.13) rejects tensor split sizes
  ("incompatible function arguments", token_dispatcher.py line 698, at e > 1; at e = 1 no all-to-all is made).
Not needed here and left out: the RNG-tracker shims (``perform_initialization=False``: the weights are copied in),
``Tensor.cuda``, the norm and the 'cuda'-constant rewrites (DDP, optimizer, schedules are not used).

Timing as mtds's side: per iteration the slowest rank's forward + backward (a barrier before, outside the time;
the input cloned with requires_grad inside it, parameter gradients set to None before it), median after warm-up,
with the process time beside it. Bytes: one traced iteration before the timed ones, ``CommTracer`` on the expert
group. Per rank Megatron's dispatcher sends the N·k rows and their N·k routing weights (fp32) forward, the R rows it
received back after the experts, and in backward the R row gradients and R weight gradients, then the N·k output
gradients: 4·h·(2Nk + 2R) + 4·(Nk + R) bytes of all-to-all; over the ranks ΣR = e·N·k, so
    Megatron-core:  16·h·e·N·k + 8·e·N·k
(the routing weights travel with the rows because ``SequentialMLP`` applies them on the expert's rank). The
per-expert counts are all-gathered (E int64 per rank, ``gather_from_sequence_parallel_region`` on the TP×EP group),
not all-to-all: e·8E bytes of all-gather, also reported. At e = 1 nothing is exchanged (``_AllToAll`` returns its
input; the tracer counts no group of one rank).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback
import types

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATCHES: list[str] = []
_SHIMMED = False


# ----------------------------------------------------------------------------------------------------
# the job (written by bench_moe.py in mtds's interpreter, read here): torch.save files, no pickled classes
# ----------------------------------------------------------------------------------------------------
def write_job(directory: str, shape: dict, router, gate_up, down, per_rank: list[dict]) -> None:
    """``shape``: hidden, experts, ffn, top_k, tokens; ``router`` [E, h], ``gate_up`` [E, 2F, h] (gate rows
    first), ``down`` [E, h, F]: mtds's block at e = 1; ``per_rank[r]``: tokens [N, h], upstream [N, h] and
    reference (mtds's output for those tokens)."""
    import torch
    os.makedirs(directory, exist_ok=True)
    torch.save({"shape": dict(shape), "router": router.detach().clone(), "gate_up": gate_up.detach().clone(),
                "down": down.detach().clone()}, os.path.join(directory, "weights.pt"))
    for r, tensors in enumerate(per_rank):
        torch.save({k: v.detach().clone() for k, v in tensors.items()}, os.path.join(directory, f"rank{r}.pt"))


# ----------------------------------------------------------------------------------------------------
# CPU shims (module docstring)
# ----------------------------------------------------------------------------------------------------
class _NoEvent:
    def synchronize(self):
        pass

    def wait(self, *a, **k):
        pass


class _NoStream:
    def wait_event(self, *a, **k):
        pass

    def wait_stream(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def record_event(self, *a, **k):
        return _NoEvent()


def cpu_shims() -> list[str]:
    """What the MoE layer needs to run without CUDA (and triton); idempotent; the list of what was applied."""
    global _SHIMMED
    if _SHIMMED:
        return PATCHES
    _SHIMMED = True
    import torch
    try:
        import triton  # noqa: F401
    except ImportError:
        m = types.ModuleType("megatron.core.transformer.moe.ops.paged_stash")
        m.GLOBAL_BLOCK_SIZE = 1024

        def _missing(*a, **k):
            raise RuntimeError("paged_stash triton kernels unavailable (no triton)")
        m.paged_stash_copy_kernel = m.paged_stash_pop_kernel = _missing
        sys.modules[m.__name__] = m
        PATCHES.append("stub module megatron.core.transformer.moe.ops.paged_stash (unconditional import triton)")
    if torch.cuda.is_available():
        return PATCHES
    torch.cuda.current_device = lambda: torch.device("cpu")
    PATCHES.append("torch.cuda.current_device -> cpu (TopKRouter.gating moves its weight there, _AllToAll's output)")
    stream = _NoStream()
    torch.cuda.current_stream = lambda device=None: stream
    torch.cuda.stream = lambda s=None: contextlib.nullcontext()
    PATCHES.append("torch.cuda.current_stream -> one no-op stream (record_event -> no-op event), "
                   "torch.cuda.stream -> null context (the all-to-all dispatcher's device-to-host copies)")
    from megatron.core.transformer.moe import token_dispatcher
    token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = stream
    PATCHES.append("MoEAlltoAllTokenDispatcher.cuda_dtoh_stream preset to the no-op stream "
                   "(its __init__ makes torch.cuda.Stream(): 'requires CUDA support')")
    to_host = token_dispatcher.maybe_move_tensor_to_cpu

    def to_host_on_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return to_host(tensor, as_numpy=as_numpy, record_stream=record_stream)
    token_dispatcher.maybe_move_tensor_to_cpu = to_host_on_cpu
    PATCHES.append("token_dispatcher.maybe_move_tensor_to_cpu: as_numpy=True gives numpy for a host tensor too, as "
                   "for a CUDA one (the split sizes; all_to_all_single rejects tensor split sizes)")
    return PATCHES


# ----------------------------------------------------------------------------------------------------
# the layer
# ----------------------------------------------------------------------------------------------------
EXPERTS_IMPL = "local spec: one ColumnParallelLinear fc1 / RowParallelLinear fc2 pair per local expert, in turn"


def build_layer(shape: dict, ep: int):
    """Megatron-core's ``MoELayer`` as compared (module docstring); ``initialize_model_parallel`` first."""
    import torch
    import torch.nn.functional as F
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    h, E, ffn, k = shape["hidden"], shape["experts"], shape["ffn"], shape["top_k"]
    cfg = TransformerConfig(
        num_layers=1, hidden_size=h, num_attention_heads=4, ffn_hidden_size=ffn, hidden_dropout=0.0,
        attention_dropout=0.0, params_dtype=torch.float32, use_cpu_initialization=True, perform_initialization=False,
        add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=False,
        num_moe_experts=E, moe_ffn_hidden_size=ffn, moe_router_topk=k, moe_router_score_function="softmax",
        moe_router_pre_softmax=False, moe_router_dtype="fp32", moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None, moe_input_jitter_eps=None, moe_expert_capacity_factor=None,
        moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False, moe_permute_fusion=False,
        moe_router_fusion=False, expert_model_parallel_size=ep, tensor_model_parallel_size=1)
    layer = get_moe_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False)(config=cfg)
    return layer


def load_weights(layer, weights: dict) -> None:
    """The router := mtds's router; local expert i := global expert ``local_expert_indices[i]``: fc1 := its
    [gate; up] rows (Megatron's GLU chunks fc1's output in that order: silu(first half) * second half),
    fc2 := its down."""
    import torch
    with torch.no_grad():
        layer.router.weight.copy_(weights["router"])
        for i, expert in zip(layer.local_expert_indices, layer.experts.local_experts):
            expert.linear_fc1.weight.copy_(weights["gate_up"][i])
            expert.linear_fc2.weight.copy_(weights["down"][i])


# ----------------------------------------------------------------------------------------------------
# one rank
# ----------------------------------------------------------------------------------------------------
def _rank(rank: int, world: int, port: int, a, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist
    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = _measure(rank, world, a)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(result, f)
    except BaseException as e:  # noqa: BLE001
        with open(f"{out_path}.err{rank}", "w") as f:
            f.write("".join(traceback.format_exception_only(type(e), e)).strip() + "\n" + traceback.format_exc())
        raise
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _measure(rank: int, world: int, a) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from mtds.observe.comm_trace import CommTracer

    weights = torch.load(os.path.join(a.job, "weights.pt"))
    mine = torch.load(os.path.join(a.job, f"rank{rank}.pt"))
    shape = weights["shape"]
    ps.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=world)
    layer = build_layer(shape, world)
    load_weights(layer, weights)
    layer.train()
    ep_group, tp_ep_group = ps.get_expert_model_parallel_group(), ps.get_expert_tensor_and_model_parallel_group()
    rows_seen = []
    layer.experts.register_forward_pre_hook(lambda mod, args: rows_seen.append(int(args[0].shape[0])))

    tokens, upstream = mine["tokens"].unsqueeze(1), mine["upstream"].unsqueeze(1)   # [s, b, h], b = 1

    def step():
        x = tokens.clone().requires_grad_(True)
        out, bias = layer(x)
        out.backward(upstream)
        return out, x

    with torch.no_grad():
        diff = (layer(tokens)[0].squeeze(1) - mine["reference"]).abs().max().item()
    with CommTracer() as tracer:
        tracer.name_group(ep_group, "ep")
        if tp_ep_group is not ep_group:
            tracer.name_group(tp_ep_group, "tp_ep")
        for p in layer.parameters():
            p.grad = None
        out, x = step()
    traced = tracer.summary()
    if a.grads:     # one process: what the test compares with mtds's block
        torch.save({"output": out.detach().squeeze(1), "input_grad": x.grad.squeeze(1),
                    "router_grad": layer.router.weight.grad,
                    "fc1_grads": [e.linear_fc1.weight.grad for e in layer.experts.local_experts],
                    "fc2_grads": [e.linear_fc2.weight.grad for e in layer.experts.local_experts]}, a.grads)
    rows = rows_seen[-1]

    times, cpu = [], []
    for it in range(a.warmup + a.iters):
        for p in layer.parameters():
            p.grad = None
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        step()
        elapsed, elapsed_cpu = time.perf_counter() - start, time.process_time() - start_cpu
        if it >= a.warmup:
            times.append(elapsed)
            cpu.append(elapsed_cpu)
    slowest = torch.tensor([times, cpu], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    counts = {key: v["bytes"] for key, v in traced.items() if key.split("/")[0] in ("all_to_all", "all_gather")}
    sums = torch.tensor([counts.get("all_to_all/ep", 0),
                         counts.get("all_gather/tp_ep", 0) + counts.get("all_gather/ep", 0), rows], dtype=torch.int64)
    per_rank_rows = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(per_rank_rows, sums[2:3].clone())
    dist.all_reduce(sums)
    worst = torch.tensor([diff], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    from importlib.metadata import version
    return {"iter_s": slowest[0].tolist(), "iter_cpu_s": slowest[1].tolist(),
            "median_s": statistics.median(slowest[0].tolist()), "median_cpu_s": statistics.median(slowest[1].tolist()),
            "all_to_all_bytes": int(sums[0]), "all_gather_bytes": int(sums[1]), "traced_rank0": traced,
            "rows": [int(t) for t in per_rank_rows], "max_diff": float(worst), "torch_threads": torch.get_num_threads(),
            "experts_impl": f"{type(layer.experts).__name__} ({EXPERTS_IMPL})",
            "dispatcher": type(layer.token_dispatcher).__name__, "router": type(layer.router).__name__,
            "version": version("megatron-core"), "torch": torch.__version__, "patches": list(PATCHES)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(a) -> dict:
    """The e ranks, forked from this process after the imports and shims (each rank imports nothing more)."""
    import multiprocessing as mp

    from mtds.observe.comm_trace import CommTracer
    # the tracer's wrappers go on before Megatron-core is imported: its mappings keep a reference to
    # all_gather_into_tensor (``dist_all_gather_func``), which the count exchange calls
    CommTracer().install().uninstall()
    cpu_shims()
    import megatron.core.transformer.moe.moe_layer  # noqa: F401   (imported once, before the fork)
    from megatron.core.models.gpt import moe_module_specs  # noqa: F401
    out_path = tempfile.mktemp(prefix="megatron_moe_", suffix=".json")
    port = _free_port()
    if a.ranks == 1:
        _rank(0, 1, port, a, out_path)
    else:
        ctx = mp.get_context("fork")
        procs = [ctx.Process(target=_rank, args=(r, a.ranks, port, a, out_path)) for r in range(a.ranks)]
        for p in procs:
            p.start()
        deadline = time.time() + a.timeout
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.time()))
        for p in procs:          # only the ranks this call started
            if p.is_alive():
                p.terminate()
                p.join(5)
    if os.path.exists(out_path):
        with open(out_path) as f:
            result = json.load(f)
        os.unlink(out_path)
        return result
    errors = []
    for r in range(a.ranks):
        path = f"{out_path}.err{r}"
        if os.path.exists(path):
            with open(path) as f:
                errors.append(f"rank {r}: " + f.read())
            os.unlink(path)
    return {"error": "\n".join(errors) or "timed out or died without a message"}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--job", required=True, help="the folder write_job wrote")
    ap.add_argument("--ranks", type=int, default=2, help="e: expert-parallel size = world size")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--out", default=None, help="write the JSON here (else: stdout)")
    ap.add_argument("--grads", default=None, help="one rank: save output and gradients here (the test's check)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    sys.path.insert(0, REPO)          # mtds.observe.comm_trace
    import warnings
    warnings.filterwarnings("ignore")
    result = run(a)
    text = json.dumps(result)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    else:
        print(text)
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())
