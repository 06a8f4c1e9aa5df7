"""Model config + layout -> the ordered list of DeepSpeed ``LayerSpec``s that make a GPT.

    [embedding] [block 1] ... [block L] [final norm] [LM head]

With tied embeddings the first and last entries are ``TiedLayerSpec("embed", GPTEmbedding)``: each
end stage builds its own copy (same seed, so the same weights) and DeepSpeed all-reduces their
gradients over the stages that share it. Specs are lazy: a stage builds only the layers it owns.
"""
from __future__ import annotations

from deepspeed.pipe import LayerSpec, TiedLayerSpec

from mtds.cp.context import ContextParallel
from mtds.model.config import ModelConfig
from mtds.model import FinalNorm, GPTEmbedding, LMHead, TransformerLayer
from mtds.model.documents import DocumentMasking

TIED_KEY = "embed"
TIED_WEIGHT = "word_embeddings.weight"
# DeepSpeed partitions by counting layers whose class name matches (``type:`` method), so every
# stage gets whole transformer blocks and the embedding/head ride with the first/last stage.
PARTITION_METHOD = f"type:{TransformerLayer.__name__}"
CHECKPOINTABLE_LAYERS = [TransformerLayer.__name__]


def tied_lm_logits(embedding: GPTEmbedding, hidden):
    """Forward of the tied copy on the last stage: the embedding table used as output projection."""
    return embedding.lm_logits(hidden)


def gpt_layer_specs(cfg: ModelConfig, *, tp_group, seed: int, rng_tracker, sequence_parallel: bool = False,
                    recompute_attention: bool = False, documents: DocumentMasking | None = None,
                    context: ContextParallel | None = None, ep_group=None,
                    carry_router_stats: bool = False) -> list:
    """With ``sequence_parallel`` every activation between layers (and pipeline stages) is this
    TP rank's slice of the sequence, [b, s/t, h]. ``recompute_attention``: selective recomputation.
    ``documents`` (resets on): the activation is (hidden, segment ids [b, s]) up to the final norm.
    ``context`` (context parallelism): the embedding takes this rank's s/c tokens, the blocks exchange
    K/V over the group; activations are [b, s/c, h] (s/(c t) with sequence parallelism). ``ep_group``: an
    MoE model's experts split over these expert-parallel ranks. ``carry_router_stats``: an MoE model's
    router statistics travel with the activations to the loss (pipelines, :mod:`mtds.model.router_carry`)."""
    common = dict(tp_group=tp_group, seed=seed, rng_tracker=rng_tracker, sequence_parallel=sequence_parallel,
                  documents=documents, context=context, carry_router_stats=carry_router_stats)
    if cfg.tie_word_embeddings:
        first = TiedLayerSpec(TIED_KEY, GPTEmbedding, cfg, tied_weight_attr=TIED_WEIGHT, **common)
        last = TiedLayerSpec(TIED_KEY, GPTEmbedding, cfg, forward_fn=tied_lm_logits,
                             tied_weight_attr=TIED_WEIGHT, **common)
    else:
        first = LayerSpec(GPTEmbedding, cfg, **common)
        last = LayerSpec(LMHead, cfg, tp_group=tp_group, seed=seed, sequence_parallel=sequence_parallel)
    blocks = [LayerSpec(TransformerLayer, cfg, i, recompute_attention=recompute_attention, ep_group=ep_group,
                        **common)
              for i in range(1, cfg.num_layers + 1)]
    final_norm = LayerSpec(FinalNorm, cfg, seed=seed, tp_group=tp_group, sequence_parallel=sequence_parallel,
                           carry_router_stats=carry_router_stats)
    return [first, *blocks, final_norm, last]
