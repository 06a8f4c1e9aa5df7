"""Bad input, table-driven (the table is docs/bad_input.md): each case must give exactly one line that
starts with ``error:``, says what is wrong and what to do, and exit code 2 -- never a traceback (unless
--debug), never a hang. Cases run in-process: flags through train.py's parser; everything else through
``config_from_args`` + ``run`` on one spawned rank (several cases per process), classified exactly as
train.py's console entry (``run_and_exit``) does. Cases that only arise distributed run on 2 ranks
(spawn returns only when every rank has left: none is left running). Other cases live in test_cli.py
(subprocess, launcher), test_data_errors.py, test_convert.py and test_reliability.py."""
import contextlib
import io
import json
import os

import pytest

from lab.testing import spawn

CPU = "ds_configs/cpu_fp32.json"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ds(tmp, name, config):
    path = os.path.join(tmp, name)
    with open(path, "w") as f:
        json.dump(config, f) if not isinstance(config, str) else f.write(config)
    return path


def _base_ds(**extra):
    return {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, **extra}


def make_inputs(tmp: str) -> dict:
    """Every broken file a case needs, under ``tmp``."""
    p = {}
    p["gas"] = _ds(tmp, "gas.json", _base_ds(gradient_accumulation_steps=3))
    p["div"] = _ds(tmp, "div.json", {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4})
    p["both"] = _ds(tmp, "both.json", _base_ds(fp16={"enabled": True}, bf16={"enabled": True}))
    p["optim"] = _ds(tmp, "optim.json", _base_ds(optimizer={"type": "Adamm", "params": {"lr": 1e-3}}))
    p["neglr"] = _ds(tmp, "neglr.json", _base_ds(optimizer={"type": "AdamW", "params": {"lr": -1e-3}}))
    p["stage"] = _ds(tmp, "stage.json", _base_ds(zero_optimization={"stage": 4}))
    p["nomicro"] = _ds(tmp, "nomicro.json", {"train_batch_size": 16})
    p["zero2"] = _ds(tmp, "zero2.json", _base_ds(zero_optimization={"stage": 2}))
    p["zero3"] = _ds(tmp, "zero3.json", _base_ds(zero_optimization={"stage": 3}))
    p["notjson"] = _ds(tmp, "notjson.json", "{ not json")
    cpu = json.load(open(os.path.join(ROOT, CPU)))
    p["zerotypo"] = _ds(tmp, "zerotypo.json", {**{k: v for k, v in cpu.items() if k != "zero_optimization"},
                                               "zero_optimisation": cpu["zero_optimization"]})
    p["nestedtypo"] = _ds(tmp, "nestedtypo.json", {**cpu, "zero_optimization": {
        **cpu["zero_optimization"], "stage3_prefetch_bucket_sise": 1000}})
    p["bf16typo"] = _ds(tmp, "bf16typo.json", {**cpu, "bf16": {"enabeld": True}})
    p["bf16false"] = _ds(tmp, "bf16false.json", {**cpu, "bf16": {"enabled": "false"}})
    p["stageauto"] = _ds(tmp, "stageauto.json", {**cpu, "zero_optimization": {"stage": "auto"}})
    p["batchauto"] = _ds(tmp, "batchauto.json", {**cpu, "train_batch_size": "auto"})
    p["bert"] = _ds(tmp, "bert.json", {"model_type": "bert", "hidden_size": 64})
    p["notype"] = _ds(tmp, "notype.json", {"n_embd": 64, "n_layer": 2})
    p["badcfg"] = _ds(tmp, "badcfg.json", "{ nope")
    p["smallvocab"] = _ds(tmp, "smallvocab.json", {"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2,
                                                   "vocab_size": 1000, "n_positions": 128})
    p["heads3"] = _ds(tmp, "heads3.json", {"model_type": "gpt2", "n_embd": 96, "n_head": 3, "n_layer": 2,
                                           "vocab_size": 8192, "n_positions": 128})
    p["kv"] = _ds(tmp, "kv.json", {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                   "num_attention_heads": 4, "num_key_value_heads": 1, "num_hidden_layers": 2,
                                   "vocab_size": 8192, "max_position_embeddings": 128})
    p["layers1"] = _ds(tmp, "layers1.json", {"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 1,
                                             "vocab_size": 8192, "n_positions": 128})
    p["empty"] = _ds(tmp, "empty.txt", "")
    p["blank"] = _ds(tmp, "blank.jsonl", '{"text": ""}\n{"text": ""}\n')
    p["column"] = _ds(tmp, "column.jsonl", '{"body": "some text here"}\n')
    with open(os.path.join(tmp, "garbage.jsonl"), "wb") as f:
        f.write(bytes(range(256)) * 64)
    p["garbage"] = os.path.join(tmp, "garbage.jsonl")
    p["few"] = _ds(tmp, "few.txt", "To be, or not to be, that is the question.\n" * 20)
    _indexed_inputs(tmp, p)
    os.makedirs(os.path.join(tmp, "notok"), exist_ok=True)
    p["notok"] = os.path.join(tmp, "notok")
    os.makedirs(os.path.join(tmp, "noweights"), exist_ok=True)
    _ds(os.path.join(tmp, "noweights"), "config.json", json.load(open(p["layers1"])))
    p["noweights"] = os.path.join(tmp, "noweights")
    os.makedirs(os.path.join(tmp, "notackpt", "sub"), exist_ok=True)
    p["notackpt"] = os.path.join(tmp, "notackpt")
    for name, marker, files in (("oldckpt", None, None), ("newckpt", {"step": 5, "world_size": 1, "format": 99}, None),
                                ("norank", {"step": 5, "world_size": 2, "format": 2}, None),
                                ("truncckpt", {"step": 5, "world_size": 1, "format": 2}, {"x.pt": (100, 0)})):
        tag = os.path.join(tmp, name, "global_step5")
        os.makedirs(tag, exist_ok=True)
        _ds(tag, "mtds_meta.json", {"model": {}, "tp": 1, "pp": 1, "dp": 1})
        if marker:
            _ds(tag, "mtds_complete.json", marker)
        if files:
            import torch
            torch.save({"rank": 0, "files": files, "rng": None}, os.path.join(tag, "mtds_rank_00000.pt"))
            with open(os.path.join(tag, "x.pt"), "wb") as f:
                f.write(b"0123456789")
        p[name] = os.path.join(tmp, name)
    return p


