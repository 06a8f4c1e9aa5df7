"""One rank of the baselines HuggingFace users run: a ``transformers`` causal LM (GPT2LMHeadModel for
GPT-2 configs) trained through ``accelerate`` with DeepSpeed (ZeRO-3: ``hf-zero3``; DeepSpeed's AutoTP:
``autotp``), launched per node by the same DeepSpeed launcher as the mtds schemes.

    deepspeed ... --module compare.hf_entry PROBE_DIR --deepspeed_config C --model M --steps N \
        --seq-length S --log-jsonl FILE [--autotp T]

Same model, initial weights, samples and LR schedule as train.py (mtds's initial weights are exported
to HF names, mtds's MicroBatchStream feeds each data-parallel rank its slice of every global batch), so
the loss curves overlay. On CPU accelerate needs ``InitProcessGroupKwargs(backend="gloo")``, or it
finds no GPU and runs one process (DeepSpeed then fails its batch-size check).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _args(argv):
    ap = argparse.ArgumentParser(prog="compare.hf_entry")
    ap.add_argument("probe_dir")
    ap.add_argument("--deepspeed_config", required=True)
    ap.add_argument("--model", default="gpt2-tiny")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seq-length", type=int, default=128)
    ap.add_argument("--log-jsonl", required=True)
    ap.add_argument("--autotp", type=int, default=0, help="DeepSpeed AutoTP size (0: plain ZeRO data parallel)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--local_rank", type=int, default=0)
    return ap.parse_args(argv)


def _hf_model(model_name: str, seed: int):
    from transformers import AutoModelForCausalLM

    from mtds.hf.resolve import resolve_model_config
    from mtds.hf import hf_config_from_model_config, model_to_hf_state
    from mtds.model import GPTModel
    cfg = resolve_model_config(model_name)
    hf = AutoModelForCausalLM.from_config(hf_config_from_model_config(cfg))
    hf.load_state_dict(model_to_hf_state(GPTModel(cfg, seed=seed)), strict=False)
    return cfg, hf


def main(argv=None) -> None:
    args = _args(sys.argv[1:] if argv is None else argv)
    from mtds.observe.comm_trace import CommTracer
    tracer = CommTracer().install()                # before accelerate/DeepSpeed cache the collectives
    if os.environ.get("MTDS_RANKS_PER_NODE"):       # on an emulated cluster: split bytes by node
        tracer.ranks_per_node = int(os.environ["MTDS_RANKS_PER_NODE"])
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.utils import InitProcessGroupKwargs

    from lab.measure import peak_rss_gib
    from mtds.data import MicroBatchStream, build_packed_dataset, load_tokenizer
    from mtds.observe.metrics import hardware_flops_per_iteration, model_flops_per_iteration
    from mtds.training.distributed import device_and_backend
    from mtds.training.schedule import lr_factor
    import deepspeed
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False    # an inference-only JIT build (~40 s)
    device, backend = device_and_backend()                             # CUDA + NCCL where GPUs exist

    with open(args.deepspeed_config) as f:
        user = json.load(f)
    world = int(os.environ["WORLD_SIZE"])
    tp = max(args.autotp, 1)
    dp = world // tp
    B, b = user["train_batch_size"], user["train_micro_batch_size_per_gpu"]
    accumulation = B // (b * dp)
    opt = user["optimizer"]["params"]
    ds_config = {"train_micro_batch_size_per_gpu": b, "gradient_accumulation_steps": accumulation,
                 "gradient_clipping": user.get("gradient_clipping", 0.0),
                 "zero_optimization": user.get("zero_optimization", {"stage": 3}), "steps_per_print": 10 ** 9}
    if args.autotp:
        ds_config["tensor_parallel"] = {"autotp_size": args.autotp}
    # Built whole before accelerate declares ZeRO-3 (after that transformers builds it empty, partitioned).
    cfg, model = _hf_model(args.model, args.seed)
    accelerator = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend=backend)],
                              deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config, zero3_init_flag=False))
    rank = dist.get_rank()
    optimizer = torch.optim.AdamW(model.parameters(), lr=opt["lr"], betas=tuple(opt["betas"]), eps=opt["eps"],
                                  weight_decay=opt["weight_decay"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(
        s, base_lr=opt["lr"], min_lr=0.0, warmup=0, total=args.steps, decay="constant"))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    from .state import StateProbe
    state = StateProbe().install(model)            # accelerate's prepared model is the DeepSpeed engine
    tokenizer = load_tokenizer(None)
    with accelerator.main_process_first():        # rank 0 fills the tokenization cache
        dataset = build_packed_dataset(None, tokenizer, args.seq_length, show_progress=False)
    stream = MicroBatchStream(dataset, global_batch_size=B, micro_batch_size=b, dp_rank=rank // tp, dp_size=dp,
                              seed=args.seed)
    link_device = os.environ.get("MTDS_LINK_DEVICE")
    if link_device:
        from mtds.cluster.netns import boundary_link_stats
    flops_model = model_flops_per_iteration(B, args.seq_length, cfg.num_layers, cfg.hidden_size, cfg.vocab_size)
    flops_hw = hardware_flops_per_iteration(B, args.seq_length, cfg.num_layers, cfg.hidden_size, cfg.vocab_size)
    losses, step_times, comm, link = [], [], [], []
    log = open(args.log_jsonl, "w") if rank == 0 else None
    model.train()
    for step in range(1, args.steps + 1):
        tracer.reset()
        before = boundary_link_stats(link_device, dist.barrier) if link_device else None
        dist.barrier()                             # every rank starts the step together (compare.table's step time)
        start = time.perf_counter()
        total = torch.zeros((), device=device)
        for _ in range(accumulation):
            # accumulate(): without it accelerate tells the engine every micro-batch is a boundary,
            # and the optimizer steps `accumulation` times per global batch.
            with accelerator.accumulate(model):
                input_ids, labels = (t.to(device) for t in next(stream))
                logits = model(input_ids=input_ids).logits
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                         labels.reshape(-1))
                accelerator.backward(loss)         # DeepSpeed divides by the accumulation steps itself
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            total += loss.detach() / accumulation
        elapsed = time.perf_counter() - start
        comm.append(tracer.summary())
        if link_device:
            after = boundary_link_stats(link_device, dist.barrier)
            link.append({**{k: after[k] - before[k] for k in ("tx_bytes", "rx_bytes")},
                         "tx_at_start": before["tx_bytes"], "tx_at_end": after["tx_bytes"]})
        dist.all_reduce(total)                     # logging only (after the step's counters)
        losses.append(total.item() / world)
        step_times.append(elapsed)
        if log:
            log.write(json.dumps({"kind": "train", "step": step, "loss": losses[-1], "step_time_s": elapsed,
                                  "lr": scheduler.get_last_lr()[0],
                                  "tokens_per_s": B * args.seq_length / elapsed,
                                  "tflops_model": flops_model / elapsed / world / 1e12,
                                  "tflops_hw": flops_hw / elapsed / world / 1e12}) + "\n")
            log.flush()
    os.makedirs(args.probe_dir, exist_ok=True)
    with open(os.path.join(args.probe_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "world": world, "layout": f"hf t{tp} d{dp}", "step_times_s": step_times,
                   "comm_per_step": comm, "parameters": sum(p.numel() for p in model.parameters()),
                   "peak_rss_gib": peak_rss_gib(), "losses": losses, "link_per_step": link,
                   "model_state": state.peak}, f)
    if log:
        log.close()
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)                                    # avoids gloo's random abort at interpreter exit


if __name__ == "__main__":
    main()
