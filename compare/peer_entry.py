"""One rank of a peer scheme (``megatron:...``, ``torchtitan:...``): the peer's own model, parallelism and
optimizer, trained on the samples the mtds schemes train on, in the peers' interpreter (``make peers``).

    $PEERS_PYTHON -m torch.distributed.run ... compare/peer_entry.py JOB.json

JOB.json (written by compare.peer_launch): the peer, its layout, the model's shape, the optimizer, the
step count and the path of the token file (``[d, steps, m, 2, b, s]`` int64 inputs and labels; the ranks of data-parallel
index i read row i: the micro-batches mtds.data.MicroBatchStream hands data-parallel rank i). This file
imports nothing of mtds (the peers' interpreter does not have its requirements) and is not imported by
mtds: it writes the same step log and probe files as compare.entry, which compare.table reads.

Megatron-core: GPTModel (local spec, no Transformer Engine), its DDP and distributed optimizer, and
get_forward_backward_func() (1F1B across pipeline stages), the step of Megatron-LM's training.py.
torchtitan: its Llama-3 model, parallelized by its own parallelize_llama (DTensor TP, FSDP2 over the
data-parallel ranks), its loss and its grad clipping.
"""
from __future__ import annotations

import json
import math
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peer_shims import PATCHES, megatron_cpu_shims, torchtitan_cpu_shims   # noqa: E402


def _batches(job: dict, dp_rank: int):
    import numpy as np
    import torch
    tokens = np.load(job["data"], mmap_mode="r")[dp_rank]          # [steps, m, 2, b, s]
    for step in tokens:
        yield [(torch.from_numpy(np.array(mb[0])), torch.from_numpy(np.array(mb[1]))) for mb in step]


def run_megatron(job: dict) -> dict:
    megatron_cpu_shims()
    from functools import partial

    import torch
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.transformer_config import TransformerConfig

    m, o = job["model"], job["optimizer"]
    tp, pp = job["tp"], job["pp"]
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    tensor_parallel.model_parallel_cuda_manual_seed(job["seed"])
    common = dict(num_layers=m["layers"], hidden_size=m["hidden"], num_attention_heads=m["heads"],
                  num_query_groups=m["kv_heads"], ffn_hidden_size=m["ffn"], init_method_std=m["init_std"],
                  use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                  params_dtype=torch.float32, pipeline_dtype=torch.float32, layernorm_epsilon=m["norm_eps"],
                  tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    if m["arch"] == "gpt2":       # HF GPT-2: gelu_new (tanh), LayerNorm, biases, learned positions, tied
        cfg = TransformerConfig(**common, activation_func=partial(F.gelu, approximate="tanh"))
        spec, kw = get_gpt_layer_local_spec(), dict(position_embedding_type="learned_absolute",
                                                   share_embeddings_and_output_weights=m["tied"])
    else:                         # HF Llama: RMSNorm, SwiGLU, RoPE, no biases
        cfg = TransformerConfig(**common, normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
                                add_bias_linear=False)
        spec, kw = get_gpt_layer_local_spec(normalization="RMSNorm"), dict(
            position_embedding_type="rope", rotary_base=int(m["rope_theta"]), share_embeddings_and_output_weights=m["tied"])
    model = GPTModel(cfg, spec, vocab_size=m["vocab"], max_sequence_length=m["max_positions"],
                     pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(), **kw)
    params = sum(p.numel() for p in model.parameters())
    if m["tied"] and pp > 1 and ps.is_pipeline_last_stage() and not ps.is_pipeline_first_stage():
        params -= m["vocab"] * m["hidden"] // tp      # the last stage's copy of the tied embedding
    # one replica's parameters: the TP shards of every tensor-parallel weight, the replicated ones once
    first_tp = ps.get_tensor_model_parallel_rank() == 0
    share = params - sum(p.numel() for p in model.parameters()
                         if not getattr(p, "tensor_model_parallel", False) and not first_tp)
    share = share if ps.get_data_parallel_rank() == 0 else 0
    distributed = job["distributed_optimizer"]
    model = DDP(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=False, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=distributed), model)
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=o["lr"], weight_decay=o["weight_decay"], adam_beta1=o["betas"][0],
        adam_beta2=o["betas"][1], adam_eps=o["eps"], clip_grad=o["clip"], fp16=False, bf16=False,
        params_dtype=torch.float32, use_distributed_optimizer=distributed), [model])
    cfg.finalize_model_grads_func = finalize_model_grads
    cfg.grad_scale_func = opt.scale_loss
    S, b = job["seq"], job["micro_batch"]
    mask = torch.triu(torch.ones(1, 1, S, S, dtype=torch.bool), diagonal=1)   # its default mask is built on 'cuda'
    pos = torch.arange(S).unsqueeze(0).expand(b, S)

    def forward_step(it, mdl):
        inp, lab = next(it)
        out = mdl(inp, pos, mask, labels=lab)
        return out, lambda o_: (o_.float().mean(), {"lm loss": o_.float().mean().detach()})

    fb = get_forward_backward_func()

    def step(micro_batches):
        model.zero_grad_buffer()
        opt.zero_grad()
        out = fb(forward_step_func=forward_step, data_iterator=iter(micro_batches), model=[model],
                 num_microbatches=len(micro_batches), seq_length=S, micro_batch_size=b, decoder_seq_length=S,
                 forward_only=False)
        opt.step()
        return sum(float(x["lm loss"]) for x in out) / len(out) if out else None

    return {"params": params, "share": share, "step": step, "dp_rank": ps.get_data_parallel_rank(),
            "layout": f"megatron-core t{tp} p{pp} d{ps.get_data_parallel_world_size()}"
                      + (" distributed-optimizer" if distributed else "")}