def _indexed_inputs(tmp: str, p: dict) -> None:
    """Megatron indexed datasets: a good one and broken copies of it."""
    import numpy as np

    from mtds.data.indexed import IndexedWriter
    for name, dtype, ids in (("idx", np.uint16, np.arange(2000) % 8000), ("idxbig", np.int32, [5, 9000, 7] * 100),
                             ("idxtiny", np.uint16, [1, 2, 3])):
        p[name] = os.path.join(tmp, name)
        with IndexedWriter(p[name], dtype) as w:
            w.add_document(ids)
    for name, cut in (("idxmagic", None), ("idxshort", 1000)):
        p[name] = os.path.join(tmp, name)
        data = open(p["idx"] + ".bin", "rb").read()
        index = open(p["idx"] + ".idx", "rb").read()
        with open(p[name] + ".bin", "wb") as f:
            f.write(data[:cut] if cut else data)
        with open(p[name] + ".idx", "wb") as f:
            f.write(index if cut else b"NOTMEGA\0\0" + index[9:])


# (id, argv with {name} placeholders for make_inputs' paths, text the error line must contain)
RUN_CASES = [
    # DeepSpeed JSON
    ("ds-missing-file", ["--deepspeed_config", "/no/such.json"], "not found"),
    ("ds-gas-mismatch", ["--deepspeed_config", "{gas}"], "!= micro batch 4 x gradient_accumulation_steps 3"),
    ("ds-batch-not-divisible", ["--deepspeed_config", "{div}"], "not divisible by micro batch 4"),
    ("ds-fp16-and-bf16", ["--deepspeed_config", "{both}"], "both fp16 and bf16"),
    ("ds-unknown-optimizer", ["--deepspeed_config", "{optim}"], "unknown optimizer type 'Adamm'"),
    ("ds-negative-lr", ["--deepspeed_config", "{neglr}"], "learning rate must be a positive number"),
    ("ds-zero-stage-4", ["--deepspeed_config", "{stage}"], "zero_optimization.stage must be 0-3"),
    ("ds-no-micro-batch", ["--deepspeed_config", "{nomicro}"], "needs train_micro_batch_size_per_gpu"),
    ("ds-not-json", ["--deepspeed_config", "{notjson}"], "is not valid JSON"),
    ("ds-unknown-top-level-key", ["--deepspeed_config", "{zerotypo}"],
     "zerotypo.json (at the top level): did you mean `zero_optimization`? (DeepSpeed {ds} would ignore it silently)"),
    ("ds-unknown-nested-key", ["--deepspeed_config", "{nestedtypo}"],
     "unknown key `zero_optimization.stage3_prefetch_bucket_sise` in the DeepSpeed config"),
    ("ds-unknown-bf16-key", ["--deepspeed_config", "{bf16typo}"], "unknown key `bf16.enabeld`"),
    # the rulebook's (mtds.rules), asked when the run starts
    ("pipeline-layout-without-pipeline", ["--deepspeed_config", CPU, "--pipeline-layout", "Et*4L"],
     "--pipeline-layout needs a pipeline"),
    ("compile-with-zb-h1", ["--deepspeed_config", CPU, "--compile", "--pp", "2", "--pipeline-schedule", "zb-h1"],
     "--compile cannot compile the layers of --pipeline-schedule zb-h1"),
    ("ds-string-for-boolean", ["--deepspeed_config", "{bf16false}"],
     'is the string "false", which DeepSpeed {ds} reads as false: write false, without quotes'),
    ("ds-auto-value", ["--deepspeed_config", "{stageauto}"],
     'is "auto", a placeholder HF\'s Trainer fills in before DeepSpeed sees the config'),
    ("ds-batch-auto", ["--deepspeed_config", "{batchauto}"],
     'train_batch_size in the DeepSpeed config must be a positive whole number, got "auto"'),
    ("flag-dropout-above-1", ["--deepspeed_config", CPU, "--dropout", "1.5"], "must be in [0, 1)"),
    # layouts (world 1 here; t must divide the heads etc. is checked on 2 ranks below)
    ("layout-tp-pp-world", ["--deepspeed_config", CPU, "--tp", "2", "--pp", "2"], "not divisible by tp*pp"),
    ("layout-sp-without-tp", ["--deepspeed_config", CPU, "--sequence-parallel"], "needs tensor parallelism"),
    # model configs
    ("model-unknown-preset", ["--deepspeed_config", CPU, "--model", "gpt9"], "unknown model 'gpt9'"),
    ("moe-z-loss-on-dense-model", ["--deepspeed_config", CPU, "--moe-z-loss-coeff", "0.001"],
     "--moe-z-loss-coeff needs a mixture-of-experts model"),
    ("model-unknown-hf-architecture", ["--deepspeed_config", CPU, "--model", "{bert}"], "'bert' is not supported"),
    ("model-config-without-model-type", ["--deepspeed_config", CPU, "--model", "{notype}"], "model_type"),
    ("model-config-not-json", ["--deepspeed_config", CPU, "--model", "{badcfg}"], "badcfg.json' is not valid JSON"),
    ("model-vocab-below-tokenizer", ["--deepspeed_config", CPU, "--model", "{smallvocab}"], "at least 8192"),
    ("model-seq-above-positions", ["--deepspeed_config", CPU, "--seq-length", "4096"], "max_position_embeddings"),
    # data
    ("data-missing", ["--deepspeed_config", CPU, "--data", "/no/such/corpus.txt"], "does not exist"),
    ("data-empty-file", ["--deepspeed_config", CPU, "--data", "{empty}"], "empty"),
    ("data-empty-column", ["--deepspeed_config", CPU, "--data", "{blank}"], "empty"),
    ("data-wrong-column", ["--deepspeed_config", CPU, "--data", "{column}"], "'text'"),
    ("data-binary-garbage", ["--deepspeed_config", CPU, "--data", "{garbage}"], "garbage.jsonl"),
    ("data-too-few-for-a-batch", ["--deepspeed_config", CPU, "--data", "{few}", "--eval-split", "0"],
     "global batch"),
    ("data-path-missing-prefix", ["--deepspeed_config", CPU, "--data-path", "/no/such/prefix"], "does not exist"),
    ("data-path-odd-blend", ["--deepspeed_config", CPU, "--data-path", "0.3", "{idx}", "0.7"], "weight prefix pairs"),
    ("data-path-negative-weight", ["--deepspeed_config", CPU, "--data-path", "-0.3", "{idx}", "1", "{idx}"],
     "must be a positive number"),
    ("data-path-and-data", ["--deepspeed_config", CPU, "--data-path", "{idx}", "--data", "{few}"], "keep one"),
    ("data-path-not-megatron", ["--deepspeed_config", CPU, "--data-path", "{idxmagic}"], "is not a Megatron index"),
    ("data-path-bin-truncated", ["--deepspeed_config", CPU, "--data-path", "{idxshort}"], "shorter than its index says"),
    ("data-path-token-above-vocab", ["--deepspeed_config", CPU, "--data-path", "{idxbig}"],
     "holds token id 9000, outside the model's vocabulary of 8192"),
    ("data-path-too-small", ["--deepspeed_config", CPU, "--data-path", "{idxtiny}", "--eval-split", "0"],
     "fewer than one sample"),
    # tokenizers
    ("tokenizer-missing-dir", ["--deepspeed_config", CPU, "--tokenizer", "/no/such/tokenizer"], "tokenizer"),
    ("tokenizer-dir-without-files", ["--deepspeed_config", CPU, "--tokenizer", "{notok}"], "tokenizer"),
    # checkpoints (complete/corrupt/unsafe ones: test_reliability.py)
    # (a missing or empty --load directory starts from scratch: tests/test_first_hour.py)
    ("ckpt-missing-tag-folder", ["--deepspeed_config", CPU, "--load", "/no/such/ckpt/global_step5"],
     "checkpoint '/no/such/ckpt/global_step5' does not exist"),
    ("ckpt-load-is-a-file", ["--deepspeed_config", CPU, "--load", "{few}"], "is a file, not a checkpoint directory"),
    ("ckpt-not-a-checkpoint", ["--deepspeed_config", CPU, "--load", "{notackpt}"],
     "is not an mtds checkpoint: it holds 1 entry (sub) but no global_stepN/ folder, so it is probably not the "
     "directory given to --save"),
    ("ckpt-other-mtds-version", ["--deepspeed_config", CPU, "--load", "{oldckpt}"], "saved by an older mtds"),
    ("ckpt-newer-format", ["--deepspeed_config", CPU, "--load", "{newckpt}"], "checkpoint format 99"),
    ("ckpt-missing-rank-file", ["--deepspeed_config", CPU, "--load", "{norank}"], "missing rank file mtds_rank_00000"),
    ("ckpt-truncated-file", ["--deepspeed_config", CPU, "--load", "{truncckpt}"], "x.pt has 10 bytes, rank 0 wrote 100"),
    # HF weights
    ("hf-init-missing-dir", ["--deepspeed_config", CPU, "--init-from-hf", "/no/such/hf"], "/no/such/hf"),
    ("hf-init-without-weights", ["--deepspeed_config", CPU, "--init-from-hf", "{noweights}"], "weights"),
]

