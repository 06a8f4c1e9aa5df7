"""mtds's MoE block against DeepSpeed's ``deepspeed.moe.layer.MoE`` and Megatron-core's ``MoELayer`` on the same
work, on CPU ranks (gloo).

    python benchmarks/bench_moe.py [--hidden 512] [--experts 8] [--ffn 1024] [--tokens 2048] [--iters 10]
                                   [--warmup 2] [--ranks 2] [--reps 1] [--megatron auto|on|off] [--out FILE]

One pair of ranks (``--ranks`` e, expert parallelism over all of them) builds three blocks and times one
forward + backward of each per iteration, alternated in one loop (mtds e, DeepSpeed e, mtds e = 1, then again),
every rank starting each timed call together (a barrier, outside the time):

- mtds: ``MoEBlock(cfg, ep_group=G)`` -- transformers' (Mixtral) top-k router, dropless, the
  ``AllToAllDispatcher`` (uneven all-to-all of the N·k rows), each rank's E/e experts as grouped GEMMs;
- DeepSpeed: ``MoE(h, SwiGLU(h, F), E, ep_size=e, k=2, drop_tokens=False, use_rts=False,
  top2_2nd_expert_sampling=False)`` on the same group G (DeepSpeed's own ``ep_size_e`` expert group) --
  GShard top-2 gating, the tokens scattered into an [E, C, h] buffer with C the largest per-expert count
  over the group (dropless by growing C, ``drop_tokens=False``), two even all-to-alls of that buffer, a
  ``ModuleList`` of E/e SwiGLU modules;
- mtds at e = 1 (``LocalDispatcher``, every expert on every rank, no communication): the reference;
- Megatron-core 0.19.2 (benchmarks/megatron_moe.py, in the peers' interpreter ``PEERS_PYTHON`` /
  ``PEERS_WORK``, its own e ranks): ``MoELayer`` from its local spec -- ``TopKRouter`` (softmax over the top-2
  logits = Mixtral's renormalised top-2, fp32, no aux loss), ``MoEAlltoAllTokenDispatcher`` (dropless, uneven
  all-to-alls of the N·k rows and their routing weights), ``SequentialMLP`` (E/e SwiGLU ``MLP`` experts, one
  fc1/fc2 pair each: 0.19.2 has no grouped-GEMM training path without Transformer Engine), with CPU shims
  listed there. Its weights and inputs are mtds's (:func:`write_megatron_job` writes mtds's block at e = 1, each
  rank's tokens, upstream gradient and mtds's output for them); it checks its output against mtds's.
  Megatron-core runs in another interpreter, so it cannot share mtds's loop: each of ``--reps`` repetitions runs
  mtds's ranks (the three blocks above), then Megatron-core's, so that drift reaches both; the iterations of
  all repetitions are pooled for the medians. ``--megatron auto`` skips it, saying why, where the peers'
  interpreter or its megatron-core is missing (``on``: fail instead).

Same work: the same N tokens per rank, E experts, top-2, expert shapes [2F, h] / [h, F], and the same
weights (DeepSpeed's gate and experts are copied from mtds's block), so that both route every token to the
same two experts (GShard's first expert is the argmax, its second the argmax of the rest without the Gumbel
sampling, each weight renormalised over the two: Mixtral's routing) and their outputs agree (checked, the
max difference is printed). Not the same function: DeepSpeed's forward also computes its GShard aux loss
(E²·mean(mean probs · top-1 fractions)) and rounds each expert's rows up to C (padding rows computed and
exchanged); mtds's aux loss is the model's (transformers' pooled loss, only its statistics are kept here).
The backward starts from the same upstream gradient of the output; neither aux loss is in it.

Time: per iteration the slowest rank's forward + backward, median over ``--iters`` after ``--warmup``;
tokens/s per rank = N / that. Beside it the process (CPU) time of the same calls, less sensitive to other
processes on a shared machine. fp32, one BLAS thread per rank.

Bytes: mtds's all-to-all bytes of one traced iteration (``CommTracer``, the EP group), summed over the e ranks,
must equal docs/moe.md's formula per block and micro-batch: the E int64 counts, the N·k rows out, the R rows
back, and both reversed in backward, 8E + 4h(2Nk + 2R) per rank; over the ranks ΣR = e·N·k, so
    mtds:       e·8E + 16·h·e·N·k
and DeepSpeed's (each of its four all-to-alls moves the whole [E, C, h] buffer of each rank):
    DeepSpeed:  16·h·e·E·C
and Megatron-core's (the N·k rows and their N·k fp32 routing weights out, R rows back, and in backward the R row
and R weight gradients, then the N·k output gradients: 4h(2Nk + 2R) + 4(Nk + R) per rank; its per-expert counts
go by an all-gather of E int64 per rank, e·8E, checked apart):
    Megatron-core:  16·h·e·N·k + 8·e·N·k
At e = 1 nothing is exchanged (a group of one rank; the tracer counts no such call): 0 for all three.
The expert rows each rank's experts compute are checked equal between mtds and Megatron-core (both dropless,
same routing), and Megatron-core's outputs against mtds e = 1 (< 1e-4, as DeepSpeed's).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch import nn

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)      # mtds when run as a script

VARIANTS = ("mtds", "deepspeed", "mtds_local")       # the blocks of mtds's own process group
LABELS = {"mtds": "mtds `MoEBlock`, all-to-all", "deepspeed": "DeepSpeed `MoE` (GShard top-2, dropless C)",
          "megatron": "Megatron-core `MoELayer` (alltoall dispatcher, SequentialMLP)",
          "mtds_local": "mtds `MoEBlock`, e = 1 (local, reference)"}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=1024, help="each expert's SwiGLU width")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per rank (N)")
    parser.add_argument("--top-k", type=int, default=2, choices=(2,), help="DeepSpeed's top-2 gating is compared")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=2, help="ranks = expert-parallel size e")
    parser.add_argument("--threads", type=int, default=1, help="BLAS threads per rank")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--reps", type=int, default=1,
                        help="repetitions, mtds's ranks then Megatron-core's each time (iterations pooled)")
    parser.add_argument("--megatron", choices=("auto", "on", "off"), default="auto",
                        help="Megatron-core's side: auto runs it where the peers' interpreter has megatron-core")
    parser.add_argument("--out", default=None, help="also write the markdown table here")
    args = parser.parse_args(argv)
    if args.experts % args.ranks:
        parser.error(f"--experts {args.experts} must be a multiple of --ranks {args.ranks}")
    return args


def model_config(args):
    """A Mixtral-like MoE config holding just what one block reads (h, E, k, F, init)."""
    from mtds.model.config import ModelConfig
    return ModelConfig(vocab_size=256, hidden_size=args.hidden, num_layers=1, num_heads=4, ffn_hidden_size=args.ffn,
                       position_embedding="rotary", normalization="rmsnorm", activation="swiglu", qkv_bias=False,
                       linear_bias=False, architecture="mixtral", num_experts=args.experts, moe_top_k=args.top_k,
                       moe_ffn_hidden_size=args.ffn)


def mtds_all_to_all_bytes(e: int, experts: int, hidden: int, tokens: int, k: int, w: int = 4) -> int:
    """docs/moe.md, per block and micro-batch, summed over the e ranks: e·8E + 4·w·h·e·N·k (w = 4: fp32);
    0 at e = 1 (a group of one rank exchanges nothing; the tracer counts no such call)."""
    return e * 8 * experts + 4 * w * hidden * e * tokens * k if e > 1 else 0


def deepspeed_all_to_all_bytes(e: int, experts: int, hidden: int, capacity: int, w: int = 4) -> int:
    """Four all-to-alls (two forward, two backward) of each rank's [E, C, h] buffer, summed over the e ranks."""
    return 4 * w * hidden * e * experts * capacity if e > 1 else 0


