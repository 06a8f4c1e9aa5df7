"""Megatron-DeepSpeed GPT checkpoints without Megatron-DeepSpeed: the fixtures of its import test.

Megatron-DeepSpeed (github.com/deepspeedai/Megatron-DeepSpeed) cannot run here (CUDA kernels, apex). Its
GPTModelPipe is a DeepSpeed PipelineModule; :func:`engine_write` builds one with the same specs, class
names and parameter names (megatron/model/gpt_model.py, transformer.py, language_model.py) holding an HF
GPT-2's weights split Megatron-style, and saves it with DeepSpeed's engine (``save_checkpoint``, ZeRO-1,
Megatron-DeepSpeed's client state), so the files are DeepSpeed's own. :func:`write` writes the same files
without an engine (one process, any (t, p); the ZeRO files are placeholders), for the bad-input tests;
its layer files equal the engine's. The files:

- ``global_step<N>/layer_XX-model_YY-model_states.pt``: the state_dict of pipeline spec XX on TP rank YY.
  GPTModelPipe's specs: 0 a function (no file), 1 EmbeddingPipe (``word_embeddings.weight`` split over
  the vocabulary, ``position_embeddings.weight``), 2..L+1 ParallelTransformerLayerPipe, L+2 the final
  LayerNorm (``weight``, ``bias``), L+3 the head: tied, a ``partial`` of the embedding (DeepSpeed saves no
  file for it), untied LMHeadPipe (``lm_head.weight``).
- ``mp_rank_ZZ_model_states.pt`` (ZZ = stage * t + tp rank): DeepSpeed's engine state, module None, with
  Megatron-DeepSpeed's client state (megatron/checkpointing.py save_checkpoint): ``args`` (its argparse
  Namespace, with ``params_dtype`` and ``model_type`` as it sets them), ``checkpoint_version`` 3.0,
  ``iteration``, ``tokens``, ``rng_state`` (python, numpy and torch RNG states).
- ``zero_pp_rank_0_mp_rank_ZZ_optim_states.pt``: ZeRO-1 optimizer files (DeepSpeedCheckpoint requires them;
  the import never opens them).
- ``latest`` (DeepSpeed's tag file) and ``latest_checkpointed_iteration.txt`` (Megatron's) beside.

query_key_value per TP rank is either per head ([q_h, k_h, v_h] for each head: Megatron-DeepSpeed before
its FPDT commit 676a482c of 2024-12) or in blocks ([q | k | v] of the rank's heads: from it on);
dense_h_to_4h, word embeddings and lm_head split on rows, dense and dense_4h_to_h on columns, norms and the
row-parallel biases replicated.
"""
from __future__ import annotations

import argparse
import os
import random
import types

import numpy as np
import torch


def hf_gpt2(seed: int = 0, *, layers: int = 2, hidden: int = 64, heads: int = 4, vocab: int = 128, seq: int = 32,
            tied: bool = True):
    """A tiny GPT-2 (tanh GELU; tied head unless ``tied`` is False), every weight random (norm weights near 1,
    biases non-zero)."""
    import transformers as T
    torch.manual_seed(seed)
    cfg = T.GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=hidden, n_layer=layers, n_head=heads,
                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, activation_function="gelu_new",
                       bos_token_id=0, eos_token_id=1, tie_word_embeddings=tied)
    model = T.GPT2LMHeadModel(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if ".ln_" in name and name.endswith("weight")
                    else 0.1 * torch.randn_like(p))
    return model


class Weights:
    """An HF GPT-2's weights and config fields without transformers (picklable: broadcast to ranks that
    need not import transformers); stands in for the model in the writers below."""

    def __init__(self, model):
        c = model.config
        self.config = types.SimpleNamespace(n_layer=c.n_layer, n_embd=c.n_embd, n_head=c.n_head,
                                            n_positions=c.n_positions, vocab_size=c.vocab_size,
                                            layer_norm_epsilon=c.layer_norm_epsilon,
                                            tie_word_embeddings=c.tie_word_embeddings)
        self.sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.lm_head = types.SimpleNamespace(weight=self.sd["lm_head.weight"])

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.sd