# Values the parser accepts but the run cannot: TrainConfig refuses them (one place, before any process
# group), so these run in the test process itself.
SETTING_CASES = [
    ("flag-steps-negative", ["--steps", "-1"], "--steps must be >= 0, got -1"),
    ("flag-seq-length-zero", ["--seq-length", "0"], "--seq-length must be >= 1, got 0"),
    ("flag-keep-last-negative", ["--keep-last", "-2"], "--keep-last must be >= 0 (0 keeps every checkpoint), got -2"),
    ("flag-tp-zero", ["--tp", "0"], "--tp must be >= 1, got 0"),
    ("flag-pp-negative", ["--pp", "-1"], "--pp must be >= 1, got -1"),
    ("flag-virtual-stages-zero", ["--virtual-stages", "0"], "--virtual-stages must be >= 1, got 0"),
    ("flag-num-proc-zero", ["--num-proc", "0"], "--num-proc must be >= 1, got 0"),
    ("flag-eval-interval-negative", ["--eval-interval", "-5"], "--eval-interval must be >= 0 (0: evaluate at the end"),
    ("flag-eval-iters-zero", ["--eval-iters", "0"], "--eval-iters must be >= 1, got 0"),
    ("data-eval-split-out-of-range", ["--eval-split", "1.5"], "--eval-split must be in [0, 1)"),
    ("flag-negative-lr", ["--lr", "-0.1"], "--lr must be > 0, got -0.1"),
    ("flag-lr-not-a-number", ["--lr", "nan"], "--lr must be > 0, got nan"),
    ("flag-min-lr-negative", ["--min-lr", "-0.5"], "--min-lr must be >= 0, got -0.5"),
    ("flag-warmup-negative", ["--warmup-steps", "-10"], "--warmup-steps must be >= 0, got -10"),
    ("flag-seed-negative", ["--seed", "-1"], "--seed must be >= 0, got -1"),
    ("tokenizer-type-unsupported", ["--tokenizer-type", "SentencePieceTokenizer"],
     "--tokenizer-type SentencePieceTokenizer is not supported: only GPT2BPETokenizer"),
    ("tokenizer-type-without-vocab", ["--tokenizer-type", "GPT2BPETokenizer", "--merge-file", "m.txt"],
     "--tokenizer-type GPT2BPETokenizer needs --vocab-file"),
    ("flag-save-interval-negative", ["--save-interval", "-1"], "--save-interval must be >= 0 (0: save at the end only)"),
    ("flag-check-replicas-negative", ["--check-replicas", "-3"], "--check-replicas must be >= 0 (0: off), got -3"),
    ("flag-dist-timeout-zero", ["--dist-timeout", "0"], "--dist-timeout must be > 0 seconds, got 0.0"),
    ("flag-dist-timeout-infinite", ["--dist-timeout", "inf"], "--dist-timeout must be > 0 seconds, got inf"),
    ("flag-build-lock-timeout-negative", ["--build-lock-timeout", "-5"], "--build-lock-timeout must be > 0 seconds"),
    ("flag-heartbeat-timeout-negative", ["--heartbeat-timeout", "-1"], "--heartbeat-timeout must be >= 0 seconds (0: off)"),
    ("flag-recompute-interval-zero", ["--recompute", "full", "--recompute-interval", "0"],
     "--recompute-interval must be >= 1, got 0"),
    ("flag-recompute-interval-without-full", ["--recompute-interval", "2"],
     "--recompute-interval 2 applies to --recompute full only (got --recompute none)"),
    ("flag-recompute-negative", ["--activation-checkpointing", "-1"], "--activation-checkpointing takes a block interval >= 0"),
    ("pipeline-layout-and-balance", ["--pp", "2", "--pipeline-layout", "Et*2|t*2L", "--pipeline-balance", "cost"],
     "give one of the two"),
    ("flag-recompute-conflict", ["--recompute", "selective", "--activation-checkpointing", "2"],
     "--activation-checkpointing 2 means --recompute full (every 2 blocks) and conflicts with --recompute selective"),
    ("flag-moe-z-loss-negative", ["--moe-z-loss-coeff", "-0.1"], "--moe-z-loss-coeff must be >= 0, got -0.1"),
    ("flag-moe-capacity-factor-zero", ["--moe-expert-capacity-factor", "0"],
     "--moe-expert-capacity-factor must be > 0, got 0.0"),
    ("flag-moe-drop-policy-without-capacity", ["--moe-token-drop-policy", "position"],
     "--moe-token-drop-policy applies with --moe-expert-capacity-factor F only"),
]

