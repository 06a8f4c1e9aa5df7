"""A Megatron-LM user's first hour: a typo in the DeepSpeed JSON is one line before anything starts (not a
run at ZeRO-0, not a pydantic traceback after the data and model), and ``--save D --load D`` is the same
command for the first launch and every restart.

The DeepSpeed-JSON cases run in the test process (no process group); the ``--load`` ones on one spawned
rank, through ``run`` up to the build phase (replaced by a probe: nothing is set up), then one real tiny
run launched twice with the same ``--save D --load D``. The one-line cases are also rows of
``tests/test_bad_input.py`` (docs/bad_input.md)."""
from __future__ import annotations

import glob
import inspect
import json
import os

import pytest

from lab.testing import spawn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = sorted(glob.glob(os.path.join(ROOT, "ds_configs", "*.json")))


def _shipped(name: str) -> dict:
    with open(os.path.join(ROOT, "ds_configs", name)) as f:
        return json.load(f)


def _refusal(config: dict, tmp_path) -> str:
    """The one line load_ds_config gives for ``config`` written as a JSON file."""
    from mtds.training.ds_config import ConfigError, load_ds_config
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ConfigError) as caught:
        load_ds_config(str(path))
    text = str(caught.value)
    assert "\n" not in text, text
    return text.replace(str(path), "ds.json")


@pytest.mark.parametrize("path", SHIPPED, ids=os.path.basename)
def test_every_shipped_config_passes_the_key_check(path):
    from mtds.deepspeed_compat.config_schema import find_problems
    from mtds.training.ds_config import load_ds_config
    assert find_problems(load_ds_config(path)) == []


def test_the_configs_mtds_builds_pass_the_key_check():
    from mtds.deepspeed_compat.config_schema import find_problems
    from mtds.gpucheck.ds_configs import ds_config as gpucheck_config
    from tests.training_helpers import ds_config
    configs = [ds_config(zero=z, precision=p, optimizer=o) for z in (0, 1, 2, 3) for p in ("fp32", "bf16", "fp16")
               for o in ("adamw", "sgd")]
    configs += [gpucheck_config(p, global_batch=8, micro_batch=2, device="cpu") for p in ("fp32", "bf16")]
    for config in configs:
        assert find_problems(config) == [], config


def test_a_misspelt_top_level_key_is_refused(tmp_path):
    config = _shipped("cpu_fp32.json")
    config["zero_optimisation"] = config.pop("zero_optimization")      # trained at ZeRO-0, silently
    assert _refusal(config, tmp_path) == (
        "unknown key `zero_optimisation` in the DeepSpeed config ds.json (at the top level): did you mean "
        "`zero_optimization`? (DeepSpeed 0.19.8 would ignore it silently)".replace("0.19.8", _ds_version()))
    config = _shipped("cpu_fp32.json")
    config["gradient_cliping"] = config.pop("gradient_clipping")       # trained without clipping, silently
    assert "unknown key `gradient_cliping`" in _refusal(config, tmp_path)
    assert "did you mean `gradient_clipping`?" in _refusal(config, tmp_path)


@pytest.mark.parametrize("section, key, nearest", [
    ("zero_optimization", "stage3_prefetch_bucket_sise", "stage3_prefetch_bucket_size"),
    ("bf16", "enabeld", "enabled"),
])
def test_a_misspelt_nested_key_is_refused(tmp_path, section, key, nearest):
    config = _shipped("cpu_bf16.json")
    config[section][key] = 1
    text = _refusal(config, tmp_path)
    assert text.startswith(f"unknown key `{section}.{key}` in the DeepSpeed config ds.json: did you mean "
                           f"`{section}.{nearest}`?"), text
    assert "would refuse it only once the data and model are set up" in text, text


def test_nested_sections_deepspeed_reads_key_by_key_are_checked(tmp_path):
    base = _shipped("cpu_fp32.json")
    for section, nested, nearest in (("activation_checkpointing", {"partition_activation": True}, "partition_activations"),
                                     ("zero_optimization", {"stage": 1, "offload_optimizer": {"devise": "cpu"}},
                                      "offload_optimizer.device"),
                                     ("optimizer", {**base["optimizer"], "parms": {}}, "params")):
        text = _refusal({**base, section: nested}, tmp_path)
        assert f"did you mean `{section}.{nearest}`?" in text, text


