"""Megatron-LM's own training code (``megatron.training`` of the megatron-core 0.19 wheel) on CPU gloo ranks:
the writer and reader oracle of tests/test_megatron_lm.py. Test-only (lab/ is not installed).

    python -m lab.megatron_lm JOB.json      (PYTHONPATH: the 0.19 install first, then the repository)

JOB.json: {"world": 2, "ids": [[...]], "save": [{"key", "root", "argv", "train_step", "micro"}...],
"load": [{"root", "argv", "key"}...], "defaults": {"argv", "out"}, "out": "results.pt"}. Each save builds
the model as Megatron-LM's pretrain does (``parse_args`` + ``validate_args`` on the argv, ``get_model``,
``get_megatron_optimizer``),
optionally takes one training step, records its logits and per-token loss on ``ids`` through its own
pipeline schedule, and writes the checkpoint with ``save_checkpoint`` (``--ckpt-format torch_dist``). Each
load builds the model from the argv, reads the checkpoint with ``load_checkpoint`` and records its logits.
Rank 0 writes {key: tensor} to ``out``, and the plain fields of the args Megatron-LM makes of the
``defaults`` argv to that JSON file.

The shims (in this process only; Megatron-core assumes CUDA in a few places) follow
../shared/tools/peers/bench_peer.py and ../shared/notes/megatron_core_on_cpu.md: the CUDA RNG, streams and
``.cuda()`` made CPU ones; ``'cuda'`` string constants in the pipeline schedules and grad buffers made
``'cpu'``; triton's MoE kernel module stubbed (MoE is never built); ``typing.override`` (Python 3.12) an
identity on 3.11; the GPU arch query answered.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import types

from lab.code_strings import rewrite_module

# Megatron-LM's launch scripts set this; its validate_args asks for it with TP/SP overlap checks.
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")

# Flags every run here needs on a CUDA-less machine (local transformer, no fused kernels, gloo).
CPU_FLAGS = ["--transformer-impl", "local", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
             "--no-persist-layer-norm", "--no-rope-fusion", "--use-cpu-initialization",
             "--distributed-backend", "gloo", "--ckpt-format", "torch_dist", "--save-interval", "1"]


def _pre_import_shims() -> None:
    import typing
    if not hasattr(typing, "override"):
        typing.override = lambda f: f
    try:
        import triton  # noqa: F401
    except ImportError:
        # megatron/core/transformer/moe/ops/paged_stash.py imports triton at import time (MoE only)
        m = types.ModuleType("megatron.core.transformer.moe.ops.paged_stash")
        m.GLOBAL_BLOCK_SIZE = 1024

        def _missing(*a, **k):
            raise RuntimeError("no triton")
        m.paged_stash_copy_kernel = m.paged_stash_pop_kernel = _missing
        sys.modules[m.__name__] = m


_TO_CPU = {"cuda": "cpu", "torch.cuda.FloatTensor": "torch.FloatTensor"}


def _cpu_shims() -> None:
    import importlib
    import torch
    import megatron.core.tensor_parallel.random as mrandom
    import megatron.training.arguments as margs
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.empty_cache = lambda: None

    class _NoStream:
        def wait_event(self, *a, **k): pass
        def wait_stream(self, *a, **k): pass
        def synchronize(self): pass
    torch.cuda.current_stream = lambda device=None: _NoStream()
    torch.cuda.Stream = lambda *a, **k: _NoStream()          # get_model's DDP initialization stream
    torch.cuda.stream = lambda s: contextlib.nullcontext()
    torch.Tensor.cuda = lambda self, *a, **k: self
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, *a, **k: torch.set_rng_state(new_state)
    margs.get_device_arch_version = lambda: 9          # an H100's; asked only to pick kernels
    for name in ("megatron.core.optimizer.optimizer", "megatron.core.optimizer.distrib_optimizer",
                 "megatron.core.optimizer.clip_grads", "megatron.core.pipeline_parallel.schedules",
                 "megatron.core.pipeline_parallel.p2p_communication", "megatron.core.transformer.utils",
                 "megatron.core.utils", "megatron.core.distributed.param_and_grad_buffer",
                 "megatron.training.checkpointing", "megatron.training.utils"):
        rewrite_module(importlib.import_module(name), _TO_CPU)


def _parse(argv: list[str]):
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.global_vars import set_global_variables, unset_global_variables
    saved, sys.argv = sys.argv, ["pretrain_gpt.py", *argv, *CPU_FLAGS]
    try:
        args = parse_args()
    finally:
        sys.argv = saved
    if args.use_checkpoint_args:        # as initialize_megatron does: the model's args from --load's checkpoint
        from megatron.training.checkpointing import load_args_from_checkpoint
        load_args_from_checkpoint(args)
    validate_args(args)
    if getattr(args, "padded_vocab_size", None) is None:      # pretrain sets it from the tokenizer
        from megatron.training.vocab_utils import calculate_padded_vocab_size
        args.padded_vocab_size = calculate_padded_vocab_size(args.vocab_size, args.make_vocab_size_divisible_by,
                                                             args.tensor_model_parallel_size, logging_enabled=False)
    unset_global_variables()
    set_global_variables(args, build_tokenizer=False)
    return args


def _model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.training import get_args
    from megatron.training.argument_utils import core_transformer_config_from_args
    args = get_args()
    cfg = core_transformer_config_from_args(args)
    return GPTModel(cfg, get_gpt_layer_local_spec(normalization=args.normalization),
                    vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                    pre_process=pre_process, post_process=post_process, parallel_output=True,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
                    rotary_base=args.rotary_base, vp_stage=vp_stage)


def _setup(argv: list[str], with_optimizer: bool):
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.training.training import get_model, get_megatron_optimizer_config
    args = _parse(argv)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                                 virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    model = get_model(_model_provider)
    optimizer = scheduler = None
    if with_optimizer:
        from megatron.core.optimizer import get_megatron_optimizer
        from megatron.training.training import get_optimizer_param_scheduler
        config, config_overrides = get_megatron_optimizer_config(args)
        optimizer = get_megatron_optimizer(config, model, config_overrides=config_overrides)
        scheduler = get_optimizer_param_scheduler(optimizer)
    return args, model, optimizer, scheduler


def _forward(model, ids, *, forward_only: bool, micro: int | None = None):
    """Logits [b, s, V] (full vocabulary) and per-token loss [b, s-1] on the last stage, through Megatron's
    schedule (``micro`` rows per micro-batch; interleaved with virtual pipeline chunks); labels are ids
    shifted by one."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    b, s = ids.shape
    micro = micro or b
    batches = [(ids[i:i + micro, :-1], ids[i:i + micro, 1:]) for i in range(0, b, micro)]
    mask = torch.triu(torch.ones(1, 1, s - 1, s - 1, dtype=torch.bool), diagonal=1)
    pos = torch.arange(s - 1).unsqueeze(0).expand(micro, s - 1)
    kept = {"logits": [], "loss": []}

    def step(it, m):
        tokens, labels = next(it)
        out = m(tokens, pos, mask)                        # [b, s, V/t] (parallel_output)

        def loss_func(o):
            from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
            kept["logits"].append(gather_from_tensor_model_parallel_region(o.detach()))
            # its cross entropy shifts the logits in place: give it a copy
            copy = o.transpose(0, 1).float().clone(memory_format=torch.contiguous_format)
            per_token = vocab_parallel_cross_entropy(copy, labels.transpose(0, 1).contiguous()).transpose(0, 1)
            kept["loss"].append(per_token.detach())
            return per_token.mean(), {"lm loss": per_token.mean().detach()}
        return out, loss_func

    iterator = [iter(batches) for _ in model] if len(model) > 1 else iter(batches)
    get_forward_backward_func()(forward_step_func=step, data_iterator=iterator, model=model,
                                num_microbatches=len(batches), seq_length=s - 1, micro_batch_size=micro,
                                forward_only=forward_only)
    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        return {}
    return {k: torch.cat(v) for k, v in kept.items()}


