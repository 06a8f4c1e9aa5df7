"""train.py as users run it: --help, the README main job under the deepspeed launcher, torchrun with a
pipeline plus save/resume, and bad input -> one line on stderr, exit code 2, no traceback, no hang."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lab.testing import free_port, needs_ranks

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
CPU = "ds_configs/cpu_fp32.json"


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port()), "PYTHONUNBUFFERED": "1"}


def _run(args, timeout=300):
    return subprocess.run(args, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)


def _torchrun(n, *args, timeout=300):
    return _run([str(BIN / "torchrun"), "--nproc_per_node", str(n), "--master_port", str(free_port()),
                 "train.py", *args], timeout=timeout)


def _single(*args):
    return _run([sys.executable, "train.py", *args])


def test_help_explains_the_options():
    out = _single("--help")
    assert out.returncode == 0
    for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--deepspeed_config", "--model",
                 "--recompute", "--recompute-interval", "--save", "--load", "--log-jsonl", "--tensorboard", "derived"):
        assert flag in out.stdout, flag


def test_readme_main_job_runs_under_the_deepspeed_launcher(tmp_path):
    """The README's first command (minus set-up and with fewer steps)."""
    needs_ranks(2)      # a launcher starts 2 ranks: under MTDS_TEST_DEVICE=cuda, one GPU each
    makefile = (ROOT / "Makefile").read_text()
    assert "--deepspeed_config ds_configs/cpu_fp32.json --model gpt2-tiny --tp 2 --pp 1" in makefile
    log = tmp_path / "log.jsonl"
    out = _run([str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), "train.py",
                "--deepspeed_config", CPU, "--model", "gpt2-tiny", "--tp", "2", "--pp", "1", "--steps", "3",
                "--log-jsonl", str(log), "--tensorboard", str(tmp_path / "tb"),
                "--plot", str(tmp_path / "curves.png")], timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    for key in ("loss", "lr", "grad_norm", "loss_scale", "skipped", "tokens_per_s", "tflops_model", "tflops_hw",
                "mfu", "peak_mem_gib"):
        assert key in train[0], key
    assert train[-1]["loss"] < train[0]["loss"]
    assert any(r["kind"] == "eval" for r in records)
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert "step 3/3 | loss" in out.stdout
    assert "cpu: glibc malloc: blocks up to 256 MiB from the heap" in out.stdout   # mtds.training.cpu_allocator, on by default
    # the ranks' own output: mtds's lines, not DeepSpeed's accelerator warning (mtds.observe.quiet)
    ranks = out.stdout.split("spawned with command", 2)[2]
    assert "Setting accelerator to CPU" not in ranks and "Warning" not in out.stderr, out.stdout[-3000:]


def _train(argv):
    """train.py's run of these flags, on a pooled rank."""
    from mtds.training import run
    from mtds.training.cli import build_parser, config_from_args
    run(config_from_args(build_parser().parse_args(argv)))