def megatron_args(hf_cfg, tp: int, pp: int, *, fpdt_args: bool, untied: bool = False) -> argparse.Namespace:
    """The model fields of Megatron-DeepSpeed's args (megatron/arguments.py names and defaults) for ``hf_cfg``,
    with a few run fields; ``fpdt_args``: carry the fields its 2024-12 FPDT commit added."""
    h, heads = hf_cfg.n_embd, hf_cfg.n_head
    args = argparse.Namespace(
        num_layers=hf_cfg.n_layer, hidden_size=h, ffn_hidden_size=4 * h, num_attention_heads=heads,
        num_key_value_heads=heads, kv_channels=h // heads, max_position_embeddings=hf_cfg.n_positions,
        seq_length=16, use_rotary_position_embeddings=False, rotary_percent=1.0, add_position_embedding=True,
        make_vocab_size_divisible_by=64, padded_vocab_size=hf_cfg.vocab_size, normalization="layernorm",
        layernorm_epsilon=hf_cfg.layer_norm_epsilon, apply_layernorm_1p=False,
        apply_residual_connection_post_layernorm=False, openai_gelu=False, squared_relu=False, swiglu=False,
        onnx_safe=None, bias_gelu_fusion=True, add_bias_linear=True, num_experts=[1], num_experts_switch=None,
        untie_embeddings_and_output_weights=untied, embedding_weights_in_fp32=False, hidden_dropout=0.1,
        attention_dropout=0.1, init_method_std=0.02, apply_query_key_layer_scaling=True,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, world_size=tp * pp, deepspeed=True,
        ds_pipeline_enabled=True, no_pipeline_parallel=False, fp16=False, bf16=False, params_dtype=torch.float,
        iteration=10, consumed_train_samples=80, consumed_train_tokens=1280)
    try:   # the enum Megatron-DeepSpeed's training.py stores (its megatron.core.enums; megatron-core's here)
        from megatron.core.enums import ModelType
        args.model_type = ModelType.encoder_or_decoder
    except ImportError:
        pass
    if fpdt_args:
        args.ds_sequence_parallel_fpdt = False
        args.ds_sequence_parallel_fpdt_chunk_size = 65536
        args.ds_sequence_parallel_fpdt_offloading = False
    return args


def megatron_layers(model, *, blocked_qkv: bool) -> list[dict[str, torch.Tensor]]:
    """Full (unsplit) state of each pipeline layer in Megatron-DeepSpeed's names: [embedding, blocks...,
    final norm]; query_key_value in the interleaved order (``blocked_qkv`` is applied per rank by split)."""
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    heads = model.config.n_head
    d = model.config.n_embd // heads
    out = [{"word_embeddings.weight": sd["transformer.wte.weight"],
            "position_embeddings.weight": sd["transformer.wpe.weight"]}]
    for i in range(model.config.n_layer):
        p = f"transformer.h.{i}."
        qkv_w = sd[p + "attn.c_attn.weight"].t()                     # [q | k | v] rows, [3h, h]
        qkv_b = sd[p + "attn.c_attn.bias"]
        if not blocked_qkv:                                           # [heads, 3, d, ...] rows
            qkv_w = qkv_w.reshape(3, heads, d, -1).transpose(0, 1).reshape(qkv_w.shape)
            qkv_b = qkv_b.reshape(3, heads, d).transpose(0, 1).reshape(qkv_b.shape)
        out.append({
            "input_layernorm.weight": sd[p + "ln_1.weight"], "input_layernorm.bias": sd[p + "ln_1.bias"],
            "self_attention.query_key_value.weight": qkv_w.contiguous(),
            "self_attention.query_key_value.bias": qkv_b.contiguous(),
            "self_attention.dense.weight": sd[p + "attn.c_proj.weight"].t().contiguous(),
            "self_attention.dense.bias": sd[p + "attn.c_proj.bias"],
            "post_attention_layernorm.weight": sd[p + "ln_2.weight"],
            "post_attention_layernorm.bias": sd[p + "ln_2.bias"],
            "mlp.dense_h_to_4h.weight": sd[p + "mlp.c_fc.weight"].t().contiguous(),
            "mlp.dense_h_to_4h.bias": sd[p + "mlp.c_fc.bias"],
            "mlp.dense_4h_to_h.weight": sd[p + "mlp.c_proj.weight"].t().contiguous(),
            "mlp.dense_4h_to_h.bias": sd[p + "mlp.c_proj.bias"]})
    out.append({"weight": sd["transformer.ln_f.weight"], "bias": sd["transformer.ln_f.bias"]})
    return out


