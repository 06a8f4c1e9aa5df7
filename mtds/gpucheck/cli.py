"""``python -m mtds.gpucheck``: flags -> machine -> checks -> markdown report; exit 0 all passed, 1 a check
failed or timed out, 2 bad input (one ``error:`` line)."""
from __future__ import annotations

import argparse
import datetime
import functools
import sys
import textwrap
import time

CHECKS = ("parity", "p2p", "resume", "speed")

EPILOG = textwrap.dedent("""\
    checks (in this order; each has a wall-clock bound and ends as PASS/FAIL rows, never a hang):
      parity  HF parity matrix: every pipeline schedule (1f1b, interleaved, zb-h1, dualpipev) at p=2
              (and t=2 with 4+ GPUs), then t=2 p=1 with and without --sequence-parallel (CPU: the SP case
              in fp32), in bf16 and fp16 on GPUs (fp32 and bf16 on CPU) against
              HuggingFace GPT2LMHeadModel + torch AdamW in one process: loss and pre-clip grad norm per step
      p2p     interleaved p=2 v=2 with 64 MiB stage boundaries (tiny on CPU): the NCCL crossing-sends case
      resume  save at step k, resume, bit-exact continuation; mtds.eval of the checkpoint vs its HF export
      speed   mtds (1,1,1) vs HF GPT2LMHeadModel + fused AdamW on identical work, then mtds on every GPU:
              tokens/s, model/hardware TFLOP/s, MFU, peak memory allocated and reserved; then (GPUs) the
              micro-batch doubled until the first CUDA OOM: MFU per size, the largest that fits

    examples:
      python -m mtds.gpucheck                      # every visible GPU (up to 8), report in gpucheck.md
      python -m mtds.gpucheck --gpus 2 --quick     # smaller shapes, two GPUs
      python -m mtds.gpucheck --only speed --speed-models gpt2-medium,gpt2-large,gpt2-xl
      python -m mtds.gpucheck --device cpu --quick # the CPU mode the test-suite runs (gloo, 2 ranks)
    """)

