"""Parameter and FLOP counts for GPT models, and peak throughput of known GPUs.

Every formula used by the training logs and by the planner is defined once, here.
Symbols follow Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on
GPU Clusters Using Megatron-LM" (arXiv 2104.04473, "PTD-P"), Appendix / Section 5.1:
  B global batch, s sequence length, l layers, h hidden size, V vocabulary size.

Pure Python (math only) so that it can be imported anywhere, including before torch.
"""
from __future__ import annotations

__all__ = [
    "gpt_param_count",
    "model_flops_per_iteration",
    "hardware_flops_per_iteration",
    "training_flops_per_iteration",
    "model_config_flops",
    "peak_tflops",
    "GPU_PEAK_TFLOPS",
]


def gpt_param_count(layers: int, hidden: int, vocab: int, seq: int) -> float:
    """Parameters of a GPT model with learned position embeddings.

    PTD-P (arXiv 2104.04473) Section 5.1:
        P = 12 l h^2 (1 + 13/(12 h) + (V + s)/(12 l h))
    i.e. 12 h^2 + 13 h per transformer layer (QKV, projection, 4h MLP, biases, two
    layer norms) plus the (V + s) x h word and position embeddings (tied output head).
    GPT-3 175B (l=96, h=12288, V=51200, s=2048) gives ~174.6e9, the number in Table 2.
    """
    l, h = float(layers), float(hidden)
    return 12.0 * l * h * h * (1.0 + 13.0 / (12.0 * h) + (vocab + seq) / (12.0 * l * h))


