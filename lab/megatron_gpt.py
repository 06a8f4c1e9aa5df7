"""Megatron-core's own GPTModel on CPU gloo ranks: the oracle of the Megatron checkpoint tests.

It builds the model (local spec: no Transformer Engine), runs its forward at any (t, p), and saves and
loads ``torch_dist`` checkpoints through ``megatron.core.dist_checkpointing`` the way Megatron-LM's
``--ckpt-format torch_dist`` does: ``iter_XXXXXXX/`` beside ``latest_checkpointed_iteration.txt``, the model's
sharded state under the key ``model`` and ``args`` in ``common.pt``. Test-only (lab/ is not installed).

Megatron-core assumes CUDA in a few places a forward and a checkpoint reach; :func:`cpu_shims` swaps
them for CPU equivalents while the body runs and puts torch's own functions back afterwards (the test
pool reuses the ranks). The shims follow ../shared/tools/peers/bench_peer.py, trimmed to what is needed
without an optimizer.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import threading
import warnings
from functools import partial

import torch
import torch.nn.functional as F

from lab.code_strings import rewrite_module

# One spelling of both test models, in Megatron-LM's flag names (the args a torch_dist checkpoint carries).
GPT2_ARGS = dict(position_embedding_type="learned_absolute", normalization="LayerNorm", swiglu=False,
                 untie_embeddings_and_output_weights=False, add_bias_linear=True, add_qkv_bias=False,
                 group_query_attention=False, num_query_groups=None, openai_gelu=True)
# Megatron-LM's default GPT: exact GELU requested, run as the fused bias-GELU (tanh) kernel; untied head.
GPT_FUSED_ARGS = dict(GPT2_ARGS, openai_gelu=False, bias_gelu_fusion=True, untie_embeddings_and_output_weights=True)
LLAMA_ARGS = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                  untie_embeddings_and_output_weights=True, add_bias_linear=False, add_qkv_bias=False,
                  group_query_attention=True, num_query_groups=2, openai_gelu=False, rotary_base=500000)


def model_args(family: str, *, layers=2, hidden=64, heads=4, vocab=128, ffn=None, seq=32) -> argparse.Namespace:
    """Megatron-LM's args for one of the two test families (what its training script would pickle)."""
    extra = {"gpt2": GPT2_ARGS, "gpt_fused": GPT_FUSED_ARGS, "llama": LLAMA_ARGS}[family]
    return argparse.Namespace(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, kv_channels=hidden // heads,
        ffn_hidden_size=ffn or (3 * hidden if family == "llama" else 4 * hidden), padded_vocab_size=vocab,
        max_position_embeddings=seq, rotary_percent=1.0, norm_epsilon=1e-5, hidden_dropout=0.0,
        attention_dropout=0.0, init_method_std=0.02, make_vocab_size_divisible_by=128, params_dtype=torch.float32,
        **{"rotary_base": 10000, **extra})


@contextlib.contextmanager
def cpu_shims():
    """Megatron-core's CUDA-only calls made CPU ones for the duration (torch's originals restored)."""
    import megatron.core.tensor_parallel.random as mrandom
    saved = [(torch.cuda, n) for n in ("manual_seed", "get_rng_state", "current_device", "current_stream",
                                        "synchronize")]
    saved += [(torch.Tensor, "cuda"), (mrandom, "_get_cuda_rng_state"), (mrandom, "_set_cuda_rng_state")]
    originals = [(obj, name, getattr(obj, name)) for obj, name in saved]

    class _NoStream:
        def wait_event(self, *a, **k): pass
        def wait_stream(self, *a, **k): pass
        def synchronize(self): pass
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.current_device = lambda: torch.device("cpu")           # RoPE, p2p buffers
    torch.cuda.current_stream = lambda device=None: _NoStream()
    torch.cuda.synchronize = lambda device=None: None
    torch.Tensor.cuda = lambda self, *a, **k: self                     # tied-embedding all-reduce at p > 1
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, *a, **k: torch.set_rng_state(new_state)
    before = set(threading.enumerate())
    try:
        yield
    finally:
        for obj, name, value in originals:
            setattr(obj, name, value)
        _settle_threads(before)


def _settle_threads(before: set) -> None:
    """Wait for the worker threads of executors the body dropped: they exit once the executor is collected,
    and the test pool fails a body that leaves a non-daemon thread running (seen once in 6 runs, a
    ThreadPoolExecutor worker on one rank after a checkpoint load)."""
    import concurrent.futures
    gc.collect()
    new = {t for t in set(threading.enumerate()) - before
           if t.name.startswith("ThreadPoolExecutor") and not t.daemon}
    if not new:
        return
    # an executor still referenced somewhere (seen in a loaded CI run: join(10) was not enough) is shut down
    with warnings.catch_warnings():      # isinstance() on some of torch's deprecated objects warns
        warnings.simplefilter("ignore")
        executors = [obj for obj in gc.get_objects() if isinstance(obj, concurrent.futures.ThreadPoolExecutor)]
    for executor in executors:
        if new & set(getattr(executor, "_threads", ())):
            executor.shutdown(wait=True)
    for t in new:
        t.join(timeout=10)