def test_sections_deepspeed_passes_on_are_not_checked():
    """optimizer.params goes to the optimizer's constructor and pipeline is copied whole: any key."""
    from mtds.deepspeed_compat.config_schema import find_problems
    config = _shipped("cpu_fp32.json")
    config["optimizer"]["params"]["my_own_knob"] = 1
    config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "anything": 1}}
    config["pipeline"] = {"pipe_partitioned": False, "whatever": 1}
    assert find_problems(config) == []


def test_a_config_using_many_of_deepspeeds_sections_passes():
    """No false positive where DeepSpeed reads nested dicts, aliases (stage3_*), offload devices and paths
    (a path string is not a coerced value), monitors, timers and checkpoint options."""
    from mtds.deepspeed_compat.config_schema import find_problems
    config = {
        **_shipped("cpu_fp32.json"), "communication_data_type": "fp32", "prescale_gradients": False,
        "zero_optimization": {"stage": 3, "overlap_comm": True, "reduce_bucket_size": 5e8,
                              "offload_optimizer": {"device": "cpu", "pin_memory": True, "ratio": 0.3},
                              "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "buffer_count": 5},
                              "stage3_prefetch_bucket_size": 5e8, "stage3_param_persistence_threshold": 1e6,
                              "stage3_gather_16bit_weights_on_model_save": True, "sub_group_size": 1e12},
        "fp16": {"enabled": False, "loss_scale": 0, "initial_scale_power": 16, "hysteresis": 2},
        "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": False},
        "aio": {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1},
        "flops_profiler": {"enabled": False, "profile_step": 1, "output_file": None},
        "tensorboard": {"enabled": True, "output_path": "out/", "job_name": "x"},
        "wandb": {"enabled": False, "project": "p"}, "comms_logger": {"enabled": True, "verbose": False},
        "checkpoint": {"tag_validation": "Warn", "load_universal": False, "parallel_write": {"pipeline_stage": False}},
        "data_types": {"grad_accum_dtype": "fp32"}, "timers": {"throughput": {"enabled": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
    }
    assert find_problems(config) == []


@pytest.mark.parametrize("section, value, expected", [
    ("bf16", {"enabled": "false"}, '`bf16.enabled` in the DeepSpeed config ds.json is the string "false", which '
                                   'DeepSpeed {v} reads as false: write false, without quotes'),
    ("zero_optimization", {"stage": "auto"}, '`zero_optimization.stage` in the DeepSpeed config ds.json is "auto", a '
                                             "placeholder HF's Trainer fills in before DeepSpeed sees the config: "
                                             'DeepSpeed {v} alone drops it and uses 0; write the value you want'),
    ("zero_optimization", {"stage": "1"}, 'reads as 1: write 1, without quotes'),
])
def test_strings_deepspeed_reads_otherwise_are_refused(tmp_path, section, value, expected):
    """Verified against DeepSpeed: it reads "false" as False (mtds took it for bf16 on), drops "auto" for
    its default, turns "1" into 1."""
    from deepspeed.runtime.config import DeepSpeedConfig
    config = {**_shipped("cpu_fp32.json"), section: value}
    parsed = DeepSpeedConfig({**config, "train_batch_size": 4, "train_micro_batch_size_per_gpu": 4})
    assert (parsed.bfloat16_config.enabled, parsed.zero_optimization_stage) == \
        ((False, 1) if section == "bf16" else (False, 0 if value["stage"] == "auto" else 1))
    assert expected.format(v=_ds_version()) in _refusal(config, tmp_path)


def test_the_top_level_keys_are_deepspeeds_own():
    """The schema follows the installed DeepSpeed: every config constant its parser reads is in it, and
    the keys deepspeed.initialize reads itself are still read there."""
    import deepspeed
    from deepspeed.runtime import constants
    from deepspeed.runtime.precision_config import BFLOAT16
    from deepspeed.runtime.zero.config import ZERO_OPTIMIZATION

    from mtds.deepspeed_compat.config_schema import INITIALIZE_KEYS, top_level_keys
    keys = top_level_keys()
    for name in ("TRAIN_BATCH_SIZE", "TRAIN_MICRO_BATCH_SIZE_PER_GPU", "GRADIENT_ACCUMULATION_STEPS", "OPTIMIZER",
                 "SCHEDULER", "GRADIENT_CLIPPING", "STEPS_PER_PRINT", "WALL_CLOCK_BREAKDOWN", "FP16"):
        assert getattr(constants, name) in keys, name
    assert ZERO_OPTIMIZATION in keys and BFLOAT16 in keys
    source = inspect.getsource(deepspeed.initialize)
    for key in INITIALIZE_KEYS:
        assert f'"{key}"' in source, key
    assert "zero_optimisation" not in keys and "gradient_cliping" not in keys


def test_a_deepspeed_parser_mtds_cannot_read_is_one_error_line(monkeypatch):
    """A DeepSpeed whose config parser no longer looks keys up through the dict: the capability's line,
    not every key refused."""
    from deepspeed.runtime.config import DeepSpeedConfig

    from mtds.deepspeed_compat import DeepSpeedMismatch
    from mtds.deepspeed_compat import config_schema
    parse = DeepSpeedConfig._initialize_params
    monkeypatch.setattr(DeepSpeedConfig, "_initialize_params", lambda self, params: parse(self, dict(params)))
    config_schema.top_level_keys.cache_clear()
    try:
        with pytest.raises(DeepSpeedMismatch, match="no longer reads its config through lookups mtds can record "
                                                    "-- mtds needs it to check a DeepSpeed JSON's keys"):
            config_schema.top_level_keys()
    finally:
        config_schema.top_level_keys.cache_clear()


def _ds_version() -> str:
    import deepspeed
    return deepspeed.__version__


# --load


def _load_dirs(root: str) -> dict:
    dirs = {name: os.path.join(root, name) for name in ("missing", "empty", "other", "unfinished")}
    for name in ("empty", "other", "unfinished"):
        os.makedirs(dirs[name])
    with open(os.path.join(dirs["other"], "notes.txt"), "w") as f:
        f.write("not a checkpoint")
    os.makedirs(os.path.join(dirs["unfinished"], "global_step10.partial"))       # a first save killed half-way
    open(os.path.join(dirs["unfinished"], "zero_to_fp32.py"), "w").close()
    return dirs


def test_where_load_starts_from_scratch(tmp_path):
    from mtds.checkpoint.complete import start_or_resume
    from mtds.checkpoint.errors import CheckpointFormatError
    dirs = _load_dirs(str(tmp_path))
    assert start_or_resume(dirs["missing"]) == (f"--load {dirs['missing']}: the directory does not exist yet, no "
                                                f"checkpoint to resume: starting from scratch")
    assert start_or_resume(dirs["empty"]) == (f"--load {dirs['empty']}: the directory is empty, no checkpoint to "
                                              f"resume: starting from scratch")
    assert "holds only an unfinished save (global_step10.partial)" in start_or_resume(dirs["unfinished"])
    with pytest.raises(CheckpointFormatError, match="is not an mtds checkpoint: it holds 1 entry \\(notes.txt\\) "
                                                    "but no global_stepN/ folder, so it is probably not the directory "
                                                    "given to --save"):
        start_or_resume(dirs["other"])
    with pytest.raises(CheckpointFormatError, match="does not exist"):
        start_or_resume(os.path.join(dirs["missing"], "global_step5"))     # one checkpoint named: must be there


class _BuildReached(Exception):
    pass


def _first_launches(dirs: dict, save: str, hf_dir: str):
    """On one rank: ``run`` with --load of each directory up to the build phase (replaced: records the
    --load the build got), then the same ``--save D --load D`` launched twice for real."""
    import contextlib
    import io

    from mtds.training import job
    from mtds.training.cli import user_errors
    from tests.training_helpers import train_config
    reached = []

    def build_probe(cfg, *args, **kwargs):
        reached.append(cfg.load)
        raise _BuildReached

    out = {}
    original = job.build_run
    job.build_run = build_probe
    try:
        for name, path in dirs.items():
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                try:
                    job.run(train_config(load=path))
                    outcome = ("ran", None)
                except _BuildReached:
                    outcome = ("built", reached[-1])
                except user_errors() as err:
                    outcome = ("error", str(err))
            out[name] = (*outcome, printed.getvalue())
    finally:
        job.build_run = original
    runs = []
    for steps in (2, 3):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            result = job.run(train_config(steps=steps, save=save, load=save))
        runs.append((result.losses, result.final_step, printed.getvalue()))
    # --load of that checkpoint with no --model: its recorded model; a conflicting --model: one line, before the build
    models = []

    def model_probe(cfg, world, *args, **kwargs):
        models.append(world.model_cfg)
        raise _BuildReached

    job.build_run = model_probe
    try:
        for model in (None, "gpt2-small"):
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                try:
                    job.run(train_config(load=save, model=model))
                    outcome = ("ran", None)
                except _BuildReached:
                    outcome = ("built", models[-1])
                except user_errors() as err:
                    outcome = ("error", str(err))
            out[f"model={model}"] = (*outcome, printed.getvalue())
    finally:
        job.build_run = original
    # --init-from-hf: the line naming the directory and what was loaded
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        job.run(train_config(steps=1, model=None, init_from_hf=hf_dir))
    out["init_from_hf"] = printed.getvalue()
    # Megatron's --bf16 / --clip-grad / --weight-decay over an fp32 JSON, against the JSON that says the same
    from tests.training_helpers import ds_config
    flagged = []
    for cfg in (train_config(steps=2, bf16=True, clip_grad=0.3, weight_decay=0.05),
                train_config(steps=2, deepspeed_config=_json_saying_it(ds_config()))):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            result = job.run(cfg)
        flagged.append((result.losses, result.grad_norms, printed.getvalue()))
    return out, runs, flagged


def _json_saying_it(config: dict) -> dict:
    """What --bf16 --clip-grad 0.3 --weight-decay 0.05 mean, written in the DeepSpeed JSON itself."""
    config = {**config, "bf16": {"enabled": True}, "gradient_clipping": 0.3}
    config["optimizer"] = {**config["optimizer"], "params": {**config["optimizer"]["params"], "weight_decay": 0.05}}
    return config


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("firsthour"))
    save = os.path.join(root, "ckpt")
    hf_dir = os.path.join(root, "gpt2-hf")
    _tiny_hf_gpt2(hf_dir)
    (out, runs, flagged), = spawn(_first_launches, 1, _load_dirs(root), save, hf_dir, timeout=300)
    return out, runs, save, flagged