def model_flops_per_iteration(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Model FLOPs of one training iteration (forward + backward, no recomputation).

    PTD-P (arXiv 2104.04473) Section 5.1, eq. for F without recompute (3/4 of eq. 3):
        F_model = 72 B s l h^2 (1 + s/(6 h) + V/(12 l h))
    72 = 3 (forward + 2x backward) x 24 s h^2 matmul FLOPs per layer per sequence;
    s/(6h) is the attention score / value matmuls; V/(12 l h) the output logits.
    This is the numerator of MFU (Chowdhery et al. 2022, PaLM, Appendix B).
    """
    l, h = float(layers), float(hidden)
    return 72.0 * batch * seq * l * h * h * (1.0 + seq / (6.0 * h) + vocab / (12.0 * l * h))


def hardware_flops_per_iteration(
    batch: int, seq: int, layers: int, hidden: int, vocab: int, recompute: str = "none"
) -> float:
    """FLOPs actually executed per iteration, including activation recomputation.

    - "none": equal to model FLOPs.
    - "full": every layer's forward runs twice. PTD-P (arXiv 2104.04473) eq. 3:
          F = 96 B s l h^2 (1 + s/(6 h) + V/(16 l h))
      (the logits are not recomputed, hence V/(16 l h) = 3/4 of V/(12 l h) over 96/72).
    - "selective": only the attention core (QK^T, softmax, dropout, x V) is recomputed.
      Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
      Models" (arXiv 2205.05198) Section 6.3 / Table 5 report HFU with
          F = 72 B s l h^2 (1 + s/(3 h) + V/(12 l h))
      We use the paper's accounting so our HFU is comparable with its Table 5 (it counts
      the recomputed attention core as s/(6h) extra, i.e. generously).
    """
    l, h = float(layers), float(hidden)
    base = batch * seq * l * h * h
    if recompute == "none":
        return model_flops_per_iteration(batch, seq, layers, hidden, vocab)
    if recompute == "full":
        return 96.0 * base * (1.0 + seq / (6.0 * h) + vocab / (16.0 * l * h))
    if recompute == "selective":
        return 72.0 * base * (1.0 + seq / (3.0 * h) + vocab / (12.0 * l * h))
    raise ValueError(f"recompute must be 'none', 'selective' or 'full', got {recompute!r}")


def training_flops_per_iteration(batch: int, seq: int, layers: int, hidden: int, vocab: int, *,
                                 ffn_hidden: int | None = None, num_heads: int | None = None,
                                 num_kv_heads: int | None = None, gated_mlp: bool = False,
                                 head_dim: int | None = None, recompute: str = "none",
                                 attention: tuple[float, float] | None = None) -> float:
    """Matmul FLOPs of one training iteration for any decoder of this family: the one count used by
    the step log (TFLOP/s, MFU) and the planner.

    Forward FLOPs per token and layer (2 per multiply-add):
      QKV 2h(q + 2 h_kv) with q = h and h_kv = h * kv_heads / heads (grouped-query attention: smaller K, V),
      or q = heads * head_dim and h_kv = kv_heads * head_dim where head_dim is given (Qwen3: not h / heads),
      scores and x V 4sq, output projection 2qh, MLP 2hf per h x f matrix: 2 matrices (GELU) or
      3 (SwiGLU: gate, up, down); the logits 2hV once per token (tied or untied head alike: an untied
      head adds parameters, not FLOPs). Backward is twice the forward, so an iteration is 3 passes.
    Recomputation, as in :func:`hardware_flops_per_iteration`: "full" runs the layers' forward again
    (4 passes of the layers, 3 of the logits); "selective" adds the attention core once more per
    pass in the accounting of Korthikanti et al. (4sq x 3). Elementwise work (norms, q/k norm, biases) is
    not a matmul and not counted. With f = 4h, MHA and GELU this equals
    PTD-P's 72 B s l h^2 (1 + s/(6h) + V/(12 l h)) and 96 B s l h^2 (1 + s/(6h) + V/(16 l h)).
    ``attention``: (projections, core) forward FLOPs per token and layer where the attention is not the fused
    QKV one (multi-head latent attention, :func:`latent_attention_flops`).
    """
    h, f = float(hidden), float(ffn_hidden or 4 * hidden)
    q = float(num_heads * head_dim) if (head_dim and num_heads) else h
    kv = q * num_kv_heads / num_heads if (num_heads and num_kv_heads) else q
    projections, core = attention or (2 * h * (q + 2 * kv) + 2 * q * h, 4.0 * seq * q)
    layer = projections + core + 2 * h * f * (3 if gated_mlp else 2)
    logits = 2 * h * vocab
    tokens = float(batch) * seq
    if recompute == "none":
        return 3 * tokens * (layers * layer + logits)
    if recompute == "full":
        return tokens * (4 * layers * layer + 3 * logits)
    if recompute == "selective":
        return 3 * tokens * (layers * (layer + core) + logits)
    raise ValueError(f"recompute must be 'none', 'selective' or 'full', got {recompute!r}")


def active_ffn_width(cfg) -> float:
    """The per-block SwiGLU width whose FLOPs equal, summed over the blocks, what the blocks compute per token:
    a dense block its FFN; an MoE block (docs/moe.md) only the k experts a token goes to, plus its router
    (2·h·E, written as a width E/3 of the gated MLP's 6·h·f), and its shared expert where it has one (its width,
    plus 1/3 for a sigmoid gate's 2·h). Model FLOPs count active experts only."""
    if not getattr(cfg, "num_experts", 0):
        return float(cfg.ffn_size)
    moe = sum(cfg.is_moe_layer(i) for i in range(1, cfg.num_layers + 1))
    shared = (cfg.moe_shared_expert_intermediate_size or 0) + (1 / 3 if cfg.moe_shared_expert_gate else 0)
    return moe_active_ffn_width(cfg.num_layers, cfg.ffn_size, moe, cfg.num_experts, cfg.moe_top_k, cfg.moe_ffn_size,
                                shared)


def moe_active_ffn_width(layers: int, ffn: float, moe_layers: int, num_experts: int, top_k: int,
                         moe_ffn: float, shared_ffn: float = 0.0) -> float:
    """:func:`active_ffn_width` from the sizes alone (the planner's ModelSpec has no ModelConfig): ``moe_layers``
    of the ``layers`` blocks run k experts of width ``moe_ffn``, a router over ``num_experts`` and a shared expert
    of width ``shared_ffn`` (0: none)."""
    per_moe = top_k * moe_ffn + num_experts / 3 + shared_ffn
    return ((layers - moe_layers) * ffn + moe_layers * per_moe) / layers


def latent_attention_flops(cfg, seq: int) -> tuple[float, float]:
    """Multi-head latent attention's forward FLOPs per token and layer of an ``mtds.hf.resolve.ModelConfig``:
    :func:`latent_attention_flops_of_sizes` of its sizes."""
    return latent_attention_flops_of_sizes(cfg.hidden_size, cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank,
                                           cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim, seq)


def latent_attention_flops_of_sizes(hidden: int, heads: int, q_lora_rank: int | None, kv_lora_rank: int,
                                    qk_head_dim: int, qk_pos_emb_head_dim: int, v_head_dim: int,
                                    seq: int) -> tuple[float, float]:
    """Multi-head latent attention's forward FLOPs per token and layer: (its projections: q (or q down and up),
    kv down, kv up, out; the core: scores over (no-RoPE + RoPE) dims and x V over the value dims)."""
    h, H = float(hidden), float(heads)
    qk, v, r_kv = qk_head_dim + qk_pos_emb_head_dim, v_head_dim, kv_lora_rank
    q = h * H * qk if q_lora_rank is None else q_lora_rank * (h + H * qk)
    projections = 2 * (q + h * (r_kv + qk_pos_emb_head_dim) + r_kv * H * (qk_head_dim + v) + H * v * h)
    return projections, 2.0 * seq * H * (qk + v)


def model_config_flops(cfg, batch: int, seq: int, recompute: str = "none") -> float:
    """:func:`training_flops_per_iteration` for an ``mtds.hf.resolve.ModelConfig`` (FFN width, SwiGLU,
    GQA, head_dim read from it); ``recompute="none"`` gives model FLOPs, the numerator of MFU."""
    return training_flops_per_iteration(batch, seq, cfg.num_layers, cfg.hidden_size, cfg.vocab_size,
                                        ffn_hidden=active_ffn_width(cfg), num_heads=cfg.num_heads,
                                        num_kv_heads=cfg.kv_heads,
                                        gated_mlp=cfg.activation in ("swiglu", "quick_geglu"),
                                        head_dim=cfg.kv_channels, recompute=recompute,
                                        attention=latent_attention_flops(cfg, seq) if getattr(
                                            cfg, "multi_latent_attention", False) else None)


# Dense tensor-core peak in TFLOP/s (no sparsity), from NVIDIA datasheets:
# A100 SXM4 (2020 A100 datasheet), V100 SXM2 (2017 datasheet); H100 SXM5 / PCIe / NVL (2023 H100
# datasheet) and H200 SXM / NVL (2024 H200 datasheet): the sparsity figures there, halved. The SXM
# numbers agree with the team's reference table (H100-SXM5-80GB, 989 bf16). PCIe and NVL parts run
# lower clocks and power, hence their own rows. V100 has no bf16 tensor cores, hence no entry. GH200's GPU
# is an H100 SXM5 (GH200 datasheet, 2023); H800/A800 are the export parts with the H100/A100 tensor cores
# (their NVLink is narrower, not their math); B200 from the HGX B200 datasheet (2024), dense.
GPU_PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "H100": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},           # SXM5
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0},
    "H100 NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "H200": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},           # SXM
    "H200 NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "GH200": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},          # its Hopper GPU = H100 SXM5
    "H800": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},           # SXM; export H100, same cores
    "H800 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0},
    "A800": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},           # export A100, same cores
    "B200": {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 75.0},        # HGX B200, per GPU
    "V100": {"fp16": 125.0, "fp32": 15.7},
}