# Only distributed: world 2.
DIST_CASES = [
    ("layout-tp-not-dividing-heads", ["--deepspeed_config", CPU, "--tp", "2", "--model", "{heads3}"],
     "does not divide the 3 attention heads"),
    ("layout-tp-not-dividing-kv-heads", ["--deepspeed_config", CPU, "--tp", "2", "--model", "{kv}"],
     "does not divide the 1 key/value heads"),
    ("layout-pp-above-layers", ["--deepspeed_config", CPU, "--pp", "2", "--model", "{layers1}"],
     "cannot fill"),
    ("layout-sp-tp-not-dividing-seq", ["--deepspeed_config", CPU, "--tp", "2", "--sequence-parallel",
                                       "--seq-length", "33"], "divisible by --tp 2"),
    ("ds-zero2-bf16-with-pipeline", ["--deepspeed_config", "{zero2}", "--pp", "2", "--bf16"],
     "ZeRO-2 with --pp 2 in bf16 accumulates its gradients in fp32"),
    ("ds-zero3-fp16-with-pipeline", ["--deepspeed_config", "{zero3}", "--pp", "2", "--fp16"],
     "ZeRO-3 with --pp 2 is built for fp32 and bf16 (fp16's loss scaling is not)"),
    ("pipeline-layout-stage-count", ["--deepspeed_config", CPU, "--pp", "2", "--pipeline-layout", "Et*2|t|tL"],
     "has 3 stages ('|' + 1) but the run has p x v = 2 virtual stages"),
    ("pipeline-layout-block-count", ["--deepspeed_config", CPU, "--pp", "2", "--pipeline-layout", "Et*3|t*2L"],
     "holds 5 transformer blocks but the model has 4"),
    ("pipeline-layout-loss-not-last", ["--deepspeed_config", CPU, "--pp", "2", "--pipeline-layout", "Et*2|Lt*2"],
     "needs exactly one L, last in the last stage"),
    ("global-batch-size-zero", ["--deepspeed_config", CPU, "--global-batch-size", "0"],
     "--global-batch-size must be a positive number of sequences, got 0"),
    ("global-batch-not-a-multiple", ["--deepspeed_config", CPU, "--global-batch-size", "10", "--micro-batch-size", "4"],
     "train_batch_size 10 is not divisible by micro batch 4 x data parallel size"),
]