def _tiny_hf_gpt2(path: str) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=8192, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0,
                               eos_token_id=0)).save_pretrained(path)


@pytest.mark.parametrize("name, why", [("missing", "the directory does not exist yet"),
                                       ("empty", "the directory is empty"),
                                       ("unfinished", "holds only an unfinished save (global_step10.partial)")])
def test_load_of_a_missing_or_empty_dir_starts_from_scratch(launches, name, why):
    out, _, _, _ = launches
    kind, load_seen, printed = out[name]
    assert (kind, load_seen) == ("built", None), out[name]       # the build phase ran, without --load
    assert f"{why}, no " in printed and "starting from scratch" in printed, printed


def test_load_of_a_dir_holding_other_files_fails_before_the_build(launches):
    out, _, _, _ = launches
    kind, text, printed = out["other"]
    assert kind == "error" and "is not an mtds checkpoint: it holds 1 entry (notes.txt)" in text, out["other"]
    assert "starting from scratch" not in printed


def test_the_same_save_load_command_starts_and_restarts(launches):
    _, runs, save, _ = launches
    (first, first_step, first_out), (second, second_step, second_out) = runs
    assert len(first) == 2 and first_step == 2 and "starting from scratch" in first_out, first_out
    assert len(second) == 1 and second_step == 3 and f"resumed from {save} at step 2" in second_out, second_out
    assert sorted(n for n in os.listdir(save) if n.startswith("global_step")) == ["global_step2", "global_step3"]