COLUMN = ("self_attention.query_key_value.weight", "self_attention.query_key_value.bias",
          "mlp.dense_h_to_4h.weight", "mlp.dense_h_to_4h.bias", "word_embeddings.weight", "lm_head.weight")
ROW = ("self_attention.dense.weight", "mlp.dense_4h_to_h.weight")


def split(name: str, full: torch.Tensor, tp: int, rank: int, *, blocked_qkv: bool) -> torch.Tensor:
    """Rank ``rank``'s piece of ``full`` as Megatron's tensor-parallel layers hold it."""
    if name.startswith("self_attention.query_key_value") and blocked_qkv:
        return torch.cat([part.chunk(tp)[rank] for part in full.chunk(3)]).clone()
    if name in COLUMN:
        return full.chunk(tp, dim=0)[rank].clone()
    if name in ROW:
        return full.chunk(tp, dim=1)[rank].clone()
    return full.clone()


def write(root: str, model, *, tp: int, pp: int, blocked_qkv: bool = False, iteration: int = 10,
          args: argparse.Namespace | None = None) -> str:
    """Save ``model`` (an HF GPT-2) as Megatron-DeepSpeed's GPTModelPipe at (tp, pp); returns ``root``."""
    from mtds.checkpoint.dsformat import engine_state
    layers = megatron_layers(model, blocked_qkv=blocked_qkv)
    L = model.config.n_layer
    args = args or megatron_args(model.config, tp, pp, fpdt_args=blocked_qkv,
                                 untied=not model.config.tie_word_embeddings)
    tag = f"global_step{iteration}"
    tag_dir = os.path.join(root, tag)
    os.makedirs(tag_dir)
    for i, state in enumerate(layers):                               # spec index: 1 embedding, ..., L+2 norm
        for r in range(tp):
            torch.save({n: split(n, t, tp, r, blocked_qkv=blocked_qkv) for n, t in state.items()},
                       os.path.join(tag_dir, f"layer_{i + 1:02d}-model_{r:02d}-model_states.pt"))
    if args.untie_embeddings_and_output_weights:                     # LMHeadPipe at spec L+3
        head = model.lm_head.weight.detach()
        for r in range(tp):
            torch.save({"lm_head.weight": split("lm_head.weight", head, tp, r, blocked_qkv=False)},
                       os.path.join(tag_dir, f"layer_{L + 3:02d}-model_{r:02d}-model_states.pt"))
    rng = [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.get_rng_state(),
            "rng_tracker_states": {}}]
    client = {"args": args, "checkpoint_version": 3.0, "iteration": iteration, "tokens": 1280, "rng_state": rng}
    for mp in range(tp * pp):
        state = engine_state(module=None, mp_world_size=tp * pp, dp_world_size=1, client_state=client)
        torch.save(state, os.path.join(tag_dir, f"mp_rank_{mp:02d}_model_states.pt"))
        torch.save({"optimizer_state_dict": {"zero_stage": 1, "partition_count": [1]}, "ds_version": state["ds_version"]},
                   os.path.join(tag_dir, f"zero_pp_rank_0_mp_rank_{mp:02d}_optim_states.pt"))
    with open(os.path.join(root, "latest"), "w") as f:
        f.write(tag)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))
    return root