PARSER_CASES = [
    ("flag-missing-deepspeed-config", [], "--deepspeed_config"),
    ("flag-not-an-int", ["--deepspeed_config", CPU, "--tp", "two"], "invalid int value: 'two'"),
    ("flag-unknown-choice", ["--deepspeed_config", CPU, "--on-nan", "ignore"], "invalid choice: 'ignore'"),
    ("flag-unknown", ["--deepspeed_config", CPU, "--tensor-parallel", "2"], "unrecognized arguments"),
    ("flag-recompute-method-block", ["--deepspeed_config", CPU, "--recompute-method", "block"],
     "invalid choice: 'block'"),
    ("flag-pipeline-balance-unknown", ["--deepspeed_config", CPU, "--pipeline-balance", "params"],
     "invalid choice: 'params'"),
    ("flag-moe-drop-policy-unknown", ["--deepspeed_config", CPU, "--moe-token-drop-policy", "random"],
     "invalid choice: 'random'"),
    ("flag-cross-entropy-fusion-impl-te", ["--deepspeed_config", CPU, "--cross-entropy-fusion-impl", "te"],
     "invalid choice: 'te'"),
]


def _outcomes(cases, paths):
    """What train.py's main would print for each case: ("error", line) / ("bug", traceback) / ("ran", "")."""
    import traceback

    import torch.distributed as dist

    from mtds.training.cli import build_parser, config_from_args, user_errors
    out = []
    for _, argv, _ in cases:
        argv = ["--steps", "0", "--no-progress"] + [a.format(**paths) for a in argv]
        try:
            from mtds.training import run
            run(config_from_args(build_parser().parse_args(argv)))
            out.append(("ran", ""))
        except user_errors() as err:
            out.append(("error", str(err)))
        except Exception:
            out.append(("bug", traceback.format_exc()))
        if dist.is_initialized():
            dist.barrier()
    return out