def test_load_without_model_takes_the_checkpoints_model(launches):
    """No --model with --load: the model mtds_meta.json records (not gpt2-tiny, which made the load fail), said in
    one line; the CLI leaves the model unset so that the checkpoint can decide."""
    from mtds.training.cli import build_parser, config_from_args
    from tests.training_helpers import TINY
    out, _, save, _ = launches
    kind, model_cfg, printed = out["model=None"]
    assert kind == "built" and model_cfg == TINY, out["model=None"]
    lines = [line for line in printed.splitlines() if "mtds_meta.json" in line]
    assert lines == [f"model: the one {save}/global_step3 records (mtds_meta.json), as no --model was given"], printed
    common = ["--deepspeed_config", "ds_configs/cpu_fp32.json"]
    assert config_from_args(build_parser().parse_args(common + ["--load", "ck"])).model is None
    assert config_from_args(build_parser().parse_args(common + ["--init-from-hf", "hf"])).model is None


def test_a_model_that_conflicts_with_the_checkpoint_is_one_line_naming_both(launches):
    out, _, save, _ = launches
    kind, text, printed = out["model=gpt2-small"]
    assert kind == "error", out["model=gpt2-small"]     # before the build: no data, no model set up
    assert "\n" not in text, text
    assert text.startswith(f"--model gpt2-small is a different model from the one checkpoint {save}/global_step3 "
                           f"records: vocab_size 50257 vs 8192, hidden_size 768 vs 64, num_layers 12 vs 4"), text
    assert text.endswith("leave out --model to train the checkpoint's model"), text