def megatron_all_to_all_bytes(e: int, hidden: int, tokens: int, k: int, w: int = 4) -> int:
    """Megatron-core's alltoall dispatcher, summed over the e ranks: the rows (4·w·h·e·N·k, as mtds) and their
    routing weights, out and back once each (2·w·e·N·k); its counts go by all-gather, not all-to-all."""
    return 4 * w * hidden * e * tokens * k + 2 * w * e * tokens * k if e > 1 else 0


class SwiGLU(nn.Module):
    """One expert for DeepSpeed's ``Experts``: mtds's expert arithmetic, gate|up fused as in ``gate_up``."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(torch.nn.functional.silu(gate) * up)


def deepspeed_moe(args, ep_size: int):
    """DeepSpeed's layer as compared: top-2, dropless (``drop_tokens=False``: C grows to the largest count, so
    ``capacity_factor`` / ``min_capacity`` do not apply), no random token selection (``use_rts``: top-1 only)
    and no Gumbel sampling of the second expert, so its routing is Mixtral's."""
    from deepspeed.moe.layer import MoE
    return MoE(hidden_size=args.hidden, expert=SwiGLU(args.hidden, args.ffn), num_experts=args.experts,
               ep_size=ep_size, k=args.top_k, capacity_factor=1.0, min_capacity=0, drop_tokens=False, use_rts=False,
               top2_2nd_expert_sampling=False)