def run_torchtitan(job: dict) -> dict:
    torchtitan_cpu_shims()
    import types

    import torch
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import (_EMBEDDING_INIT, _NORM_INIT, Llama3Model, _build_llama3_layers,
                                          _output_linear_init, parallelize_llama)

    m, o = job["model"], job["optimizer"]
    if m["arch"] != "llama" or m["tied"] or m["norm_eps"] != 1e-5:
        # its layer builder fixes the norms' epsilon at RMSNorm.Config's default
        raise SystemExit("torchtitan schemes train Llama models with untied embeddings and norm epsilon 1e-5")
    world = int(os.environ["WORLD_SIZE"])
    par = ParallelismConfig(tensor_parallel_degree=job["tp"], data_parallel_shard_degree=job["dp"],
                            spmd_backend="partial_dtensor")
    pd = ParallelDims.from_config(par, world)
    pd.build_mesh()
    dist_utils.set_spmd_backend("partial_dtensor")
    torch.manual_seed(job["seed"])
    D, V, S = m["hidden"], m["vocab"], job["seq"]
    cfg = Llama3Model.Config(
        dim=D, vocab_size=V,
        tok_embeddings=Embedding.Config(num_embeddings=V, embedding_dim=D, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=D, eps=m["norm_eps"], param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=D, out_features=V, param_init=_output_linear_init(D)),
        layers=_build_llama3_layers(n_layers=m["layers"], dim=D, n_heads=m["heads"], n_kv_heads=m["kv_heads"],
                                    fuse_qkv=True, hidden_dim=m["ffn"],
                                    rope=ComplexRoPE.Config(dim=D // m["heads"], max_seq_len=m["max_positions"],
                                                            theta=m["rope_theta"], scaling="none"),
                                    attn_backend="flex"))
    # FlexAttention, torchtitan's LM attention, has no backward on CPU (torch 2.13); its own causal SDPA
    # computes the same for unpacked sequences.
    for lc in cfg.layers:
        lc.attention.inner_attention = ScaledDotProductAttention.Config()
    PATCHES.append("config: inner_attention FlexAttention -> torchtitan ScaledDotProductAttention (causal)")
    cfg.update_from_config(config=types.SimpleNamespace(parallelism=par))
    with torch.device("meta"):
        model = cfg.build()
    training = TrainingConfig()
    # Its trainer's default computes in bf16 under the FSDP wrap; the same fp32 arithmetic as the other schemes.
    training.mixed_precision_param = "float32"
    PATCHES.append("config: torchtitan mixed_precision_param bfloat16 -> float32 (the schemes' precision)")
    model = parallelize_llama(model, parallel_dims=pd, training=training, parallelism=par,
                              compile_config=CompileConfig(), ac_config=None, dump_folder=job["out"])
    from torch.distributed.fsdp import FSDPModule
    wrapped = [mod for mod in model.modules() if isinstance(mod, FSDPModule)]
    for mod in wrapped:      # gloo has no PREMUL_SUM (torchtitan sets a gradient divide factor): SUM, then divide
        mod.set_force_sum_reduction_for_comms(True)
    if wrapped:
        PATCHES.append("FSDP2 set_force_sum_reduction_for_comms(True): gloo has no ReduceOp.PREMUL_SUM; "
                       "a SUM reduce-scatter, then the same division")
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    params = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
    # a DTensor's numel is its global one: the model's size, counted once
    share = sum(p.numel() for p in model.parameters()) if int(os.environ["RANK"]) == 0 else 0
    loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config(global_vocab_size=V))
    opt = torch.optim.AdamW(model.parameters(), lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"],
                            weight_decay=o["weight_decay"])
    ctx = dist_utils.get_spmd_context(parallel_dims=pd)

    def step(micro_batches):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for inp, lab in micro_batches:
            p = torch.arange(inp.shape[1]).unsqueeze(0).expand_as(inp).contiguous()
            with ctx():
                loss, _ = loss_fn(model(inp, positions=p), lab, torch.tensor(lab.numel()))
                (loss / len(micro_batches)).backward()
            total += float(loss) / len(micro_batches)
        dist_utils.clip_grad_norm_(list(model.parameters()), o["clip"], foreach=True, pp_mesh=None, ep_enabled=False)
        opt.step()
        return total

    dp_rank = pd.get_mesh("fsdp").get_local_rank() if job["dp"] > 1 else 0
    return {"params": params, "share": share, "step": step, "dp_rank": dp_rank,
            "layout": f"torchtitan t{job['tp']} fsdp{job['dp']}"}


