"""`mtds-eval`: mean next-token loss of an mtds checkpoint or HF model under any (t, c, p, d) layout.

    torchrun --nproc_per_node 4 -m mtds.eval --ckpt CK --tp 2 --pp 2 --data rows.jsonl
    deepspeed --num_gpus 2 --module mtds.eval --hf DIR --tp 2 --data book.txt --tokenizer DIR
    torchrun --nproc_per_node 4 -m mtds.eval --hf DIR --tp 2 --cp 2 --cp-comm-type a2a --data long.jsonl

--data is jsonl with an ``input_ids`` list per row, or text (tokenized with --tokenizer, else the
tokenizer recorded in the checkpoint / found in the HF dir, cut into --seq-length windows).
Prints one JSON line on rank 0: {"loss": mean over all predicted tokens, "tokens": count, "ppl": exp(loss)}.

Weights load straight into this rank's layers and shards from the checkpoint's logical tensors, so
the evaluation layout need not match the saved one. The pipeline runs stage by stage with point-to-
point sends (no DeepSpeed engine: evaluation needs no optimizer or batch-size arithmetic).

With --cp C > 1 every row is split over the C ranks of a context-parallel group as training splits it
(2C load-balanced chunks, docs/long_context.md). A row whose length is not a multiple of 2C is padded at its
end with positions that have no label: under the causal mask no real token sees them, so the loss is the
same as at C = 1.
"""
from __future__ import annotations

import argparse
import json
import math
import os

import torch
import torch.distributed as dist


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mtds-eval", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--ckpt", metavar="DIR", help="mtds checkpoint (root with 'latest', or a tag folder)")
    src.add_argument("--hf", metavar="DIR", help="HuggingFace model directory")
    ap.add_argument("--tp", type=int, default=1, help="tensor parallel size [1]")
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages [1]")
    from mtds.training.config import TrainConfig
    from mtds.training.options import add_flag
    add_flag(ap, TrainConfig, "context_parallel_size",
             help="context parallel size c: every row is split over c ranks as in training (2c chunks, rank i "
                  "holding chunks i and 2c-1-i); a row whose length is not a multiple of 2c is padded at its "
                  "end with positions that have no loss. Layout (t, c, p, d), world = t*c*p*d [1]")
    add_flag(ap, TrainConfig, "cp_comm_type")
    ap.add_argument("--data", required=True, metavar="FILE", help="jsonl with input_ids rows, or a text file")
    ap.add_argument("--tokenizer", help="tokenizer for text data (default: from the checkpoint / HF dir)")
    ap.add_argument("--seq-length", type=int, help="window length for text data [max positions, at most 1024]")
    ap.add_argument("--debug", action="store_true", help="show the third-party warnings mtds hides "
                                                          "(mtds/observe/quiet.py)")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=0, help=argparse.SUPPRESS)
    return ap


# ---- data -----------------------------------------------------------------------------------------
def read_rows(path: str, *, tokenizer: str | None, seq_length: int) -> list[list[int]]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file {path!r} does not exist")
    if path.endswith((".jsonl", ".json")):
        rows = []
        with open(path) as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                record = json.loads(line)
                if "input_ids" not in record:
                    raise ValueError(f"{path}:{number}: no 'input_ids' field (text rows need a .txt file)")
                rows.append([int(x) for x in record["input_ids"]])
    else:
        if tokenizer is None:
            raise ValueError("text data needs a tokenizer: pass --tokenizer (none is recorded for this model)")
        from mtds.data import load_tokenizer
        with open(path) as f:
            ids = load_tokenizer(tokenizer)(f.read())["input_ids"]
        rows = [ids[i:i + seq_length] for i in range(0, len(ids), seq_length)]
    # A row longer than the positions the model has is cut into windows (each scored on its own).
    out = [row[i:i + seq_length] for row in rows for i in range(0, len(row), seq_length)]
    return [row for row in out if len(row) >= 2]


