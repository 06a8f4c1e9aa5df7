"""Each training option is defined once, on its TrainConfig field (mtds.training.options): every field has its
flags in train.py's parser or is a field without a flag on purpose, and every range its metadata declares
refuses a value outside it with the one line train.py has always printed. Single process, no run."""
import contextlib
import dataclasses
import io


from mtds.training import TrainConfig
from mtds.training.cli import build_parser, config_from_args
from mtds.training.options import flag_fields, range_words

# Fields that have no flag, on purpose (each says why in its no_flag=): a new field is added here, or given flags.
NOT_FLAGS = {"model_overrides", "trace_comm"}

# One value out of each declared range, given on the command line, and the error train.py prints for it.
OUT_OF_RANGE = {
    "tp": (["--tp", "0"], "--tp must be >= 1, got 0"),
    "pp": (["--pipeline-model-parallel-size", "-1"], "--pp must be >= 1, got -1"),
    "virtual_stages": (["--virtual-stages", "0"], "--virtual-stages must be >= 1, got 0"),
    "context_parallel_size": (["--context-parallel-size", "0"], "--cp must be >= 1, got 0"),
    "expert_model_parallel_size": (["--expert-model-parallel-size", "0"], "--ep must be >= 1, got 0"),
    "moe_z_loss_coeff": (["--moe-z-loss-coeff", "-0.1"], "--moe-z-loss-coeff must be >= 0, got -0.1"),
    "moe_aux_loss_coeff": (["--moe-aux-loss-coeff", "-1"], "--moe-aux-loss-coeff must be >= 0, got -1.0"),
    "moe_router_bias_update_rate": (["--moe-router-bias-update-rate", "-1"],
                                    "--moe-router-bias-update-rate must be >= 0, got -1.0"),
    "moe_expert_capacity_factor": (["--moe-expert-capacity-factor", "0"],
                                   "--moe-expert-capacity-factor must be > 0, got 0.0"),
    "recompute_interval": (["--recompute", "full", "--recompute-num-layers", "0"],
                           "--recompute-interval must be >= 1, got 0"),
    "seed": (["--seed", "-1"], "--seed must be >= 0, got -1"),
    "seq_length": (["--seq-length", "0"], "--seq-length must be >= 1, got 0"),
    "num_proc": (["--num-proc", "0"], "--num-proc must be >= 1, got 0"),
    "eval_split": (["--eval-split", "1"], "--eval-split must be in [0, 1) (the fraction held out), got 1.0"),
    "eval_interval": (["--eval-interval", "-5"], "--eval-interval must be >= 0 (0: evaluate at the end only), got -5"),
    "eval_iters": (["--eval-iters", "0"], "--eval-iters must be >= 1, got 0"),
    "steps": (["--steps", "-1"], "--steps must be >= 0, got -1"),
    "lr": (["--lr", "0"], "--lr must be > 0, got 0.0"),
    "min_lr": (["--min-lr", "-0.5"], "--min-lr must be >= 0, got -0.5"),
    "warmup_steps": (["--warmup-steps", "-10"], "--warmup-steps must be >= 0, got -10"),
    "save_interval": (["--save-interval", "-1"], "--save-interval must be >= 0 (0: save at the end only), got -1"),
    "keep_last": (["--keep-last", "-2"], "--keep-last must be >= 0 (0 keeps every checkpoint), got -2"),
    "check_replicas_interval": (["--check-replicas", "-3"], "--check-replicas must be >= 0 (0: off), got -3"),
    "dist_timeout_s": (["--dist-timeout", "0"], "--dist-timeout must be > 0 seconds, got 0.0"),
    "heartbeat_timeout_s": (["--heartbeat-timeout", "-1"],
                            "--heartbeat-timeout must be >= 0 seconds (0: off), got -1.0"),
    "build_lock_timeout_s": (["--build-lock-timeout", "-5"], "--build-lock-timeout must be > 0 seconds, got -5.0"),
    "straggler_interval": (["--straggler-interval", "0"], "--straggler-interval must be >= 1, got 0"),
    "straggler_factor": (["--straggler-factor", "1"], "--straggler-factor must be > 1, got 1.0"),
    "clip_grad": (["--clip-grad", "-1"], "--clip-grad must be >= 0, got -1.0"),
    "weight_decay": (["--weight-decay", "nan"], "--weight-decay must be >= 0, got nan"),
}


def _config(argv):
    return config_from_args(build_parser().parse_args(["--deepspeed_config", "x.json", *argv]))


def _error(make) -> str | None:
    """The ValueError's line ``make()`` raises, None if it raises none."""
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            make()
    except ValueError as err:
        return str(err)
    return None


def test_every_field_has_its_flags_or_says_why_not():
    fields = dataclasses.fields(TrainConfig)
    without = {f.name for f in fields if not f.metadata.get("flags")}
    assert without == NOT_FLAGS, f"fields without a flag: {sorted(without - NOT_FLAGS)} (give them flags with " \
                                 f"opt(...), or list them in NOT_FLAGS with opt(no_flag=why))"
    assert all(f.metadata["no_flag"] for f in fields if f.name in NOT_FLAGS)
    groups = {g.title: g for g in build_parser()._action_groups}
    for f in flag_fields(TrainConfig):
        group = groups[f.metadata["section"]]
        action = next(a for a in group._group_actions if a.dest == f.name)
        assert tuple(action.option_strings) == f.metadata["flags"] and action.help == f.metadata["help"], f.name


def test_no_flag_given_is_every_default():
    assert _config([]) == TrainConfig("x.json")


def test_every_range_refuses_a_value_outside_it():
    ranged = {f.name for f in dataclasses.fields(TrainConfig) if range_words(f)}
    assert ranged == set(OUT_OF_RANGE), f"ranges without a case here: {sorted(ranged ^ set(OUT_OF_RANGE))}"
    got = {name: _error(lambda: _config(argv)) for name, (argv, _) in OUT_OF_RANGE.items()}
    assert got == {name: message for name, (_, message) in OUT_OF_RANGE.items()}


def test_floats_must_be_finite_and_each_bound_is_as_worded():
    wrong = []
    for f in dataclasses.fields(TrainConfig):
        m, words = f.metadata, range_words(f)
        if words is None:
            continue
        bad = [float("nan"), float("inf"), float("-inf")] if f.type.startswith("float") else []
        if m["below"] is not None:      # half-open: the upper bound itself is out
            bad.append(m["below"])
        for value in bad:
            line = _error(lambda: TrainConfig("x.json", **{f.name: value}))
            if not (line and f" must be {words}" in line and line.endswith(f", got {value}")):
                wrong.append((f.name, value, line))
        extra = {"recompute": "full"} if f.name == "recompute_interval" else {}
        edge = m["at_least"] if m["above"] is None else m["above"] + 1e-9      # the smallest value in range
        if _error(lambda: TrainConfig("x.json", **{f.name: edge}, **extra)) is not None:
            wrong.append((f.name, edge, "refused"))
    assert not wrong, wrong


def test_megatron_dropout_flags_override_each_half_of_dropout():
    assert _config(["--dropout", "0.1"]).model_overrides == dict(hidden_dropout=0.1, attention_dropout=0.1)
    assert _config(["--dropout", "0.1", "--attention-dropout", "0"]).model_overrides == \
        dict(hidden_dropout=0.1, attention_dropout=0.0)
    assert _config(["--hidden-dropout", "0.2"]).model_overrides == dict(hidden_dropout=0.2)
    assert _config([]).model_overrides == {}