def test_without_model_or_load_the_model_is_gpt2_tiny():
    from mtds.model.config import PRESETS
    from mtds.training.world import run_model_config
    from tests.training_helpers import train_config
    assert run_model_config(train_config(model=None)) == PRESETS["gpt2-tiny"]
    assert run_model_config(train_config(model=None, model_overrides={"hidden_dropout": 0.1})).hidden_dropout == 0.1


def test_init_from_hf_says_what_it_loaded(launches):
    """One line naming the directory, the tensors and the parameters read (all ranks together, each once)."""
    from safetensors.torch import load_file
    out, _, save, _ = launches
    hf_dir = os.path.join(os.path.dirname(save), "gpt2-hf")
    tensors = load_file(os.path.join(hf_dir, "model.safetensors"))
    lines = [line for line in out["init_from_hf"].splitlines() if hf_dir in line]
    assert lines == [f"init: {len(tensors)} tensors, {sum(t.numel() for t in tensors.values()):,} parameters loaded "
                     f"from HF {hf_dir}"], out["init_from_hf"]


def test_megatrons_json_flags_override_the_json_and_are_named(launches):
    """--bf16 --clip-grad 0.3 --weight-decay 0.05 over an fp32 JSON train exactly as the JSON saying the same,
    and the header names each override."""
    *_, ((losses, norms, printed), (json_losses, json_norms, json_printed)) = launches
    assert (losses, norms) == (json_losses, json_norms)
    assert "bf16" in printed.split("mtds: layout", 1)[1].split("\n", 1)[0], printed
    assert ("flags over the DeepSpeed config: --bf16 (bf16.enabled), --clip-grad 0.3 (gradient_clipping), "
            "--weight-decay 0.05 (optimizer.params.weight_decay)") in printed, printed
    assert "flags over the DeepSpeed config" not in json_printed


def test_megatrons_flags_are_aliases_or_named_with_their_equivalent(capsys):
    from mtds.training.cli import build_parser, config_from_args
    common = ["--deepspeed_config", "ds_configs/cpu_fp32.json"]
    megatron = config_from_args(build_parser().parse_args(common + [
        "--train-iters", "7", "--lr-warmup-iters", "2", "--lr-decay-style", "linear", "--tensorboard-dir", "tb"]))
    ours = config_from_args(build_parser().parse_args(common + [
        "--steps", "7", "--warmup-steps", "2", "--lr-decay", "linear", "--tensorboard", "tb"]))
    assert megatron == ours
    for flag, words in (("--num-layers", "--model"), ("--lr-decay-iters", "--steps"), ("--adam-beta2", "optimizer.params")):
        with pytest.raises(SystemExit) as exit_:
            build_parser().parse_args(common + [flag, "3"])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.count("\n") == 1, err
        assert f"error: {flag} is Megatron-LM's and not a train.py flag" in err and words in err, err
    with pytest.raises(ValueError, match="--bf16 and --fp16 both given"):
        config_from_args(build_parser().parse_args(common + ["--bf16", "--fp16"]))