_DTYPE_ALIASES = {
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
    "tf32": "tf32",
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
}


def _gpu_family(name: str) -> str | None:
    """Map a GPU key ("A100-80GB", "H100-SXM5-80GB") or torch device name ("NVIDIA A100-SXM4-80GB",
    "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H100 NVL") to a row of GPU_PEAK_TFLOPS.
    Hopper names without PCIe or NVL are the SXM parts."""
    upper = name.upper()
    # Longest family first: "GH200" contains "H200", whose NVL row would otherwise be picked for it.
    for family in sorted({f.split()[0] for f in GPU_PEAK_TFLOPS}, key=len, reverse=True):
        if family in upper:
            for variant in ("PCIe", "NVL"):
                if variant.upper() in upper and f"{family} {variant}" in GPU_PEAK_TFLOPS:
                    return f"{family} {variant}"
            return family
    return None


def peak_tflops(device_name_or_gpu_key: str, dtype="bf16") -> float | None:
    """Dense peak TFLOP/s of a GPU for a dtype (str or torch.dtype); None if unknown (e.g. CPU)."""
    if device_name_or_gpu_key is None:
        return None
    family = _gpu_family(str(device_name_or_gpu_key))
    key = _DTYPE_ALIASES.get(str(dtype).lower())
    if family is None or key is None:
        return None
    return GPU_PEAK_TFLOPS[family].get(key)