def test_torchrun_pipeline_saves_and_resumes(tmp_path):
    needs_ranks(2)      # a launcher starts 2 ranks: under MTDS_TEST_DEVICE=cuda, one GPU each
    common = ["--deepspeed_config", CPU, "--tp", "1", "--pp", "2", "--seq-length", "64", "--eval-split", "0",
              "--save", str(tmp_path / "ckpt"), "--log-jsonl", str(tmp_path / "log.jsonl")]
    first = _torchrun(2, *common, "--steps", "2", timeout=400)
    assert first.returncode == 0, first.stderr[-3000:]
    # DeepSpeed's pipeline-module prints and per-rank warnings stay hidden (mtds.observe.quiet)
    for noise in ("SEED_LAYERS=", "Using topology:", "Setting accelerator to CPU"):
        assert noise not in first.stdout + first.stderr, first.stdout[-3000:]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "global_step2"
    # The resume: the same train.py flags on warm pooled ranks (torchrun's own restart with --load is
    # tests/test_recovery.py's, its losses equal to an uninterrupted run's; a second launch here added only
    # its start-up)
    from lab.testing import spawn
    flags = [str(ROOT / a) if a == CPU else a for a in common]
    spawn(_train, 2, [*flags, "--steps", "4", "--load", str(tmp_path / "ckpt")], timeout=400)
    steps = [json.loads(line)["step"] for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def _assert_one_line_error(out, expected, launcher=None):
    """One ``error:`` line from all the ranks together. Our ranks exit 2; torchrun reports any failed child as its
    own exit 1 plus a report of its own, whose root cause is our line (the error file mtds writes for it); the
    deepspeed launcher exits with the child's code."""
    assert out.returncode == (1 if launcher == "torchrun" else 2), (out.returncode, out.stderr[-3000:])
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expected in errors[0], out.stderr[-3000:]
    if launcher != "torchrun":
        assert "Traceback" not in out.stdout + out.stderr
    else:
        assert "exitcode  : 2" in out.stderr, out.stderr[-2000:]
        root_cause = out.stderr.split("Root Cause (first observed failure):", 1)[1]
        assert f"traceback : {errors[0]}" in root_cause, out.stderr[-2000:]


# One case per exit path end to end (the table itself runs in-process: tests/test_bad_input.py): a
# value the run rejects (run_and_exit: one line, exit 2) and a flag the parser rejects (argparse, exit 2).
@pytest.mark.parametrize("args, expected", [
    (["--deepspeed_config", CPU, "--tp", "3"], "world size 1 is not divisible by tp*pp = 3*1 = 3"),
    (["--deepspeed_config", CPU, "--tp", "two"], "invalid int value: 'two'"),
])
def test_bad_input_single_process(args, expected):
    _assert_one_line_error(_single(*args), expected)


def test_fp16_refused_where_unsupported():
    from deepspeed.accelerator import get_accelerator
    if get_accelerator().is_fp16_supported():
        pytest.skip("this device supports fp16: nothing to refuse")
    _assert_one_line_error(_single("--deepspeed_config", "ds_configs/ptdp_fp16.json"), "fp16 is not supported")


def test_a_refused_job_on_two_ranks_is_one_line(tmp_path):
    """The launcher's exit path for a job the rulebook refuses (the combination, not the command line alone): a
    Qwen3-MoE at (t, p, d) = (1, 1, 2) with EP 2 and the ZeRO-3 config. Every rank decides it before the heartbeat
    and the groups exist; rank 0 says it, the other waits for its word and exits 2 without a line of its own (no
    "rank 0 is dead" from a heartbeat); torchrun makes exit 1 of it with its summary."""
    import transformers
    needs_ranks(2)      # a launcher starts 2 ranks: under MTDS_TEST_DEVICE=cuda, one GPU each
    transformers.Qwen3MoeConfig(vocab_size=8192, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                                num_experts_per_tok=2, max_position_embeddings=256).save_pretrained(tmp_path)
    out = _torchrun(2, "--deepspeed_config", "ds_configs/cpu_zero3_fp32.json", "--model", str(tmp_path),
                    "--expert-model-parallel-size", "2")
    _assert_one_line_error(out, "--expert-model-parallel-size 2 with ZeRO-3 is not built", launcher="torchrun")
    assert "rank 0 is dead" not in out.stderr and "rendezvous" not in out.stderr, out.stderr[-3000:]


def test_a_command_line_error_on_two_ranks_is_one_line():
    """An error of the command line alone, before any process group exists: every rank printed its own copy."""
    needs_ranks(2)
    _assert_one_line_error(_torchrun(2, "--deepspeed_config", CPU, "--bf16", "--fp16"),
                           "--bf16 and --fp16 both given", launcher="torchrun")


def test_the_first_rank_says_it_and_torchruns_report_names_it(tmp_path, monkeypatch, capsys):
    """In-process, as torchrun sets the environment: rank 0 prints the line and writes it where torchrun's report
    (read back with torch's own classes) takes its root cause from; another rank, before any process group, waits
    for the launcher to end it once rank 0 has exited, and says it itself only if still running after that."""
    import time

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from mtds.training import distributed
    error_file = tmp_path / "error.json"
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("TORCHELASTIC_ERROR_FILE", str(error_file))):
        monkeypatch.setenv(key, value)
    distributed.report_error("--bf16 and --fp16 both given: choose one precision")
    assert capsys.readouterr().err == "error: --bf16 and --fp16 both given: choose one precision\n"
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(error_file))
    report = ChildFailedError("train.py", {0: failure}).format_msg()
    assert "traceback : error: --bf16 and --fp16 both given: choose one precision" in report, report
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE")
    monkeypatch.setattr(distributed, "ERROR_GRACE_S", 0.2)
    start = time.monotonic()
    distributed.report_error("--bf16 and --fp16 both given: choose one precision")
    assert time.monotonic() - start >= 0.2
    assert capsys.readouterr().err == "error: --bf16 and --fp16 both given: choose one precision\n"