def test_schedule_errors_speak_flags():
    """The micro-batch rule's fix names --global-batch-size (mtds.rules.schedule)."""
    from mtds.rules.schedule import micro_batches_problem
    assert micro_batches_problem("dualpipev", 2, 3, 4).endswith(
        "use --global-batch-size 16, which makes the micro-batches per step 4")
    assert micro_batches_problem("interleaved", 4, 2, 2).endswith(
        "use --global-batch-size 8, which makes the micro-batches per step 4")


def test_weight_decay_needs_an_optimizer_section():
    from mtds.training.ds_config import ConfigError, override_from_flags
    with pytest.raises(ConfigError, match='--weight-decay sets .* no "optimizer" section'):
        override_from_flags({"train_batch_size": 8}, weight_decay=0.1)


# Silence by default (mtds.observe.quiet): each rule against the real text it silences; --debug shows it all


_DEEPSPEED_CPU = "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."
_DEPRECATED = ("`torch.distributed.all_gather_into_tensor` is deprecated. Please use "
               "`torch.distributed.all_gather_single` instead.")


def _third_party_output(debug: bool) -> tuple[list[str], list[str], str, bool]:
    """(DeepSpeed log messages, warnings, stdout) that reach the user with quiet.install(debug), and whether
    datasets may show its bars for local files."""
    import contextlib
    import io
    import logging
    import warnings

    from mtds.observe import quiet
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    logger, handler = logging.getLogger("DeepSpeed"), Keep()
    logger.addHandler(handler)
    printed = io.StringIO()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            quiet.install(debug=debug)
            logger.warning(_DEEPSPEED_CPU)
            logger.warning("a DeepSpeed warning mtds does not know")
            # where torch's @deprecated attributes it (stacklevel): torch.distributed.c10d_logger
            warnings.warn_explicit(_DEPRECATED, FutureWarning, "c10d_logger.py", 83,
                                   module="torch.distributed.c10d_logger")
            warnings.warn_explicit("another FutureWarning", FutureWarning, "c10d_logger.py", 83,
                                   module="torch.distributed.c10d_logger")
            with contextlib.redirect_stdout(printed), quiet.quiet_prints():
                print("SEED_LAYERS=False BASE_SEED=1234 SEED_FN=None")
                print("Using topology: {ProcessCoord(pipe=0, data=0, model=0): 0}")
                print("pipeline layout Et*4|L (--pipeline-balance cost)")
            bars = quiet.local_load_bars()
    finally:
        quiet.uninstall()
        logger.removeHandler(handler)
    return seen, [str(w.message) for w in caught], printed.getvalue(), bars


def test_quiet_hides_what_says_nothing_and_keeps_the_rest():
    logged, warned, printed, bars = _third_party_output(debug=False)
    assert logged == ["a DeepSpeed warning mtds does not know"]
    assert warned == ["another FutureWarning"]
    assert printed == "pipeline layout Et*4|L (--pipeline-balance cost)\n"
    assert not bars


def test_debug_shows_all_of_it():
    logged, warned, printed, bars = _third_party_output(debug=True)
    assert logged == [_DEEPSPEED_CPU, "a DeepSpeed warning mtds does not know"]
    assert warned == [_DEPRECATED, "another FutureWarning"]
    assert printed.count("\n") == 3 and bars


def test_every_quiet_rule_says_why():
    from mtds.observe import quiet
    rules = quiet.LOG_RULES + quiet.WARNING_RULES + quiet.PRINT_RULES
    assert len(rules) == 4 and all(len(rule[-1]) > 30 for rule in rules)


def test_mtds_calls_no_deprecated_collective():
    """torch 2.13's names (mtds.tp.mappings); the old ones warn on every rank."""
    import pathlib
    import re
    root = pathlib.Path(ROOT) / "mtds"
    calls = [f"{path.relative_to(ROOT)}: {line.strip()}" for path in root.rglob("*.py")
             for line in path.read_text().splitlines()
             if re.search(r"\bdist\.(all_gather_into_tensor|reduce_scatter_tensor|_all_gather_base)\(", line)]
    assert calls == [], calls