# ---- model ----------------------------------------------------------------------------------------
def build_eval_model(cfg, groups, *, ckpt: str | None = None, hf: str | None = None, device=None,
                     cp_comm_type: str = "p2p"):
    """This rank's layers with weights from a checkpoint or HF dir, in eval mode, on ``device`` (default: the
    process group's -- this rank's GPU under NCCL, else the host); ``cp_comm_type``: attention across the
    context-parallel ranks when ``groups.layout.cp`` > 1."""
    from mtds.hf.init import load_hf_into_stages
    from mtds.pipe import build_model
    from mtds.checkpoint.reshard_load import load_checkpoint_into_stages
    from mtds.tp import model_parallel_seed
    tracker = model_parallel_seed(0, groups.tp_rank)
    model = build_model(cfg, groups, seed=0, rng_tracker=tracker, cp_comm_type=cp_comm_type)
    if ckpt is not None:
        load_checkpoint_into_stages(model, ckpt, cfg, groups.tp_group)
    else:
        load_hf_into_stages(model, hf, cfg, groups)
    from mtds.training.distributed import group_device
    return model.to(device if device is not None else group_device()).eval()


def padded_length(length: int, cp: int) -> int:
    """``length`` rounded up to the 2C equal chunks context parallelism cuts a row into (C = 1: unchanged;
    evaluation has no sequence parallelism to split them further)."""
    from mtds.parallel.cp_rules import sequence_multiple
    multiple = sequence_multiple(cp)
    return -(-length // multiple) * multiple


def admit_eval(args, cfg, world_size: int, rows: list[list[int]]):
    """The rulebook's verdict on this evaluation (mtds.rules, as train.py's start-up asks it): the layout against
    the model, context parallelism for the longest row once padded; then what evaluation adds, the
    padded rows against learned positions. The layout, or one ``error:`` line. Dropout is not weighed:
    evaluation runs without it."""
    import dataclasses

    from mtds import rules
    from mtds.cp import ContextParallelError
    from mtds.parallel.cp_rules import sequence_multiple
    from mtds.parallel.layout import ParallelLayout
    cp = args.context_parallel_size
    longest = padded_length(max(len(row) for row in rows), cp)
    facts = dataclasses.replace(cfg, hidden_dropout=0.0, attention_dropout=0.0).facts()
    rules.check(rules.Job(model=facts, world_size=world_size, tp=args.tp, pp=args.pp, cp=cp,
                          cp_comm_type=args.cp_comm_type, seq_length=longest, purpose=rules.EVAL))
    if cp > 1 and cfg.position_embedding == "learned" and longest > cfg.max_position_embeddings:
        chunks = sequence_multiple(cp)
        raise ContextParallelError(
            f"--cp {cp} pads rows to a multiple of 2*C = {chunks}: a row of {longest} tokens exceeds the "
            f"model's {cfg.max_position_embeddings} learned positions: use --seq-length "
            f"{cfg.max_position_embeddings // chunks * chunks} or a --cp whose 2*C divides "
            f"{cfg.max_position_embeddings}")
    return ParallelLayout.for_world(world_size, tp=args.tp, pp=args.pp, cp=cp)


@torch.no_grad()
def stage_forward(model, input_ids: torch.Tensor, cfg, groups) -> torch.Tensor | None:
    """Run the pipeline on one batch (with context parallelism: the whole rows, a multiple of 2C long); the last
    stage returns vocab-sharded logits (this rank's s/C positions in its load-balanced order), others None."""
    layout = groups.layout
    input_ids = input_ids.to(next(model.parameters()).device)     # the caller's batch may be on the host
    if layout.pp == 1:
        return model.logits(input_ids)
    b, s = input_ids.shape
    if groups.is_first_stage:
        x = input_ids
    else:
        dtype = next(model.parameters()).dtype
        x = torch.empty(b, s // layout.cp, cfg.hidden_size, dtype=dtype, device=input_ids.device)
        dist.recv(x, src=layout.rank_of(groups.tp_rank, groups.dp_rank, groups.pp_rank - 1, groups.cp_rank))
    out = model(x)
    if not groups.is_last_stage:
        dist.send(out.contiguous(),
                  dst=layout.rank_of(groups.tp_rank, groups.dp_rank, groups.pp_rank + 1, groups.cp_rank))
        return None
    return out


def full_logits(model, input_ids: torch.Tensor, cfg, groups) -> torch.Tensor | None:
    """Unsharded logits [b, s, V] in natural order on the last stage (None elsewhere); for parity checks.
    With context parallelism the rows are padded as :func:`evaluation_totals` pads them and the C ranks'
    parts gathered."""
    from mtds.model import gather_logits
    cp, s = groups.layout.cp, input_ids.shape[1]
    if cp > 1:
        pad = padded_length(s, cp) - s
        input_ids = torch.cat([input_ids, input_ids.new_zeros(input_ids.shape[0], pad)], dim=1)
    shard = stage_forward(model, input_ids, cfg, groups)
    if shard is None:
        return None
    logits = gather_logits(cfg, shard, groups.tp_group)
    if cp > 1:
        from mtds.cp import gather_order
        parts = [torch.empty_like(logits) for _ in range(cp)]
        dist.all_gather(parts, logits.contiguous(), group=groups.cp_group)
        order = gather_order(input_ids.shape[1], cp, device=logits.device)
        logits = torch.cat(parts, dim=1).index_select(1, order)[:, :s]
    return logits


@torch.no_grad()
def evaluation_totals(model, rows: list[list[int]], cfg, groups, device) -> torch.Tensor:
    """[sum of next-token losses, tokens] over ``rows`` (split over data-parallel ranks), summed over all
    ranks, on ``device``: no host sync per row."""
    from mtds.cp import split_sequence
    from mtds.tp import vocab_parallel_cross_entropy
    cp = groups.layout.cp
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    for row in rows[groups.dp_rank::groups.layout.dp]:     # the C ranks of a CP group share a dp rank: same rows
        n = len(row)
        # padding at the end: under the causal mask no real token attends to it, and its labels are ignored
        ids = torch.tensor([row + [0] * (padded_length(n, cp) - n)], device=device)
        logits = stage_forward(model, ids, cfg, groups)
        if logits is None:
            continue
        labels = torch.full_like(ids, -100)
        labels[:, :n - 1] = ids[:, 1:n]
        labels = split_sequence(labels, cp, groups.cp_rank)     # this rank's positions, as its logits
        loss = vocab_parallel_cross_entropy(logits.float(), labels, groups.tp_group, vocab_size=cfg.vocab_size,
                                            reduction="sum")
        if groups.tp_rank == 0:            # every TP rank holds the same loss: count it once
            totals[0] += loss.double()
            totals[1] += (labels != -100).sum()     # this rank's share of the row's n - 1 targets
    dist.all_reduce(totals)                # only last-stage TP-rank-0 ranks contributed
    return totals


def evaluate(model, rows: list[list[int]], cfg, groups, device=None) -> dict:
    """Mean next-token loss over ``rows``, with the token count and perplexity."""
    from mtds.training.distributed import group_device
    device = device if device is not None else group_device()
    loss_sum, tokens = evaluation_totals(model, rows, cfg, groups, device).tolist()
    loss = loss_sum / max(tokens, 1)
    return {"loss": loss, "tokens": int(tokens), "ppl": math.exp(min(loss, 700.0))}


def _model_config_and_tokenizer(args):
    if args.ckpt:
        from mtds.checkpoint.reader import open_checkpoint
        ckpt = open_checkpoint(args.ckpt)
        return ckpt.cfg, args.tokenizer or ckpt.meta.tokenizer
    from mtds.hf.init import hf_model_config
    from mtds.hf.stream_export import TOKENIZER_FILES
    cfg = hf_model_config(args.hf)
    has_tok = any(os.path.isfile(os.path.join(args.hf, n)) for n in TOKENIZER_FILES)
    return cfg, args.tokenizer or (args.hf if has_tok else None)


def run(args) -> dict:
    from mtds.training.distributed import init_distributed
    device, _ = init_distributed()
    cfg, tokenizer = _model_config_and_tokenizer(args)
    seq = args.seq_length or min(cfg.max_position_embeddings, 1024)
    if seq > cfg.max_position_embeddings:
        raise ValueError(f"--seq-length {seq} exceeds the model's {cfg.max_position_embeddings} positions")
    rows = read_rows(args.data, tokenizer=tokenizer, seq_length=seq)
    if not rows:
        raise ValueError(f"{args.data}: no row with at least 2 tokens")
    layout = admit_eval(args, cfg, dist.get_world_size(), rows)     # before any process group exists
    groups = layout.build_groups()
    model = build_eval_model(cfg, groups, ckpt=args.ckpt, hf=args.hf, device=device, cp_comm_type=args.cp_comm_type)
    return evaluate(model, rows, cfg, groups, device)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    from mtds.observe import quiet
    quiet.install(debug=args.debug)     # before anything imports DeepSpeed
    from mtds.training.cli import user_errors
    from mtds.training.distributed import run_and_exit

    def work():
        result = run(args)
        if dist.get_rank() == 0:
            print(json.dumps(result), flush=True)

    run_and_exit(work, user_errors() + (KeyError, OSError))


if __name__ == "__main__":
    main()
