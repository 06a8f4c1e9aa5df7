"""Save/resume and evaluation on the run's device.

Save/resume: a run saves at step k and runs on to N; a second run loads step k and trains k+1..N. Its
losses and grad norms must equal the first run's bit for bit (the checkpoint carries weights, optimizer,
scheduler, RNG streams and the data position). On CUDA the ranks run with deterministic algorithms
(``torch.use_deterministic_algorithms`` and ``CUBLAS_WORKSPACE_CONFIG``) so that a difference is the
checkpoint's, not a non-deterministic kernel's.

Eval: ``mtds.eval`` (the functions behind ``mtds-eval``) scores the saved checkpoint at the run's layout
on the run's device, against HuggingFace ``GPT2LMHeadModel`` loaded from the same checkpoint exported by
``mtds-convert mtds-to-hf``, in fp32 with TF32 off, on the same rows.
"""
from __future__ import annotations

import functools
import os
import tempfile

from mtds.gpucheck.report import Section

EVAL_ROWS = 8
# fp32 against fp32, same weights: only the order of sums differs (TP/pipeline split, another attention
# kernel on GPUs, reductions of up to s·h terms): 1e-5 on CPU as the suite, 1e-4 on CUDA.
EVAL_TOL = {"cpu": 1e-5, "cuda": 1e-4}
DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def _setup(device: str):
    if device == "cuda":      # fresh processes on CUDA; pooled CPU ranks must not keep a global mode
        import torch
        torch.use_deterministic_algorithms(True, warn_only=True)
    return None


def _train(case):
    from mtds.training import run

    from mtds.gpucheck.ds_configs import train_config
    kind, workload, precision, device, pp, root, k = case
    common = dict(pp=pp, pipeline_schedule="1f1b")
    if kind == "straight":
        result = run(train_config(workload, precision, device, save=root, save_interval=k, **common))
    else:
        result = run(train_config(workload, precision, device, load=os.path.join(root, f"global_step{k}"), **common))
    return {"losses": result.losses, "grad_norms": result.grad_norms}


def eval_rows(seq: int) -> list[list[int]]:
    """The first ``EVAL_ROWS`` packed windows of the shipped corpus (``seq`` tokens each)."""
    from mtds.data import build_packed_dataset, load_tokenizer
    dataset = build_packed_dataset(None, load_tokenizer(None), seq, show_progress=False)
    return [dataset[i][:seq].tolist() for i in range(EVAL_ROWS)]


def _evaluate(case):
    import torch.distributed as dist

    from mtds.eval import build_eval_model, evaluate
    from mtds.parallel.layout import ParallelLayout
    from mtds.checkpoint.reader import open_checkpoint

    from mtds.gpucheck.reference import exact_fp32
    _, workload, _, _, pp, root, _ = case
    from mtds.training.distributed import group_device
    device = group_device()
    rows = eval_rows(workload.seq)
    cfg = open_checkpoint(root).cfg
    with exact_fp32():
        hf_loss = None
        if dist.get_rank() == 0:
            hf_loss = _hf_loss(root, rows, device)
        groups = ParallelLayout.for_world(dist.get_world_size(), tp=1, pp=pp).build_groups()
        model = build_eval_model(cfg, groups, ckpt=root, device=device)
        on_device = all(p.device == device for p in model.parameters())
        got = evaluate(model, rows, cfg, groups, device)
    box = [hf_loss]
    dist.broadcast_object_list(box, src=0, device=device if device.type == "cuda" else None)
    return {"mtds": got["loss"], "tokens": got["tokens"], "hf": box[0], "on_device": on_device}


def _hf_loss(root: str, rows, device) -> float:
    """Token-weighted mean next-token loss of the HF export of the checkpoint at ``root``."""
    import torch
    from transformers import GPT2LMHeadModel

    from mtds.cli.convert import build_parser, run_mtds_to_hf
    out = tempfile.mkdtemp(prefix="mtds-gpucheck-hf-")
    run_mtds_to_hf(build_parser().parse_args(["mtds-to-hf", "--ckpt", root, "--out", out]))
    hf = GPT2LMHeadModel.from_pretrained(out, torch_dtype=torch.float32).to(device).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([row], device=device)
            total += float(hf(ids, labels=ids).loss) * (len(row) - 1)
            count += len(row) - 1
    return total / count


def check(machine, workload, precision: str, timeout: float) -> Section:
    from mtds.gpucheck.ranks import run_cases
    world = 2 if machine.ranks >= 2 else 1
    k = workload.steps // 2
    root = tempfile.mkdtemp(prefix="mtds-gpucheck-ckpt-")
    section = Section("eval and save/resume", f"{workload.describe()}, {precision}, (t,p,d)=(1,{world},1) 1f1b on "
                      f"{machine.device}: saved at step {k}, resumed for steps {k + 1}-{workload.steps} (bit-exact); "
                      f"mtds.eval of the final checkpoint against its HF export (fp32, tolerance "
                      f"{EVAL_TOL[machine.device]:g} relative).")
    base = (workload, precision, machine.device, world, root, k)
    cases = [("straight",) + base, ("resumed",) + base, ("eval",) + base]
    outcome, _ = run_cases(machine, world, _dispatch, cases, timeout=timeout,
                           setup=functools.partial(_setup, machine.device),
                           env=DETERMINISTIC_ENV if machine.cuda else None)
    section.seconds = outcome.seconds
    names = ("save/resume: bit-exact continuation", "eval: mtds.eval vs HF on the checkpoint")
    if outcome.error:
        for name in names:
            section.fail(name, outcome.error)
        return section
    results = outcome.cases
    if not all(ok for ok, _ in results[:2]):
        bad = next(value for ok, value in results if not ok)
        section.fail(names[0], bad)
    else:
        straight, resumed = results[0][1], results[1][1]
        want = {key: straight[key][k:] for key in ("losses", "grad_norms")}
        from mtds.gpucheck.reference import max_rel_diff
        section.add(names[0], resumed == want,
                    f"steps {k + 1}-{workload.steps}: losses max rel diff {max_rel_diff(resumed['losses'], want['losses']):.1e}, "
                    f"grad norms {max_rel_diff(resumed['grad_norms'], want['grad_norms']):.1e}",
                    "the resumed run differs from the uninterrupted one")
    if len(results) < 3 or not results[2][0]:
        section.fail(names[1], results[2][1] if len(results) >= 3 else "not run: an earlier case failed")
        return section
    value = results[2][1]
    diff = abs(value["mtds"] - value["hf"]) / abs(value["hf"])
    tol = EVAL_TOL[machine.device]
    section.add(names[1], diff <= tol and value["on_device"],
                f"loss {value['mtds']:.6f} vs HF {value['hf']:.6f} (rel {diff:.1e}) over {value['tokens']} tokens",
                "weights not on the device" if not value["on_device"] else f"rel diff {diff:.1e} > {tol:g}")
    return section


def _dispatch(case):
    return _evaluate(case) if case[0] == "eval" else _train(case)