@pytest.mark.parametrize("debug", [False, True])
def test_reading_a_local_corpus_shows_only_mtds_tokenizing_bar(tmp_path, debug):
    import contextlib
    import io

    from mtds.data import SHIPPED_TOKENIZER
    from mtds.data.packed import build_packed_dataset
    from mtds.data.tokenizer import load_tokenizer
    from mtds.observe import quiet
    for i in range(18):     # as many files as the shipped corpus: datasets shows "Downloading data" from 16 on
        (tmp_path / f"doc{i}.txt").write_text("To be, or not to be, that is the question. " * 20)
    shown = io.StringIO()
    quiet.install(debug=debug)
    try:
        with contextlib.redirect_stderr(shown):
            build_packed_dataset(str(tmp_path), load_tokenizer(str(SHIPPED_TOKENIZER)), 16,
                                 cache_dir=str(tmp_path / "cache"), show_progress=True)
    finally:
        quiet.uninstall()
    assert "Tokenizing" in shown.getvalue()
    assert ("Downloading data" in shown.getvalue()) == debug and ("Generating train split" in shown.getvalue()) == debug


# make train / make test: set up once, then only when the environment is stale


def _make_dry_run(target: str, venv, **env) -> str:
    import subprocess
    out = subprocess.run(["make", "-n", "-C", ROOT, target, f"VENV={venv}", *[f"{k}={v}" for k, v in env.items()]],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_make_installs_only_into_a_missing_or_stale_environment(tmp_path):
    import shutil
    if shutil.which("make") is None:
        pytest.skip("no make")
    venv = tmp_path / ".venv"
    fresh = _make_dry_run("train", venv)
    assert "-m venv" in fresh and "pip install -q -e ." in fresh and "train.py" in fresh
    # what a completed set-up leaves (make itself, not run here: -n)
    touched = {line.split("touch ", 1)[1].strip().strip('"') for line in
               (fresh + _make_dry_run("test", venv)).splitlines() if "touch " in line}
    assert len(touched) == 3, touched       # the set-up's stamp, the test extras' and Megatron-LM 0.19's folder
    for path in (f"{venv}/bin/python", *sorted(touched)):      # in the order make writes them
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "w").close()
    again = _make_dry_run("train", venv)
    assert "pip install" not in again and "train.py" in again, again
    assert "pip install" not in _make_dry_run("test", venv)
    stale = os.stat(os.path.join(ROOT, "pyproject.toml")).st_mtime + 10     # pyproject.toml changed since
    for stamp in venv.glob(".setup*"):
        os.utime(stamp, (stale - 20, stale - 20))
    assert "pip install -q -e ." in _make_dry_run("train", venv)
    assert 'pip install -q "torch"' in _make_dry_run("train", venv, TORCH_SPEC="torch")    # another torch asked for


# Plots: whole steps on step axes, the Gantt chart's bar labels explained, compare run's learning rate stated


def _tick_values(fig, axis: str = "x") -> list[tuple[float, str]]:
    """(value, label) of every tick inside each step axis's limits, read back from the drawn figure."""
    fig.canvas.draw()
    out = []
    for ax in fig.axes:
        if ax.get_xlabel() != "step":
            continue
        lo, hi = ax.get_xlim()
        out += [(t.get_loc(), t.label1.get_text()) for t in ax.xaxis.get_major_ticks() if lo <= t.get_loc() <= hi]
    return out


def _assert_whole_steps(fig, axes: int) -> None:
    import matplotlib.pyplot as plt
    ticks = _tick_values(fig)
    plt.close(fig)
    assert len({round(v, 6) for v, _ in ticks}) >= 2 and sum(1 for _ in ticks) >= axes, ticks
    assert all(float(v).is_integer() for v, _ in ticks), ticks
    assert all(label.replace("\u2212", "-").lstrip("-").isdigit() for _, label in ticks), ticks


def test_training_curves_have_whole_step_ticks():
    from mtds.observe.plot import run_figure
    for steps in (2, 3, 7):
        records = [{"kind": "train", "step": s, "loss": 9.0 - s / 10, "lr": 1e-3, "tokens_per_s": 5000.0}
                   for s in range(1, steps + 1)] + [{"kind": "eval", "step": steps, "eval_loss": 8.5}]
        _assert_whole_steps(run_figure(records), axes=3)


def test_compare_loss_plot_has_whole_step_ticks():
    from compare.plots import loss_figure
    rows = [{"scheme": name, "steps": [1, 2, 3], "losses": [9.0, 8.8, 8.7]} for name in ("ptdp-t2p1", "zero3")]
    _assert_whole_steps(loss_figure(rows), axes=1)


