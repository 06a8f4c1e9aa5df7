"""Everything one training run needs, as one frozen value (the CLI builds it; Python users too)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
    # data
    data: str | None = None                     # None: the shipped corpus
    text_column: str = "text"
    tokenizer: str | None = None                # None: the shipped tokenizer
    seq_length: int = 128
    num_proc: int = 1
    eval_split: float = 0.02
    eval_data: str | None = None
    eval_interval: int = 0                      # 0: evaluate only at the end
    eval_iters: int = 4                         # global batches per evaluation
    # optimisation
    steps: int = 100
    lr: float | None = None                     # overrides optimizer.params.lr
    min_lr: float = 0.0
    warmup_steps: int = 0
    lr_decay: str = "cosine"                    # cosine | linear | constant (ignored if the config has a scheduler)
    seed: int = 1234
    activation_checkpointing: int = 0           # interval k of "full" recomputation (every k blocks); 0 off
    recompute: str | None = None                # none | selective | full; None: full if activation_checkpointing
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
    # Python API only: functions called as fn(engine, groups) once the engine exists (hooks, probes).
    on_engine_ready: tuple = ()

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ValueError(f"--steps must be >= 0, got {self.steps}")
        if self.seq_length < 1:
            raise ValueError(f"--seq-length must be >= 1, got {self.seq_length}")
        if self.lr_decay not in ("cosine", "linear", "constant"):
            raise ValueError(f"--lr-decay must be cosine, linear or constant, got {self.lr_decay!r}")
        if self.on_nan not in ("stop", "skip"):
            raise ValueError(f"--on-nan must be stop or skip, got {self.on_nan!r}")
        if self.keep_last < 0:
            raise ValueError(f"--keep-last must be >= 0 (0 keeps every checkpoint), got {self.keep_last}")
        if self.activation_checkpointing < 0:
            raise ValueError("--activation-checkpointing takes a block interval >= 0")
        from mtds.pipe.select import check_schedule
        check_schedule(self.pipeline_schedule, pp=self.pp, virtual_stages=self.virtual_stages)
        object.__setattr__(self, "recompute", self._resolved_recompute())
        if self.recompute == "full" and not self.activation_checkpointing:
            object.__setattr__(self, "activation_checkpointing", 1)

    def _resolved_recompute(self) -> str:
        """One meaning for the two flags: --activation-checkpointing K is the interval of full recompute."""
        k, mode = self.activation_checkpointing, self.recompute
        if mode is None:
            return "full" if k else "none"
        if mode not in ("none", "selective", "full"):
            raise ValueError(f"--recompute must be none, selective or full, got {mode!r}")
        if k and mode != "full":
            raise ValueError(f"--activation-checkpointing {k} means --recompute full (every {k} blocks) and "
                             f"conflicts with --recompute {mode}: drop one of the two")
        return mode
