"""The shapes each check runs, per device: tiny on CPU (the test-suite's mode), real sizes on GPUs.

One place for every number, so the report can print what ran and ``--quick`` only swaps tables.
"""
from __future__ import annotations

from dataclasses import dataclass

from mtds.model.config import ModelConfig


@dataclass(frozen=True)
class Workload:
    model: ModelConfig
    seq: int
    micro_batch: int
    global_batch: int           # at data-parallel size 1: accumulation m = global / micro
    steps: int

    def describe(self) -> str:
        m = self.model
        return (f"l={m.num_layers} h={m.hidden_size} a={m.num_heads} V={m.vocab_size} s={self.seq} "
                f"b={self.micro_batch} B={self.global_batch} steps={self.steps}")


def _gpt(hidden: int, layers: int, heads: int, positions: int, vocab: int = 8192) -> ModelConfig:
    # No dropout: both sides of every comparison run the same operations.
    return ModelConfig(vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads,
                       max_position_embeddings=positions)


# 4 blocks: p = 2 with v = 2 (interleaved) or DualPipeV's two chunks per rank need one block per chunk;
# B / b = 4 micro-batches >= 2p (DualPipeV's minimum at p = 2).
TINY = _gpt(64, 4, 4, 64)
CPU = {
    "parity": Workload(TINY, 32, 2, 8, 3),
    "p2p": Workload(TINY, 32, 2, 8, 2),
    "resume": Workload(TINY, 32, 2, 8, 4),
    "speed": Workload(_gpt(64, 2, 4, 32), 32, 2, 2, 4),
}
CPU_FULL = {**CPU, "parity": Workload(TINY, 32, 2, 8, 6), "p2p": Workload(TINY, 32, 2, 8, 4)}

# GPU: p2p boundary b x s x h x 2 bytes (bf16) = 32 x 1024 x 1024 x 2 = 64 MiB per message; speed at
# gpt2-medium's shape (vocabulary padded to 50304 as Megatron does) at seq 1024.
GPU = {
    "parity": Workload(_gpt(256, 4, 4, 128), 128, 4, 32, 10),
    "p2p": Workload(_gpt(1024, 4, 16, 1024), 1024, 32, 128, 3),
    "resume": Workload(_gpt(256, 4, 4, 128), 128, 4, 32, 6),
    "speed": Workload(_gpt(1024, 24, 16, 1024, vocab=50304), 1024, 8, 8, 12),
}
GPU_QUICK = {**GPU, "parity": Workload(_gpt(256, 4, 4, 128), 128, 4, 32, 4),
             "p2p": Workload(_gpt(1024, 4, 16, 1024), 1024, 32, 128, 2),
             "speed": Workload(_gpt(512, 4, 8, 512, vocab=50304), 512, 8, 8, 6)}

# --speed-models (GPUs): GPT-2 presets' shapes at s = 1024 (vocabulary padded to 50304) and the micro-batch
# each ran at on one H100 80GB beside HF (2026-11-24: HF needed 26.6 / 46.6 / 49.1 GiB, mtds 14.4 / 26.7 / 36.8).
SPEED_MODELS = {"gpt2-medium": (1024, 24, 16, 8), "gpt2-large": (1280, 36, 20, 8), "gpt2-xl": (1600, 48, 25, 4)}


def speed_workload(name: str, quick: bool = False) -> Workload:
    """The speed check's workload for a --speed-models entry (``ValueError`` with the choices otherwise)."""
    if name not in SPEED_MODELS:
        raise ValueError(f"--speed-models: unknown model {name!r}; choose from {', '.join(SPEED_MODELS)}")
    hidden, layers, heads, micro = SPEED_MODELS[name]
    return Workload(_gpt(hidden, layers, heads, 1024, vocab=50304), 1024, micro, micro, 6 if quick else 12)


SPEED_WARMUP = {"cpu": 1, "cuda": 3}      # first steps not timed (allocator, cuBLAS heuristics, JIT)


def workloads(device: str, quick: bool) -> dict[str, Workload]:
    if device == "cuda":
        return GPU_QUICK if quick else GPU
    return CPU if quick else CPU_FULL


def precisions(device: str) -> tuple[str, ...]:
    """bf16 and fp16 on GPUs (what users train in); CPU has no fp16 kernels DeepSpeed accepts, so fp32
    (the suite's exact reference precision) and bf16."""
    return ("bf16", "fp16") if device == "cuda" else ("fp32", "bf16")
