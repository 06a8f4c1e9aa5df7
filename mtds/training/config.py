"""Everything one training run needs, as one frozen value (the CLI builds it; Python users too).

Run settings only: what a caller wants to observe or inject (test probes) goes to ``run(cfg, ...)``.
Every numeric setting's range is checked here, in ``_check_ranges``, with one line naming the flag.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from mtds.parallel.choices import RECOMPUTE_MODES

ZERO1_GRAD_REDUCE = ("reduce-scatter", "all-reduce")


@dataclass(frozen=True)
class TrainConfig:
    deepspeed_config: Any                       # path to DeepSpeed JSON, or the dict itself
    model: Any = "gpt2-tiny"                    # preset name, HF config.json/dir, or ModelConfig
    model_overrides: dict = field(default_factory=dict)   # e.g. {"hidden_dropout": 0.1}
    tp: int = 1
    pp: int = 1
    sequence_parallel: bool = False             # split activations along the sequence over the TP group
    pipeline_schedule: str = "1f1b"             # 1f1b, dualpipev (DeepSpeed engines) | interleaved (mtds.pipe.engine)
    virtual_stages: int = 1                     # model chunks per pipeline rank (interleaved: >= 2)
    zero1_grad_reduce: str = "reduce-scatter"   # ZeRO-1 gradients: reduce-scatter (mtds) | all-reduce (DeepSpeed's)
    pipeline_layout: str | None = None          # blocks per virtual stage, e.g. "Et*3|t*3|t*2L" (mtds.parallel.pipeline_layout)
    pipeline_balance: str | None = None         # uniform | cost (None: mtds.training.stage_plan.DEFAULT_BALANCE)
    # data
    data: str | None = None                     # None: the shipped corpus
    text_column: str = "text"
    tokenizer: str | None = None                # None: the shipped tokenizer
    seq_length: int = 128
    num_proc: int = 1
    eval_split: float = 0.02
    eval_data: str | None = None
    data_path: tuple | None = None              # Megatron indexed data: (PREFIX,) or (W1, PREFIX1, W2, PREFIX2, ...)
    eval_data_path: tuple | None = None         # same syntax, for evaluation (else --eval-split of each source is held out)
    eod_mask_loss: bool = False                 # no loss where the input token is EOS (Megatron's --eod-mask-loss)
    reset_position_ids: bool = False            # positions restart after each EOS (Megatron's --reset-position-ids)
    reset_attention_mask: bool = False          # each packed document attends only to itself (--reset-attention-mask)
    eval_interval: int = 0                      # 0: evaluate only at the end
    eval_iters: int = 4                         # global batches per evaluation
    # optimisation
    steps: int = 100
    lr: float | None = None                     # overrides optimizer.params.lr
    global_batch_size: int | None = None        # overrides train_batch_size (Megatron's --global-batch-size)
    micro_batch_size: int | None = None         # overrides train_micro_batch_size_per_gpu (--micro-batch-size)
    min_lr: float = 0.0
    warmup_steps: int = 0
    lr_decay: str = "cosine"                    # cosine | linear | constant (ignored if the config has a scheduler)
    seed: int = 1234
    recompute: str = "none"                     # none | selective (attention core) | full (whole blocks)
    recompute_interval: int = 1                 # full: every N consecutive blocks are recomputed as one unit
    compile: bool = False                       # torch.compile each transformer layer (mtds.model.compile)
    profile_step: int | None = None             # profile this step (torch.profiler; mtds.observe.step_profile)
    profile_trace: str | None = None            # its Chrome trace, one file per rank (.rankR before the suffix)
    init_from_hf: str | None = None
    # checkpoints and logs
    save: str | None = None
    save_interval: int = 0
    keep_last: int = 0                          # keep only the newest K complete checkpoints; 0 keeps all
    load: str | None = None
    log_jsonl: str | None = None
    tensorboard: str | None = None
    timeline: str | None = None                 # Chrome trace JSON (+ .png Gantt) of the last step; bubble per step
    plot: str | None = None                     # PNG of loss / lr / throughput at the end
    progress: bool | None = None                # None: a bar when stdout is a TTY
    check_replicas_interval: int = 0            # verify TP-replicated/tied weights agree every N steps
    trace_comm: bool = True                     # count bytes per collective (cheap)
    dist_timeout_s: float = 600.0
    on_nan: str = "stop"                        # stop | skip (skip: only steps the engine did not apply)
    save_on_signal: bool = True                 # SIGTERM/SIGINT: finish the step, save (with --save), exit 0
    build_lock_timeout_s: float = 300.0         # a torch-extensions build lock held longer ends start-up
    heartbeat_timeout_s: float = 30.0           # a peer silent this long (dead or frozen) ends this rank; 0 off

    def __post_init__(self) -> None:
        self._check_ranges()
        if self.lr_decay not in ("cosine", "linear", "constant"):
            raise ValueError(f"--lr-decay must be cosine, linear or constant, got {self.lr_decay!r}")
        if self.zero1_grad_reduce not in ZERO1_GRAD_REDUCE:
            raise ValueError(f"--zero1-grad-reduce must be reduce-scatter or all-reduce, got {self.zero1_grad_reduce!r}")
        if self.on_nan not in ("stop", "skip"):
            raise ValueError(f"--on-nan must be stop or skip, got {self.on_nan!r}")
        if (self.reset_position_ids or self.reset_attention_mask) and self.pp > 1 and self.pipeline_schedule != "1f1b":
            # the document ids travel beside the activation: DeepSpeed's 1F1B engine sends tuples,
            # the other schedules' engines one tensor per stage boundary
            flag = "--reset-position-ids" if self.reset_position_ids else "--reset-attention-mask"
            raise ValueError(f"{flag} with --pp {self.pp} needs --pipeline-schedule 1f1b: the "
                             f"{self.pipeline_schedule} schedule sends one tensor between stages, not the "
                             f"document ids beside it")
        if self.profile_step is not None and not 1 <= self.profile_step <= self.steps:
            raise ValueError(f"--profile-step {self.profile_step} is not a step of this run: give 1..{self.steps} "
                             f"(--steps {self.steps})")
        if self.profile_trace and self.profile_step is None:
            raise ValueError("--profile-trace needs --profile-step N (the step to trace)")
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"--recompute must be none, selective or full, got {self.recompute!r}")
        if self.recompute != "full" and self.recompute_interval != 1:
            raise ValueError(f"--recompute-interval {self.recompute_interval} applies to --recompute full only "
                             f"(got --recompute {self.recompute}): add --recompute full or drop the interval")
        from mtds.pipe.select import check_schedule
        check_schedule(self.pipeline_schedule, pp=self.pp, virtual_stages=self.virtual_stages)
        self._check_stage_layout()

    def _check_stage_layout(self) -> None:
        if self.pipeline_balance not in (None, "uniform", "cost"):
            raise ValueError(f"--pipeline-balance must be uniform or cost, got {self.pipeline_balance!r}")
        if self.pipeline_layout is None:
            return
        if self.pp == 1:
            raise ValueError("--pipeline-layout needs a pipeline: set --pp >= 2 (or drop the layout)")
        if self.pipeline_balance is not None:
            raise ValueError(f"--pipeline-layout fixes the partition; --pipeline-balance {self.pipeline_balance} "
                             f"would choose another: give one of the two")

    def _check_ranges(self) -> None:
        """Each numeric setting within its range (floats also finite), else one line naming the flag."""
        at_least_0, at_least_1, above_0 = (">= 0", 0, False), (">= 1", 1, False), ("> 0", 0, True)
        rules = [  # (flag, value, (words, bound, strict), what the bound means)
            ("--tp", self.tp, at_least_1, ""), ("--pp", self.pp, at_least_1, ""),
            ("--virtual-stages", self.virtual_stages, at_least_1, ""),
            ("--seq-length", self.seq_length, at_least_1, ""), ("--num-proc", self.num_proc, at_least_1, ""),
            ("--eval-interval", self.eval_interval, at_least_0, " (0: evaluate at the end only)"),
            ("--eval-iters", self.eval_iters, at_least_1, ""),
            ("--steps", self.steps, at_least_0, ""),
            ("--lr", self.lr, above_0, ""), ("--min-lr", self.min_lr, at_least_0, ""),
            ("--warmup-steps", self.warmup_steps, at_least_0, ""), ("--seed", self.seed, at_least_0, ""),
            ("--recompute-interval", self.recompute_interval, at_least_1, ""),
            ("--save-interval", self.save_interval, at_least_0, " (0: save at the end only)"),
            ("--keep-last", self.keep_last, at_least_0, " (0 keeps every checkpoint)"),
            ("--check-replicas", self.check_replicas_interval, at_least_0, " (0: off)"),
            ("--dist-timeout", self.dist_timeout_s, above_0, " seconds"),
            ("--build-lock-timeout", self.build_lock_timeout_s, above_0, " seconds"),
            ("--heartbeat-timeout", self.heartbeat_timeout_s, at_least_0, " seconds (0: off)"),
        ]
        for flag, value, (words, bound, strict), note in rules:
            if value is None:
                continue
            finite = not isinstance(value, float) or math.isfinite(value)
            if not finite or value < bound or (strict and value == bound):
                raise ValueError(f"{flag} must be {words}{note}, got {value}")
        if not (0.0 <= self.eval_split < 1.0):
            raise ValueError(f"--eval-split must be in [0, 1) (the fraction held out), got {self.eval_split}")