# Wall-clock bound per check run (seconds): a hung NCCL exchange or a stuck rank ends as a FAIL row.
BOUNDS = {"cpu": {"parity": 300, "p2p": 120, "resume": 180, "speed": 180},
          "cuda": {"parity": 1200, "p2p": 300, "resume": 600, "speed": 900}}


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one ``error:`` line (exit 2) like every other bad input."""

    def error(self, message):
        self.exit(2, f"error: {message} (python -m mtds.gpucheck --help lists the options)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m mtds.gpucheck", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
                description="Validate mtds on this machine's GPUs (CUDA + NCCL, one rank per GPU): what the CPU "
                            "test-suite cannot reach. Writes a markdown report; exit 0 when every check passed.")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto: CUDA when torch sees a GPU, else CPU [auto]")
    p.add_argument("--gpus", type=int, metavar="N", help="GPUs to use, 1-8 (one rank each) [all visible, up to 8]")
    p.add_argument("--out", default="gpucheck.md", metavar="FILE", help="markdown report [gpucheck.md]")
    p.add_argument("--quick", action="store_true", help="smaller shapes and fewer steps (minutes on GPUs)")
    p.add_argument("--only", metavar="LIST", help=f"comma-separated subset of {','.join(CHECKS)} [all]")
    p.add_argument("--speed-models", metavar="LIST",
                   help="GPUs: the speed check at these GPT-2 shapes, one section each, e.g. "
                        "gpt2-medium,gpt2-large,gpt2-xl (the largest that fits is the checklist's MFU figure) "
                        "[gpt2-medium; --quick: a smaller shape]")
    return p


def parse(argv) -> tuple[argparse.Namespace, list[str]]:
    args = build_parser().parse_args(argv)
    only = [c.strip() for c in args.only.split(",")] if args.only else list(CHECKS)
    unknown = [c for c in only if c not in CHECKS]
    if unknown or not only:
        raise ValueError(f"--only: unknown check {', '.join(unknown) or '(empty)'}; choose from {', '.join(CHECKS)}")
    if args.speed_models is not None:
        from mtds.gpucheck.workloads import speed_workload
        names = [m.strip() for m in args.speed_models.split(",") if m.strip()]
        if not names:
            raise ValueError("--speed-models: give at least one model, e.g. gpt2-medium,gpt2-xl")
        for name in names:
            speed_workload(name)        # unknown names fail here, before any check runs
        args.speed_models = names
    return args, only


def _speed(machine, workload, precision: str, warmup: int, bound: float, title: str):
    """One speed section: HF vs mtds, then (GPUs) the largest micro-batch that fits."""
    from mtds.gpucheck import microbatch, speed
    section = speed.check(machine, workload, precision, warmup, bound, title=title)
    microbatch.check_into(section, machine, workload, precision, warmup, bound)
    return section


def run_checks(machine, checks: list[str], quick: bool, speed_models: list[str] | None = None) -> list:
    """Each check's :class:`~mtds.gpucheck.report.Section`; a check that raises becomes a FAIL row."""
    from mtds.gpucheck import p2p_stress, parity, resume_eval
    from mtds.gpucheck.report import Section
    from mtds.gpucheck.workloads import SPEED_WARMUP, precisions, workloads
    w, bound, precs = workloads(machine.device, quick), BOUNDS[machine.device], precisions(machine.device)
    steps = {
        "parity": lambda: parity.check(machine, w["parity"], precs, bound["parity"]),
        "p2p": lambda: p2p_stress.check(machine, w["p2p"], precs[0] if machine.cuda else "fp32", bound["p2p"]),
        "resume": lambda: resume_eval.check(machine, w["resume"], precs[0], bound["resume"]),
    }
    loads = [("speed", w["speed"])]
    if speed_models and machine.cuda:
        from mtds.gpucheck.workloads import speed_workload
        loads = [(f"speed {model}", speed_workload(model, quick)) for model in speed_models]
    jobs = []
    for name in checks:
        if name != "speed":
            jobs.append((name, steps[name]))
            continue
        for title, load in loads:       # one section per model: a shape that does not fit fails alone
            jobs.append((title, functools.partial(_speed, machine, load, precs[0], SPEED_WARMUP[machine.device],
                                                  bound["speed"], title)))
    sections = []
    for name, job in jobs:
        start = time.monotonic()
        print(f"gpucheck: {name} ...", file=sys.stderr, flush=True)
        try:
            section = job()
        except Exception as err:        # a bug in the check itself still ends as a row, not a traceback
            from mtds.gpucheck.ranks import one_line
            section = Section(name)
            section.fail(name, one_line(err))
        section.seconds = time.monotonic() - start
        status = "FAIL" if section.failed else "PASS"
        print(f"gpucheck: {name} {status} ({section.seconds:.0f} s)", file=sys.stderr, flush=True)
        sections.append(section)
    return sections


def header(machine, quick: bool) -> list[str]:
    from mtds.gpucheck.machine import versions
    v = versions()
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    ranks = f"{machine.ranks} GPU(s), NCCL" if machine.cuda else f"{machine.ranks} CPU ranks, gloo"
    return [f"device: {machine.name} ({ranks})", f"mode: {'quick' if quick else 'full'}, {when}",
            f"torch {v['torch']} (CUDA {v['cuda']}), NCCL {v['nccl']}, DeepSpeed {v['deepspeed']}, "
            f"transformers {v['transformers']}, Python {v['python']}"]


def main(argv: list[str] | None = None) -> int:
    from mtds.gpucheck.machine import resolve
    from mtds.gpucheck.report import render
    try:
        args, checks = parse(argv)
        machine = resolve(args.device, args.gpus)
        if args.speed_models and not machine.cuda:
            raise ValueError("--speed-models applies to GPUs (the CPU mode times its one tiny shape): drop it or "
                             "run with --device cuda")
        with open(args.out, "a"):      # an unwritable --out is bad input, found before an hour of checks
            pass
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    sections = run_checks(machine, checks, args.quick, args.speed_models)
    text = render(header(machine, args.quick), sections)
    with open(args.out, "w") as f:
        f.write(text)
    failed = [s.title for s in sections if s.failed]
    print(f"gpucheck: {'FAIL (' + ', '.join(failed) + ')' if failed else 'PASS'}; report in {args.out}", flush=True)
    return 1 if failed else 0