# --- the same checkpoint saved by DeepSpeed's own pipeline engine (run on t * p ranks) --------------------

class _Holder(torch.nn.Module):
    """A layer whose state_dict is ``state`` (dotted names as submodules); no forward is needed to save."""

    def __init__(self, state: dict[str, torch.Tensor]):
        super().__init__()
        for name, t in state.items():
            *path, leaf = name.split(".")
            m = self
            for part in path:
                if not hasattr(m, part):
                    m.add_module(part, torch.nn.Module())
                m = getattr(m, part)
            m.register_parameter(leaf, torch.nn.Parameter(t.clone()))


# Megatron-DeepSpeed's class names (DeepSpeed's partition_method "type:transformer" matches on them)
class EmbeddingPipe(_Holder):
    @property
    def word_embeddings_weight(self):
        return self.word_embeddings.weight


class ParallelTransformerLayerPipe(_Holder):
    pass


class LayerNorm(_Holder):
    pass


class LMHeadPipe(_Holder):
    pass


def _identity(x):
    return x


def _logits_helper(embedding, lm_output):
    return lm_output


def engine_write(root: str, model, *, tp: int, pp: int, blocked_qkv: bool = False, iteration: int = 10) -> str:
    """``model`` as Megatron-DeepSpeed's GPTModelPipe saves it, through DeepSpeed's PipelineModule and engine
    (``save_checkpoint`` with Megatron-DeepSpeed's client state, ZeRO-1): the same specs and parameter names
    (a function first, the tied embedding, the blocks, the final norm, the tied head with a forward_fn), on
    this rank's TP shard; untied, LMHeadPipe instead of the tied head. Needs torch.distributed with t * p
    ranks (data parallel 1)."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
    topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=1)
    r = topo.get_coord(dist.get_rank()).model
    full = megatron_layers(model, blocked_qkv=blocked_qkv)
    shard = [{n: split(n, t, tp, r, blocked_qkv=blocked_qkv) for n, t in layer.items()} for layer in full]
    specs = [_identity, TiedLayerSpec("embed", EmbeddingPipe, shard[0], tied_weight_attr="word_embeddings_weight")]
    specs += [LayerSpec(ParallelTransformerLayerPipe, s) for s in shard[1:-1]]
    specs.append(LayerSpec(LayerNorm, shard[-1]))
    if model.config.tie_word_embeddings:
        specs.append(TiedLayerSpec("embed", EmbeddingPipe, shard[0], forward_fn=_logits_helper,
                                   tied_weight_attr="word_embeddings_weight"))
    else:
        head = split("lm_head.weight", model.lm_head.weight.detach(), tp, r, blocked_qkv=False)
        specs.append(LayerSpec(LMHeadPipe, {"lm_head.weight": head}))
    net = type("GPTModelPipe", (PipelineModule,), {})(layers=specs, topology=topo, partition_method="type:transformer",
                                                       loss_fn=lambda out, labels: out.sum())
    config = {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1},
              "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9}
    engine, *_ = deepspeed.initialize(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.0),
                                      config=config)
    rng = [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.get_rng_state(),
            "rng_tracker_states": {}}]
    args = megatron_args(model.config, tp, pp, fpdt_args=blocked_qkv, untied=not model.config.tie_word_embeddings)
    engine.save_checkpoint(root, tag=f"global_step{iteration}",
                           client_state={"args": args, "checkpoint_version": 3.0, "iteration": iteration,
                                         "tokens": 1280, "rng_state": rng})
    if dist.get_rank() == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))
    dist.barrier()
    return root