def _check(case, outcome):
    import deepspeed
    name, _, expected = case
    expected = expected.replace("{ds}", deepspeed.__version__)
    kind, text = outcome
    assert kind == "error", f"{name}: {kind}\n{text}"
    assert "\n" not in text.strip(), f"{name}: more than one line: {text!r}"
    assert expected in text, f"{name}: {text!r} lacks {expected!r}"


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return make_inputs(str(tmp_path_factory.mktemp("bad")))


@pytest.fixture(scope="module")
def single_rank(paths):
    return spawn(_outcomes, 1, RUN_CASES, paths, timeout=300)[0]


@pytest.mark.parametrize("index", range(len(RUN_CASES)), ids=[c[0] for c in RUN_CASES])
def test_bad_input(single_rank, index):
    _check(RUN_CASES[index], single_rank[index])


def test_bad_input_on_two_ranks(paths):
    per_rank = spawn(_outcomes, 2, DIST_CASES, paths, timeout=300)   # returns only when both ranks are done
    for case, outcome in zip(DIST_CASES, per_rank[0]):
        _check(case, outcome)
    assert [k for k, _ in per_rank[1]] == ["error"] * len(DIST_CASES)


@pytest.mark.parametrize("name, argv, expected", PARSER_CASES, ids=[c[0] for c in PARSER_CASES])
def test_bad_flags(name, argv, expected):
    from mtds.training.cli import build_parser
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    lines = err.getvalue().strip().splitlines()
    assert exit_.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], lines