def test_the_gantt_chart_legend_explains_the_bar_labels():
    import matplotlib.pyplot as plt

    from mtds.observe.timeline import TimelineEvent, gantt_figure
    events = [TimelineEvent(rank=r, kind=k, start=s, end=s + 1.0, chunk=c, micro=m)
              for r in (0, 1) for k, s, c, m in (("F", 0.0, 0, 0), ("F", 1.0, 1, 0), ("B", 2.0, 1, 0), ("B", 3.0, 0, 0))]
    fig = gantt_figure(events)
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    bars = sorted({t.get_text() for t in fig.axes[0].texts})
    plt.close(fig)
    assert bars == ["0", "0'1"]       # micro-batch 0 of chunk 0, of chunk 1
    assert "F" in labels and "B" in labels
    assert "n'c: micro-batch n of model chunk c (n alone: chunk 0)" in labels, labels
    fig = gantt_figure([e for e in events if e.chunk == 0])      # one chunk per rank: no chunk to explain
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    plt.close(fig)
    assert "n: micro-batch n" in labels, labels


def test_compare_run_states_its_learning_rate():
    from compare.table import markdown
    rows = [{"scheme": name, "tp": 1, "pp": 1, "dp": 2, "tokens_per_s": 1.0, "tflops_model_per_rank": 0.0,
             "tflops_hw_per_rank": 0.0, "peak_mem_gib": 1.0, "final_loss": 8.7, "lrs": [1e-3, 1e-3, 1e-3],
             "comm_by_family_max_rank": {"all_reduce": 0, "all_gather": 0, "reduce_scatter": 0, "p2p_send": 0}}
            for name in ("ptdp-t1p1", "zero3")]
    text = markdown(rows, {"nproc": 2, "model": "gpt2-tiny", "steps": 3, "seq_length": 32})
    assert ("Learning rate: constant 1.00e-03 at every step of every scheme (`--lr-decay constant`, no warm-up: the "
            "DeepSpeed config's `optimizer.params.lr`)") in text, text


# The README's HF round trip, its lines as written


def readme_block(heading: str) -> list[str]:
    """The commands of the first ```bash block under ``## heading`` in README.md (continuation lines joined)."""
    with open(os.path.join(ROOT, "README.md")) as f:
        section = f.read().split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def test_the_readme_hf_round_trip_runs_as_written(tmp_path):
    """Convert a HF model, train it with --load of the conversion (no --model) and --save, export the trained
    checkpoint, evaluate the export: the README's lines in order, in a directory that holds what the repository
    root does (train.py, ds_configs/, mtds/), with the environment's console scripts on PATH."""
    import json
    import math
    import subprocess
    import sys
    from lab.testing import free_port
    for name in ("train.py", "ds_configs", "mtds"):
        os.symlink(os.path.join(ROOT, name), tmp_path / name)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port()),
           "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])}
    commands = readme_block("From HuggingFace and back")
    assert [c.split()[0] for c in commands] == ["python", "mtds-convert", "python", "mtds-convert", "mtds-eval"]
    outputs = []
    for command in commands:
        out = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=240)
        assert out.returncode == 0, (command, out.stdout[-2000:], out.stderr[-2000:])
        outputs.append(out.stdout + out.stderr)
    _, converted, trained, exported, evaluated = outputs
    assert "hf-to-mtds: wrote runs/hf/converted/global_step0" in converted, converted
    assert ("model: the one runs/hf/converted/global_step0 records (mtds_meta.json), as no --model was given"
            in trained), trained
    assert "resumed from runs/hf/converted at step 0" in trained and "step 10/10" in trained, trained
    assert os.path.isdir(tmp_path / "runs/hf/trained/global_step10")
    assert (tmp_path / "runs/hf/gpt2-trained/model.safetensors").is_file(), exported
    result = json.loads(evaluated.strip().splitlines()[-1])
    assert result["loss"] < math.log(8192) - 0.2, result       # trained: below a uniform guess over the vocab
    for text in (converted, trained, exported, evaluated):       # mtds's lines only (mtds.observe.quiet)
        assert "Setting accelerator to CPU" not in text and "Downloading data" not in text, text
