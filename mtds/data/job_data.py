"""The training job's data, behind one function: `build_streams` -> (train stream, eval-stream factory).

Two sources:
  --data-path [W] PREFIX ...   Megatron indexed datasets (mtds-preprocess or Megatron's own), blended
                               by weight; indices built once per node and cached (mtds/data/indexed)
  --data SPEC (default)        raw text tokenized into the token cache (mtds/data/packed.py)
Either way the micro-batches come from MicroBatchStream: layout-independent, DP-sharded, resumable.
"""
import os

from mtds.data.checks import check_seq_length
from mtds.data.errors import DataError
from mtds.data.packed import build_packed_dataset
from mtds.data.rank_zero_first import local_rank_zero_first
from mtds.data.split import build_train_eval
from mtds.data.micro_batches import MicroBatchStream
from mtds.data.tokenizer import check_vocab, load_tokenizer


def build_streams(cfg, model_cfg, batch, groups, logger):
    import torch.distributed as dist
    check_seq_length(cfg.seq_length, model_cfg.max_position_embeddings)
    tokenizer = load_tokenizer(cfg.tokenizer)
    check_vocab(tokenizer, model_cfg.vocab_size)
    if getattr(cfg, "data_path", None):
        if cfg.data is not None:
            raise DataError("--data and --data-path both name training data; keep one")
        train_ds, eval_ds = _indexed(cfg, model_cfg, batch, logger)
        shuffle = False   # the blend's indices are the order already
    else:
        train_ds, eval_ds = _packed(cfg, tokenizer, dist)
        shuffle = True
    logger.info(f"data: {len(train_ds)} training samples of {cfg.seq_length + 1} tokens"
                + (f", {len(eval_ds)} held out" if eval_ds is not None else ""))
    common = dict(global_batch_size=batch.global_batch, micro_batch_size=batch.micro_batch,
                  dp_rank=groups.dp_rank, dp_size=groups.layout.dp, seed=cfg.seed,
                  eod_mask_id=tokenizer.eos_token_id if getattr(cfg, "eod_mask_loss", False) else None,
                  need_inputs=groups.is_first_stage or groups.layout.pp == 1,
                  need_labels=groups.is_last_stage or groups.layout.pp == 1
                  or (groups.is_first_stage and cfg.pipeline_schedule == "dualpipev"))   # V: loss on rank 0
    stream = MicroBatchStream(train_ds, shuffle=shuffle, **common)

    def eval_stream():
        if eval_ds is None:
            return None
        return MicroBatchStream(eval_ds, shuffle=False, name="evaluation", **common)

    eval_stream()  # fail now, not at the first evaluation, if the held-out set is too small
    return stream, eval_stream


def _packed(cfg, tokenizer, dist):
    def build(spec):
        return build_packed_dataset(spec, tokenizer, cfg.seq_length, text_column=cfg.text_column,
                                    num_proc=cfg.num_proc, show_progress=dist.get_rank() == 0)

    # Local rank 0 fills the tokenization cache; the node's other ranks wait on the store, then read it.
    return local_rank_zero_first(lambda: build_train_eval(build, cfg.data, cfg.eval_data, cfg.eval_split, cfg.seed),
                                 what="the token cache")


def _indexed(cfg, model_cfg, batch, logger):
    from mtds.data.indexed.blend_spec import parse_blend
    from mtds.data.indexed.blended_dataset import build_blended
    blend = parse_blend(cfg.data_path)
    eval_blend = parse_blend(cfg.eval_data_path, "--eval-data-path") if cfg.eval_data_path else None
    hold_out = eval_blend is None and cfg.eval_split > 0
    B = batch.global_batch
    common = dict(seq_length=cfg.seq_length, seed=cfg.seed, builder=_local_rank() == 0,
                  log=logger.info, vocab_size=model_cfg.vocab_size)
    train = build_blended(blend, num_samples=max(cfg.steps, 1) * B,
                          split=(cfg.eval_split, "train") if hold_out else None, **common)
    evaluation = None
    if eval_blend is not None or hold_out:
        evaluation = build_blended(eval_blend or blend, num_samples=max(cfg.eval_iters, 1) * B,
                                   split=(cfg.eval_split, "eval") if hold_out else None, **common)
    for ds, what in ((train, "train"), (evaluation, "eval")):
        if ds is None:
            continue
        for src in ds.sources:
            logger.info(f"data ({what}): {src['prefix']}: {src['documents']:,} documents, {src['tokens']:,} "
                        f"tokens, weight {src['weight']:.3f}, {src['samples']:,} samples = "
                        f"{src['epochs']} epochs")
    return train, evaluation


def _local_rank() -> int:
    """The node's first process builds the indices (LOCAL_RANK from the launcher; else rank 0)."""
    import torch.distributed as dist
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    return dist.get_rank() if dist.is_initialized() else 0