def _link_bytes(device: str | None) -> int | None:
    if not device:
        return None
    with open(f"/sys/class/net/{device}/statistics/tx_bytes") as f:
        return int(f.read())


def main() -> None:
    with open(sys.argv[1]) as f:
        job = json.load(f)
    import torch
    import torch.distributed as dist
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    import warnings
    warnings.filterwarnings("ignore")
    side = (run_megatron if job["peer"] == "megatron" else run_torchtitan)(job)
    device = os.environ.get("MTDS_LINK_DEVICE")     # on an emulated node: its link's kernel counters
    times, cpu, losses, link = [], [], [], []
    for micro_batches in _batches(job, side["dp_rank"]):
        dist.barrier()
        before = _link_bytes(device)
        t0, c0 = time.perf_counter(), time.process_time()
        loss = side["step"](micro_batches)
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        cpu.append(time.process_time() - c0)      # this rank's process CPU (compare.entry records the same)
        dist.barrier()                  # every rank's sends of this step have left (as compare.entry reads them)
        after = _link_bytes(device)
        if device:
            link.append({"tx_bytes": after - before, "tx_at_start": before, "tx_at_end": after})
        # the step's loss: mean over the ranks that hold it (last pipeline stage), of every data-parallel rank
        held = torch.tensor([loss if loss is not None and math.isfinite(loss) else 0.0,
                             1.0 if loss is not None else 0.0], dtype=torch.float64)
        dist.all_reduce(held)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)             # the slowest rank sets the pace
        times.append(float(elapsed))
        losses.append(float(held[0] / held[1]))
    total = torch.tensor([side["share"]], dtype=torch.int64)
    dist.all_reduce(total)
    from importlib.metadata import version
    name = {"megatron": "megatron-core", "torchtitan": "torchtitan"}[job["peer"]]
    probe = {"rank": rank, "world": world, "layout": side["layout"], "step_times_s": times, "step_cpu_s": cpu, "comm_per_step": [],
             "parameters": side["params"], "parameters_total": int(total),
             "dp_rank": side["dp_rank"], "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20,
             "losses": losses, "link_per_step": link, "peer": name, "peer_version": version(name),
             "torch_version": torch.__version__, "patches": PATCHES}
    os.makedirs(os.path.join(job["out"], "probe"), exist_ok=True)
    with open(os.path.join(job["out"], "probe", f"rank{rank}.json"), "w") as f:
        json.dump(probe, f)
    if rank == 0:
        with open(os.path.join(job["out"], "log.jsonl"), "w") as f:
            for i, (t, loss) in enumerate(zip(times, losses), 1):
                f.write(json.dumps({"kind": "train", "step": i, "loss": loss, "step_time_s": t,
                                    "lr": job["optimizer"]["lr"]}) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