def copy_into_deepspeed(ds_moe, block) -> None:
    """DeepSpeed's gate and local experts := mtds's router and this rank's experts (rank j holds experts
    [j·E/e, (j+1)·E/e) in both: DeepSpeed's all-to-all sends chunk j of the [E, C, h] buffer to rank j)."""
    with torch.no_grad():
        ds_moe.deepspeed_moe.gate.wg.weight.copy_(block.router.weight)
        for i, expert in enumerate(ds_moe.deepspeed_moe.experts.deepspeed_experts):
            expert.gate_up.weight.copy_(block.experts.gate_up[i])
            expert.down.weight.copy_(block.experts.down[i])


def rank_inputs(args, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s N tokens and the upstream gradient of its output (the same on every side)."""
    g = torch.Generator().manual_seed(args.seed + 1 + rank)
    return torch.randn(args.tokens, args.hidden, generator=g), torch.randn(args.tokens, args.hidden, generator=g)


def write_megatron_job(args, directory: str) -> None:
    """Megatron-core's job, in this one process: mtds's block at e = 1 (the seed's weights, those the ranks'
    blocks hold), every rank's inputs and mtds's output for them (benchmarks/megatron_moe.py reads it)."""
    from benchmarks.megatron_moe import write_job
    from mtds.model.moe import MoEBlock
    torch.manual_seed(args.seed)
    local = MoEBlock(model_config(args))
    per_rank = []
    with torch.no_grad():
        for rank in range(args.ranks):
            tokens, upstream = rank_inputs(args, rank)
            per_rank.append({"tokens": tokens, "upstream": upstream, "reference": local(tokens)})
    shape = {"hidden": args.hidden, "experts": args.experts, "ffn": args.ffn, "top_k": args.top_k,
             "tokens": args.tokens}
    write_job(directory, shape, local.router.weight, local.experts.gate_up, local.experts.down, per_rank)


def run_megatron(args, job: str) -> dict:
    """Megatron-core's side (benchmarks/megatron_moe.py) on e ranks of the peers' interpreter; its JSON."""
    import json
    import subprocess
    import tempfile

    from benchmarks.peer_runner import peers_python
    out = tempfile.mktemp(prefix="megatron_moe_", suffix=".json")
    cmd = [peers_python(), os.path.join(REPO, "benchmarks", "megatron_moe.py"), "--job", job, "--ranks",
           str(args.ranks), "--iters", str(args.iters), "--warmup", str(args.warmup), "--threads", str(args.threads),
           "--timeout", str(args.timeout), "--out", out]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONWARNINGS="ignore")
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout + 120)
    try:
        with open(out) as f:
            result = json.load(f)
        os.unlink(out)
    except (OSError, ValueError):
        result = {"error": f"rc {p.returncode}: {p.stderr[-3000:]}"}
    if "error" in result:
        raise RuntimeError(f"Megatron-core's side failed: {result['error']}")
    return result


def _rank_body(args) -> dict:
    import torch.distributed as dist
    from mtds.observe.comm_trace import CommTracer
    # the wrappers go on before DeepSpeed's comm starts (it may keep references to the functions it finds)
    CommTracer().install()
    from mtds.training.distributed import init_distributed
    init_distributed()
    from deepspeed.utils import groups
    from mtds.model.moe import MoEBlock

    e, rank = dist.get_world_size(), dist.get_rank()
    cfg = model_config(args)
    E, k, N = args.experts, args.top_k, args.tokens
    ds = deepspeed_moe(args, e)
    ds.set_deepspeed_parallelism()
    ep_group = groups._get_expert_parallel_group(f"ep_size_{e}")
    torch.manual_seed(args.seed)
    block = MoEBlock(cfg, ep_group=ep_group)
    torch.manual_seed(args.seed)
    local = MoEBlock(cfg)       # the same values: the init draws the whole tensor and keeps this rank's experts
    a, b = block.experts.gate_up.expert_rows
    assert torch.equal(local.experts.gate_up[a:b], block.experts.gate_up)
    copy_into_deepspeed(ds, block)
    blocks = {"mtds": block, "deepspeed": ds, "mtds_local": local}
    for m in blocks.values():
        m.train()

    tokens, upstream = rank_inputs(args, rank)

    def step(name):
        out = blocks[name](tokens.clone().requires_grad_(True))
        out = out[0] if isinstance(out, tuple) else out
        out.backward(upstream)
        return out

    # same routing, same output (up to summation order)
    with torch.no_grad():
        outs = {name: (lambda o: o[0] if isinstance(o, tuple) else o)(blocks[name](tokens)) for name in VARIANTS}
    diff = max((outs[n] - outs["mtds_local"]).abs().max().item() for n in ("mtds", "deepspeed"))

    # bytes of one iteration, outside the timed ones
    traced = {}
    for name in ("mtds", "deepspeed"):
        with CommTracer() as tracer:
            tracer.name_group(ep_group, "ep")
            step(name)
        traced[name] = tracer.summary().get("all_to_all/ep", {}).get("bytes", 0)
    # DeepSpeed's dropless capacity: the largest per-expert count of any rank (its gate's all-reduce MAX);
    # the per-expert counts summed over the ranks give the rows each rank's experts compute in mtds
    counts = ds.deepspeed_moe.exp_counts.clone().to(torch.int64)
    capacity, total = counts.max().clone(), counts.clone()
    dist.all_reduce(capacity, op=dist.ReduceOp.MAX)
    dist.all_reduce(total)
    L = E // e
    rows = {"mtds": int(total[rank * L:(rank + 1) * L].sum()), "deepspeed": E * int(capacity), "mtds_local": N * k}

    times = {name: [] for name in VARIANTS}
    cpu = {name: [] for name in VARIANTS}
    for it in range(args.warmup + args.iters):
        # the order rotates each iteration, so that no block always runs first after the others
        for name in VARIANTS[it % 3:] + VARIANTS[:it % 3]:
            for p in blocks[name].parameters():
                p.grad = None
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            step(name)
            elapsed, elapsed_cpu = time.perf_counter() - start, time.process_time() - start_cpu
            if it >= args.warmup:
                times[name].append(elapsed)
                cpu[name].append(elapsed_cpu)
    slowest = torch.tensor([times[n] + cpu[n] for n in VARIANTS], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    wall, cpu_s = slowest[:, :args.iters], slowest[:, args.iters:]
    sums = torch.tensor([traced["mtds"], traced["deepspeed"]], dtype=torch.int64)
    dist.all_reduce(sums)
    return {"iter_s": {n: wall[i].tolist() for i, n in enumerate(VARIANTS)},
            "iter_cpu_s": {n: cpu_s[i].tolist() for i, n in enumerate(VARIANTS)},
            "median_s": {n: statistics.median(wall[i].tolist()) for i, n in enumerate(VARIANTS)},
            "median_cpu_s": {n: statistics.median(cpu_s[i].tolist()) for i, n in enumerate(VARIANTS)},
            "bytes": {"mtds": int(sums[0]), "deepspeed": int(sums[1])}, "capacity": int(capacity), "max_diff": diff,
            "rows": rows, "global_counts": total.tolist(),
            "torch_threads": torch.get_num_threads()}


def main(argv=None) -> int:
    args = parse_args(argv)
    import shutil
    import tempfile

    from mtds.local_ranks.spawn import spawn
    from benchmarks.bench_moe import _rank_body as body     # by module name, so the forked ranks find it
    from benchmarks.peer_runner import peer_python_missing
    skipped = "--megatron off" if args.megatron == "off" else peer_python_missing("megatron.core")
    if skipped and args.megatron == "on":
        raise SystemExit(f"--megatron on: {skipped}")
    job = None
    if not skipped:
        job = tempfile.mkdtemp(prefix="bench_moe_megatron_")
        write_megatron_job(args, job)
    mtds_reps, megatron_reps = [], []
    try:
        for rep in range(args.reps):
            # alternated: mtds's ranks (mtds e, DeepSpeed e, mtds e = 1), then Megatron-core's ranks, then again
            mtds_reps.append(spawn(body, args.ranks, args, timeout=args.timeout,
                                   env={"OMP_NUM_THREADS": str(args.threads)}, fresh=True))
            if job:
                megatron_reps.append(run_megatron(args, job))
            print(f"rep {rep + 1}/{args.reps}: " + ", ".join(
                f"{n} {mtds_reps[-1][0]['median_s'][n] * 1e3:.1f} ms" for n in VARIANTS) +
                (f", megatron {megatron_reps[-1]['median_s'] * 1e3:.1f} ms" if job else ""), flush=True)
    finally:
        if job:
            shutil.rmtree(job, ignore_errors=True)
    r = pooled(mtds_reps, megatron_reps)
    e, E, h, N, k = args.ranks, args.experts, args.hidden, args.tokens, args.top_k
    want = {"mtds": mtds_all_to_all_bytes(e, E, h, N, k), "deepspeed": deepspeed_all_to_all_bytes(e, E, h, r["capacity"]),
            "mtds_local": 0}
    got = dict(r["bytes"], mtds_local=0)
    if megatron_reps:
        m = megatron_reps[0]
        want["megatron"], got["megatron"] = megatron_all_to_all_bytes(e, h, N, k), m["all_to_all_bytes"]
    table = format_table(args, r, [p["rows"] for p in mtds_reps[0]], got, want,
                         megatron_reps[0] if megatron_reps else None, skipped)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    # the formulas of the module docstring, to the byte; the blocks route alike (same weights)
    assert got == want, f"all-to-all bytes traced {got} != formula {want}"
    assert r["max_diff"] < 1e-4, f"outputs differ by {r['max_diff']:.2e}: not the same routing"
    if megatron_reps:
        assert m["max_diff"] < 1e-4, f"Megatron-core's outputs differ by {m['max_diff']:.2e}: not the same routing"
        assert m["all_gather_bytes"] == (e * 8 * E if e > 1 else 0), m["all_gather_bytes"]
        mtds_rows = [p["rows"]["mtds"] for p in mtds_reps[0]]
        assert m["rows"] == mtds_rows, f"expert rows per rank: Megatron-core {m['rows']} != mtds {mtds_rows}"
    return 0


def pooled(mtds_reps: list, megatron_reps: list) -> dict:
    """Rank 0's result of the first repetition, its medians replaced by those of every repetition's iterations
    together (each iteration's time is already the slowest rank's); Megatron-core's likewise, under 'megatron'."""
    r = dict(mtds_reps[0][0])
    r["median_s"] = {n: statistics.median(x for rep in mtds_reps for x in rep[0]["iter_s"][n]) for n in VARIANTS}
    r["median_cpu_s"] = {n: statistics.median(x for rep in mtds_reps for x in rep[0]["iter_cpu_s"][n])
                         for n in VARIANTS}
    r["rep_median_s"] = {n: [rep[0]["median_s"][n] for rep in mtds_reps] for n in VARIANTS}
    if megatron_reps:
        r["median_s"]["megatron"] = statistics.median(x for m in megatron_reps for x in m["iter_s"])
        r["median_cpu_s"]["megatron"] = statistics.median(x for m in megatron_reps for x in m["iter_cpu_s"])
        r["rep_median_s"]["megatron"] = [m["median_s"] for m in megatron_reps]
    return r


ROWS = ("mtds", "deepspeed", "megatron", "mtds_local")


def format_table(args, r, rows_per_rank, got, want, megatron=None, skipped=None) -> str:
    """The markdown table: one row per block, then the shape, the capacity and the output checks."""
    e, N = args.ranks, args.tokens
    lines = ["| block | e | ms per fwd+bwd (median, slowest rank) | tokens/s per rank | mtds e / this "
             "(speed, >= 1: mtds faster) | CPU ms (process time) | expert rows per rank "
             "| all-to-all bytes / iteration, sum over ranks (traced = formula) |",
             "|---|---|---|---|---|---|---|---|"]
    ours = r["median_s"]["mtds"]
    for name in ROWS:
        if name == "megatron" and megatron is None:
            lines.append(f"| {LABELS[name]} | {e} | skipped: {skipped} | | | | | |")
            continue
        s = r["median_s"][name]
        rows = " / ".join(str(x) for x in megatron["rows"]) if name == "megatron" else \
            " / ".join(str(p[name]) for p in rows_per_rank)
        ranks = 1 if name == "mtds_local" else e
        traced = "-" if name == "mtds_local" else f"{got[name]:,} = {want[name]:,}"
        lines.append(f"| {LABELS[name]} | {ranks} | {s * 1e3:.1f} | {N / s:,.0f} | {s / ours:.3f} "
                     f"| {r['median_cpu_s'][name] * 1e3:.1f} | {rows} | {traced} |")
    reps = "; ".join(f"{n}: " + " / ".join(f"{x * 1e3:.1f}" for x in r["rep_median_s"][n])
                     for n in ROWS if n in r["rep_median_s"])
    lines += ["", f"h {args.hidden}, E {args.experts}, top-{args.top_k}, expert SwiGLU F {args.ffn}, N {N} tokens per "
              f"rank, fp32, {e} CPU ranks (gloo, {r['torch_threads']} thread each), median of {args.iters} "
              f"iterations after {args.warmup} warm-up x {args.reps} repetition(s), iterations of all repetitions "
              f"pooled. mtds's three blocks alternate in each iteration (order rotated) in one process group; "
              f"Megatron-core runs in its own interpreter and ranks after each repetition of mtds's "
              f"(mtds, Megatron-core, mtds, Megatron-core, ...), so drift reaches both. Medians per repetition, ms: "
              f"{reps}. CPU ms: the process time of the same calls (median, slowest rank; gloo's waiting "
              f"threads included). "
              f"DeepSpeed's dropless capacity C = {r['capacity']} (the largest per-expert count of a rank; "
              f"N·k/E = {N * args.top_k // args.experts}); tokens per expert over all ranks {r['global_counts']}; "
              f"expert rows per rank listed by rank (0 / 1 / ...). Forward outputs, max |difference| against mtds e = 1: "
              f"mtds e and DeepSpeed {r['max_diff']:.1e}"
              + (f", Megatron-core {megatron['max_diff']:.1e}." if megatron else ".")]
    if megatron:
        lines += ["", f"Megatron-core {megatron['version']} (torch {megatron['torch']}): {megatron['router']} + "
                  f"{megatron['dispatcher']} + {megatron['experts_impl']}; its per-expert counts all-gathered: "
                  f"{megatron['all_gather_bytes']:,} bytes / iteration over the ranks (e·8E at e > 1). CPU shims: "
                  + "; ".join(megatron["patches"]) + "."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