def _rewrite_cuda_strings() -> None:
    """'cuda' -> 'cpu' in the code of the pipeline schedules and p2p (they allocate receive buffers on
    'cuda'). Megatron's code objects only, once per process: nothing of torch is touched."""
    import importlib
    for name in ("megatron.core.pipeline_parallel.schedules", "megatron.core.pipeline_parallel.p2p_communication",
                 "megatron.core.utils"):
        rewrite_module(importlib.import_module(name))


def build(args: argparse.Namespace, tp: int, pp: int, seed: int = 1234):
    """Megatron-core's GPTModel for ``args`` at (tp, pp) over the default process group (world = tp * pp)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    _rewrite_cuda_strings()
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    act = partial(F.gelu, approximate="tanh") if args.openai_gelu else (F.silu if args.swiglu else F.gelu)
    cfg = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        kv_channels=args.kv_channels, ffn_hidden_size=args.ffn_hidden_size, normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon, gated_linear_unit=args.swiglu, activation_func=act,
        add_bias_linear=args.add_bias_linear, add_qkv_bias=args.add_qkv_bias, hidden_dropout=0.0,
        bias_activation_fusion=getattr(args, "bias_gelu_fusion", False),
        attention_dropout=0.0, use_cpu_initialization=True, params_dtype=torch.float32,
        pipeline_dtype=torch.float32, init_method_std=args.init_method_std,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    model = GPTModel(cfg, get_gpt_layer_local_spec(normalization=args.normalization),
                     vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                     pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                     parallel_output=False, position_embedding_type=args.position_embedding_type,
                     rotary_base=args.rotary_base, rotary_percent=args.rotary_percent,
                     share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights)
    return model.eval()


@torch.no_grad()
def logits(model, ids: torch.Tensor) -> torch.Tensor | None:
    """Full logits [b, s, V] on the last pipeline stage (None elsewhere), through Megatron's own schedule."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    b, s = ids.shape
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)   # its default is built on 'cuda'
    pos = torch.arange(s).unsqueeze(0).expand(b, s)

    def step(it, m):
        out = m(next(it), pos, mask)
        return out, lambda o: (o.sum() * 0, {"logits": o})

    out = get_forward_backward_func()(forward_step_func=step, data_iterator=iter([ids]), model=[model],
                                      num_microbatches=1, seq_length=s, micro_batch_size=b, forward_only=True)
    return out[0]["logits"] if ps.is_pipeline_last_stage() and out else None


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _stop_results_manager() -> None:
    """Megatron-core's async writer keeps a spawned multiprocessing Manager (its results queue) in a module
    global for the life of the process. Started with the daemon flag lifted, it outlived the pool rank that
    started it (four orphaned 300 MB processes per test run, seen 2026-11-26): shut it down after the save."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    queue = getattr(filesystem_async, "_results_queue", None)
    if queue is not None and getattr(queue, "_manager", None) is not None:
        queue._manager.shutdown()
    filesystem_async._results_queue = None


def save(model, args: argparse.Namespace, root: str, iteration: int = 1) -> str:
    """What Megatron-LM's save_checkpoint writes for the model with --ckpt-format torch_dist (no optimizer)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    where = iteration_dir(root, iteration)
    if dist.get_rank() == 0:
        os.makedirs(where, exist_ok=True)
    dist.barrier()
    state = {"model": model.sharded_state_dict(), "args": args, "checkpoint_version": 3.0, "iteration": iteration}
    # Megatron-core's torch_dist writer forks worker processes (filesystem_async.py), which multiprocessing
    # refuses inside a daemonic process such as a test-pool rank; they are joined before save returns.
    import multiprocessing
    config = multiprocessing.current_process()._config
    daemon = config.get("daemon")
    config["daemon"] = False
    try:
        dist_checkpointing.save(state, where, sharded_strategy=("torch_dist", 1))
    finally:
        config["daemon"] = daemon
        _stop_results_manager()
    if dist.get_rank() == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))
    dist.barrier()
    return where


def load(model, where: str) -> None:
    """Megatron-LM's load_checkpoint for the model: dist_checkpointing.load of its sharded state dict."""
    from megatron.core import dist_checkpointing
    # common.pt holds args as an argparse.Namespace, which Megatron-LM allows for its weights_only load
    # of it (megatron/training/checkpointing.py registers it as a safe global); Megatron-core alone does not.
    with torch.serialization.safe_globals([argparse.Namespace]):
        state = dist_checkpointing.load({"model": model.sharded_state_dict()}, where)
    model.load_state_dict(state["model"], strict=True)


def teardown() -> None:
    from megatron.core import parallel_state as ps
    ps.destroy_model_parallel()