def _save(job, ids, results):
    import torch
    from megatron.training.checkpointing import save_checkpoint
    args, model, optimizer, scheduler = _setup(job["argv"] + ["--save", job["root"]], with_optimizer=True)
    if job.get("train_step"):
        for m in model:
            m.train()
            m.zero_grad_buffer()
        optimizer.zero_grad()
        _forward(model, ids, forward_only=False, micro=job.get("micro"))
        ok, _, _ = optimizer.step()
        assert ok, "the training step was skipped"
    for m in model:
        m.eval()
    with torch.no_grad():
        kept = _forward(model, ids, forward_only=True, micro=job.get("micro"))
    results.update({f"{job['key']}/{k}": v for k, v in kept.items()})
    save_checkpoint(1, model, optimizer, scheduler, 0)
    _stop_writer()


def _stop_writer() -> None:
    """The torch_dist writer's spawned results Manager lives in a module global: shut it down."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    queue = getattr(filesystem_async, "_results_queue", None)
    if queue is not None and getattr(queue, "_manager", None) is not None:
        queue._manager.shutdown()
    filesystem_async._results_queue = None


def _load(job, ids, results):
    import torch
    from megatron.training.checkpointing import load_checkpoint
    args, model, _, _ = _setup(job["argv"] + ["--load", job["root"], "--no-load-optim", "--no-load-rng",
                                              "--finetune"], with_optimizer=False)
    # random weights first: the load must replace every one
    load_checkpoint(model, None, None, strict=True)
    for m in model:
        m.eval()
    with torch.no_grad():
        kept = _forward(model, ids, forward_only=True)
    results.update({f"{job['key']}/{k}": v for k, v in kept.items()})


def _worker(rank: int, job: dict, port: int) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(job["world"]), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    _pre_import_shims()
    dist.init_process_group("gloo", rank=rank, world_size=job["world"])
    _cpu_shims()
    from megatron.core.package_info import MAJOR, MINOR     # not the suite venv's 0.16 behind it on the path
    assert (int(MAJOR), int(MINOR)) >= (0, 17), f"megatron-core {MAJOR}.{MINOR} found first on the path"
    ids = torch.tensor(job["ids"])
    results: dict = {}
    if "defaults" in job and rank == 0:          # what parse_args + validate_args make of these flags
        args = _parse(job["defaults"]["argv"])
        plain = {k: v for k, v in vars(args).items() if isinstance(v, (bool, int, float, str, type(None)))}
        with open(job["defaults"]["out"], "w") as f:
            json.dump(plain, f)
    for save in job.get("save", ()):
        _save(save, ids, results)
    for load in job.get("load", ()):
        _load(load, ids, results)
    gathered = [None] * job["world"]
    dist.all_gather_object(gathered, results)
    if rank == 0:
        merged = {}
        for r in gathered:
            merged.update(r)
        torch.save(merged, job["out"])
    dist.barrier()
    dist.destroy_process_group()


def main(path: str) -> None:
    import socket
    import torch.multiprocessing as mp
    with open(path) as f:
        job = json.load(f)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_worker, args=(job, port), nprocs=job["world"], start_method="spawn")


if __name__ == "__main__":
    main(sys.argv[1])