@pytest.mark.parametrize("name, argv, expected", SETTING_CASES, ids=[c[0] for c in SETTING_CASES])
def test_bad_settings(name, argv, expected):
    from mtds.training.cli import build_parser, config_from_args, user_errors
    with contextlib.redirect_stderr(io.StringIO()), pytest.raises(user_errors()) as err:
        config_from_args(build_parser().parse_args(["--deepspeed_config", CPU, *argv]))
    message = str(err.value)
    assert "\n" not in message and expected in message, message


def test_cases_are_many_and_documented():
    doc = open(os.path.join(ROOT, "docs", "bad_input.md")).read()
    names = [c[0] for c in RUN_CASES + SETTING_CASES + DIST_CASES + PARSER_CASES]
    assert len(names) >= 40 and len(set(names)) == len(names)
    missing = [n for n in names if f"`{n}`" not in doc]
    assert not missing, missing


def test_debug_adds_the_traceback_and_keeps_the_line():
    import subprocess
    import sys
    for extra, traceback in (([], False), (["--debug"], True)):
        out = subprocess.run([sys.executable, "train.py", "--deepspeed_config", "/no/such.json", *extra], cwd=ROOT,
                             capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
        errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
        assert out.returncode == 2 and len(errors) == 1 and "not found" in errors[0], out.stderr[-2000:]
        assert ("Traceback" in out.stderr) == traceback, out.stderr[-2000:]
