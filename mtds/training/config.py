"""Everything one training run needs, as one frozen value (the CLI builds it; Python users too).

Run settings only: what a caller wants to observe or inject (test probes) goes to ``run(cfg, ...)``.
Each field is its option's one definition (mtds.training.options): train.py's flags and their help come
from it, and so does each numeric setting's range, checked here with one line naming the flag. Fields
stand in --help's sections and order. Checked here: each flag's own value, and flags that only qualify another
flag; what the job combines (layout, model, schedule, DeepSpeed config, features) is the rulebook's (mtds.rules),
asked at the start of ``run`` (mtds.training.admit).
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass
from typing import Any

from mtds.parallel.choices import CP_COMM_TYPES, RECOMPUTE_MODES
from mtds.training.options import check_ranges, opt

ZERO1_GRAD_REDUCE = ("reduce-scatter", "all-reduce")
ZERO2_PIPELINE_REDUCE = ("micro-batch", "step")
ZERO3_PIPELINE_GATHER = ("step", "micro-batch")
LR_DECAYS = ("cosine", "linear", "constant")
ON_NAN = ("stop", "skip")
CE_FUSION_IMPLS = ("native",)       # mtds.tp.cross_entropy's impl= values
PIPELINE_BALANCES = ("uniform", "cost")
# --help's sections, in its order
LAYOUT, DATA, OPTIM, LOGS = "layout and model", "data", "optimisation", "checkpoints and logs"


@dataclass(frozen=True)
class TrainConfig:
    # layout and model
    deepspeed_config: Any = opt(                # path to DeepSpeed JSON, or the dict itself
        MISSING, "--deepspeed_config", "--deepspeed-config", section=LAYOUT,
        help="DeepSpeed JSON (batch sizes, precision, ZeRO stage, optimizer); see ds_configs/")
    tp: int = opt(
        1, "--tensor-model-parallel-size", "--tp", section=LAYOUT, at_least=1,
        help="tensor parallel size t (must divide attention heads) [1]")
    pp: int = opt(
        1, "--pipeline-model-parallel-size", "--pp", section=LAYOUT, at_least=1,
        help="pipeline stages p (ZeRO-2/3 at p > 1: see --zero2-pipeline-reduce, --zero3-pipeline-gather) [1]")
    pipeline_schedule: str = opt(               # 1f1b, dualpipev (DeepSpeed engines) | interleaved (mtds.pipe.engine)
        "1f1b", "--pipeline-schedule", section=LAYOUT, metavar="NAME",
        help="pipeline schedule: 1f1b (DeepSpeed's engine), interleaved (PTD-P interleaved 1F1B on "
             "mtds's engine: bubble (p-1)/(v m); needs --virtual-stages >= 2 and micro-batches >= "
             "--pp), zb-h1 (zero-bubble H1 on mtds's engine: weight gradients of the TP linears deferred to fill "
             "the bubble; micro-batches >= --pp) or dualpipev (DeepSpeed's DualPipeVEngine; "
             "micro-batches >= 2 pp) [1f1b]")
    virtual_stages: int = opt(
        1, "--virtual-stages", section=LAYOUT, at_least=1, metavar="V",
        help="model chunks per pipeline rank for --pipeline-schedule interleaved [1]")
    pipeline_layout: str | None = opt(          # blocks per virtual stage, e.g. "Et*3|t*3|t*2L" (mtds.parallel.pipeline_layout)
        None, "--pipeline-layout", section=LAYOUT, metavar="LAYOUT",
        help="transformer blocks per virtual stage, Megatron-style: E embedding, t block, L final norm "
             "+ LM head + loss, | next stage, X*n repeats, (...) groups; E first, L last, p x v stages "
             "(dualpipev: 2p, in V order), e.g. 'Et*3|t*3|t*2L' or 'E|t*4|t*4|L' [--pipeline-balance]")
    pipeline_balance: str | None = opt(         # None: mtds.training.stage_plan.DEFAULT_BALANCE
        None, "--pipeline-balance", section=LAYOUT, choices=PIPELINE_BALANCES,
        help="without --pipeline-layout: uniform = the same number of blocks per stage; cost = split by "
             "the planner's per-layer cost (embedding, blocks, final norm, LM head and loss, forward + "
             "backward) with every rank's predicted memory within the device's [cost]")
    sequence_parallel: bool = opt(
        False, "--sequence-parallel", section=LAYOUT,
        help="sequence parallelism (Korthikanti et al. 2022): layer norms, dropout and residuals work "
             "on 1/t of the sequence, saving activation memory; all-gathers and reduce-scatters replace "
             "the all-reduces, plus one all-gather per column-parallel linear in backward (only the "
             "input slice is kept); same losses. Needs t > 1 dividing --seq-length")
    context_parallel_size: int = opt(           # c: every sequence split over c ranks for the whole model (mtds.cp)
        1, "--context-parallel-size", "--cp", section=LAYOUT, at_least=1, metavar="C",
        help="context parallel size c: every sequence is split over c ranks (2c chunks, rank i holding "
             "chunks i and 2c-1-i, so causal attention costs each rank the same); their gradients are "
             "summed with the data-parallel ones. Layout (t, c, p, d), world = t*c*p*d, the c ranks "
             "adjacent after TP. Needs --seq-length divisible by 2c [1]")
    cp_comm_type: str = opt(                    # p2p: ring attention | a2a: Ulysses all-to-all (mtds.cp)
        "p2p", "--cp-comm-type", section=LAYOUT, choices=CP_COMM_TYPES,
        help="attention across the context-parallel ranks: p2p = ring attention (K/V passed around the "
             "ring, overlapped with the block compute; any head count), a2a = all-to-all from sequence to "
             "head split and back (DeepSpeed-Ulysses; heads and KV heads per TP rank divisible by c) [p2p]")
    expert_model_parallel_size: int = opt(      # e: an MoE model's experts split over e data-parallel ranks
        1, "--expert-model-parallel-size", "--ep", section=LAYOUT, at_least=1, metavar="E",
        help="expert parallel size e (mixture-of-experts models): the experts are split over e of the d "
             "data-parallel ranks (consecutive data ranks, as DeepSpeed's expert groups), tokens sent to their "
             "experts' ranks and back by all-to-all; e divides d and the number of experts. ZeRO-0/1/2 (16-bit: "
             "ZeRO-1/2), no checkpoints yet (docs/moe.md) [1]")
    overlap_moe_expert_parallel_comm: bool = opt(   # mtds.model.moe; on dualpipev also mtds.pipe.dualpipev_overlap
        False, "--overlap-moe-expert-parallel-comm", section=LAYOUT,
        help="MoE models with --expert-model-parallel-size > 1 (Megatron-core's flag). With a shared expert "
             "(Qwen2-MoE, DeepSeek-V3): issue each block's dispatch all-to-all without waiting and compute the "
             "shared expert while the tokens travel, waiting only before the routed experts read them (not with "
             "--sequence-parallel). On --pipeline-schedule dualpipev also, any MoE model: run each steady-state "
             "forward of one phase beside the other phase's backward (a second thread, the all-to-alls' backward "
             "on a duplicate expert group), so one chunk's all-to-all overlaps the other chunk's compute (fp32, "
             "ZeRO-0/1, --tp 1, no CP, recompute or dropout). The same values; the shared-expert overlap's "
             "backward sums two branches in another order, so gradients may differ in the last bits. Off by "
             "default")
    moe_z_loss_coeff: float = opt(              # Megatron-core's router z-loss (ST-MoE), mtds.model.aux_loss
        0.0, "--moe-z-loss-coeff", section=LAYOUT, at_least=0, metavar="C",
        help="MoE models: add C x the router z-loss to the training loss, per MoE block the mean over its "
             "tokens of logsumexp(router logits)^2 (float32, before the softmax), summed over the blocks, as "
             "Megatron-core; logged as moe_z_loss (without C, averaged over the blocks). Not in HF's "
             "Mixtral / Qwen3-MoE loss (docs/moe.md) [0: off]")
    moe_router_load_balancing_type: str = opt(  # Megatron-core's, mtds.model.aux_loss
        "aux_loss", "--moe-router-load-balancing-type", section=LAYOUT, choices=("aux_loss", "seq_aux_loss"),
        help="MoE models: aux_loss = transformers' load-balancing loss x the HF config's router_aux_loss_coef "
             "(pooled over the blocks); seq_aux_loss = Megatron-core's per-sequence loss x --moe-aux-loss-coeff "
             "instead: per block the mean over the micro-batch's sequences of sum_e f_e P_e (f_e = the "
             "sequence's assignments to e x E / (s k), P_e = e's mean probability over its tokens), summed over "
             "the blocks; --pp 1 and --cp 1 only (docs/moe.md) [aux_loss]")
    moe_aux_loss_coeff: float = opt(
        0.0, "--moe-aux-loss-coeff", section=LAYOUT, at_least=0, metavar="C",
        help="with --moe-router-load-balancing-type seq_aux_loss: its weight C [0]")
    moe_expert_capacity_factor: float | None = opt(   # Megatron-core's capacity, mtds.model.capacity
        None, "--moe-expert-capacity-factor", section=LAYOUT, above=0, metavar="F",
        help="MoE models: each expert takes at most ceil(N*k/E*F) of the assignments of the N tokens each "
             "router call sees (this rank's; its slice with --sequence-parallel), as Megatron-core; the rest "
             "are dropped (the token keeps its residual). This departs from HF's dropless Mixtral / Qwen3-MoE "
             "(docs/moe.md) [none: dropless]")
    moe_token_drop_policy: str = opt(
        "probs", "--moe-token-drop-policy", section=LAYOUT, choices=("probs", "position"),
        help="with --moe-expert-capacity-factor, which assignments an expert keeps: probs = its largest "
             "routing weights, position = the earliest tokens (Megatron's [s, b] order) [probs]")
    moe_router_enable_expert_bias: bool = opt(  # Megatron-core's aux-loss-free balancing, mtds.training.expert_bias
        False, "--moe-router-enable-expert-bias", section=LAYOUT,
        help="MoE models whose router has an expert bias (DeepSeek-V3's e_score_correction_bias, sigmoid "
             "scores): move it during training by --moe-router-bias-update-rate (Megatron-core's aux-loss-free "
             "balancing; docs/moe.md) [off: the bias stays as loaded, as transformers keeps it]")
    moe_router_bias_update_rate: float = opt(
        1e-3, "--moe-router-bias-update-rate", section=LAYOUT, at_least=0, metavar="R",
        help="with --moe-router-enable-expert-bias: after each step every MoE block's bias moves by R x "
             "sign(mean load - load of the expert), the loads counted over the step's tokens of all ranks "
             "[1e-3, Megatron-core's]")
    model: Any = opt(                           # preset name, HF config.json/dir, ModelConfig; None: see world.py
        None, "--model", section=LAYOUT,
        help="preset (gpt2-tiny, gpt2-small, gpt2-medium, gpt2-large, gpt2-xl) or a HF config.json "
             "file/directory [the model the --load checkpoint records, else the --init-from-hf directory, "
             "else gpt2-tiny]")
    init_from_hf: str | None = opt(
        None, "--init-from-hf", section=LAYOUT, metavar="DIR",
        help="start from HuggingFace weights in DIR (each rank reads only its layers and shards)")
    model_overrides: dict = opt(                # e.g. {"hidden_dropout": 0.1}
        factory=dict, no_flag="any ModelConfig key from Python; train.py's --dropout sets two (cli.py)")
    recompute: str = opt(                       # none | selective (attention core) | full (whole blocks)
        "none", "--recompute", "--recompute-granularity", section=LAYOUT, choices=RECOMPUTE_MODES,
        help="activation recomputation in backward: selective = the attention core (scores, softmax, "
             "dropout; Korthikanti et al. 2022), full = whole blocks, --recompute-interval at a time "
             "[none]")
    recompute_interval: int = opt(              # full: every N consecutive blocks are recomputed as one unit
        1, "--recompute-interval", "--recompute-num-layers", section=LAYOUT, at_least=1, metavar="N",
        help="with --recompute full: every N consecutive blocks are recomputed as one "
             "unit (only each unit's input is kept) [1]")
    compile: bool = opt(                        # torch.compile each transformer layer (mtds.model.compile)
        False, "--compile", section=LAYOUT,
        help="torch.compile each transformer layer (CPU: Inductor's C++ backend, needs a C++ compiler; "
             "the first steps pay the compilation) [off]")
    cross_entropy_loss_fusion: bool = opt(      # the fused, torch.compile'd loss (mtds.tp.fused_cross_entropy)
        False, "--cross-entropy-loss-fusion", section=LAYOUT,
        help="vocab-parallel cross entropy in torch.compile'd (Inductor) pieces, as Megatron's flag: no float32 "
             "copy of the logits, one all-reduce of [2, b s] instead of two of [b s]; same losses within "
             "float32 rounding. Compiles on the first step (CPU: a C++ compiler, ~10 s cold); faster on a GPU "
             "is not yet measured (make gpu-bench) [off]")
    cross_entropy_fusion_impl: str = opt(       # Megatron's native | te; te (Transformer Engine) is not built
        "native", "--cross-entropy-fusion-impl", section=LAYOUT, choices=CE_FUSION_IMPLS,
        help="with --cross-entropy-loss-fusion: native = torch.compile'd pieces (Megatron's te is not "
             "built) [native]")
    seed: int = opt(
        1234, "--seed", section=LAYOUT, at_least=0,
        help="weights, data order and dropout all follow it [1234]")
    # data
    data: str | None = opt(
        None, "--data", section=DATA,
        help="text/json/jsonl/csv/parquet file or directory, a save_to_disk directory, or a "
             "datasets hub name [shipped Shakespeare corpus]")
    data_path: tuple | None = opt(              # Megatron indexed data: (PREFIX,) or (W1, PREFIX1, W2, PREFIX2, ...)
        None, "--data-path", section=DATA, nargs="+", metavar="[W] PREFIX",
        help="Megatron indexed data (PREFIX.bin/.idx from mtds-preprocess or Megatron): one PREFIX, or "
             "weight prefix pairs to blend, e.g. 0.3 A 0.7 B (instead of --data)")
    eval_data_path: tuple | None = opt(         # same syntax, for evaluation (else --eval-split of each source)
        None, "--eval-data-path", section=DATA, nargs="+", metavar="[W] PREFIX",
        help="indexed evaluation data, same syntax (default: --eval-split of each source's documents)")
    eod_mask_loss: bool = opt(                  # no loss where the input token is EOS (Megatron's --eod-mask-loss)
        False, "--eod-mask-loss", section=DATA,
        help="no loss where the input token is the tokenizer's EOS (end of document), as Megatron's")
    reset_position_ids: bool = opt(             # positions restart after each EOS (Megatron's --reset-position-ids)
        False, "--reset-position-ids", section=DATA,
        help="positions restart at 0 after each EOS: every packed document starts at position 0")
    reset_attention_mask: bool = opt(
        False, "--reset-attention-mask", section=DATA,
        help="each packed document attends only to its own tokens (block-diagonal causal mask)")
    text_column: str = opt(
        "text", "--text-column", section=DATA, help="field holding the text [text]")
    tokenizer: str | None = opt(
        None, "--tokenizer", section=DATA, help="HF tokenizer name or path [shipped byte-level BPE]")
    seq_length: int = opt(
        128, "--seq-length", section=DATA, at_least=1, help="tokens per sample [128]")
    num_proc: int = opt(
        1, "--num-proc", section=DATA, at_least=1, help="processes for tokenization [1]")
    eval_split: float = opt(
        0.02, "--eval-split", section=DATA, at_least=0, below=1, note=" (the fraction held out)",
        help="fraction held out for evaluation [0.02]")
    eval_data: str | None = opt(
        None, "--eval-data", section=DATA, help="separate evaluation data (instead of --eval-split)")
    eval_interval: int = opt(
        0, "--eval-interval", section=DATA, at_least=0, note=" (0: evaluate at the end only)",
        help="evaluate every N steps (0: at the end) [0]")
    eval_iters: int = opt(
        4, "--eval-iters", section=DATA, at_least=1, help="global batches per evaluation [4]")
    # optimisation
    steps: int = opt(
        100, "--steps", "--train-iters", section=OPTIM, at_least=0, help="optimizer steps [100]")
    global_batch_size: int | None = opt(        # overrides train_batch_size (Megatron's --global-batch-size)
        None, "--global-batch-size", section=OPTIM, metavar="B",
        help="sequences per optimizer step over all data-parallel ranks (overrides the DeepSpeed "
             "config's train_batch_size; accumulation = B / (micro batch x dp))")
    micro_batch_size: int | None = opt(         # overrides train_micro_batch_size_per_gpu (--micro-batch-size)
        None, "--micro-batch-size", section=OPTIM, metavar="b",
        help="sequences per micro-batch per rank (overrides train_micro_batch_size_per_gpu)")
    lr: float | None = opt(                     # overrides optimizer.params.lr
        None, "--lr", section=OPTIM, above=0, help="peak learning rate (overrides the DeepSpeed config)")
    min_lr: float = opt(
        0.0, "--min-lr", section=OPTIM, at_least=0, help="learning rate at the end of decay [0]")
    warmup_steps: int = opt(
        0, "--warmup-steps", "--lr-warmup-iters", section=OPTIM, at_least=0, help="linear warm-up steps [0]")
    lr_decay: str = opt(
        "cosine", "--lr-decay", "--lr-decay-style", section=OPTIM, choices=LR_DECAYS,
        help="decay after warm-up (unless the DeepSpeed config has a scheduler) [cosine]")
    # Megatron's flags for settings the DeepSpeed JSON owns: given, they override it (the header names them)
    bf16: bool = opt(
        False, "--bf16", section=OPTIM, help="train in bf16: sets the DeepSpeed config's bf16.enabled (fp16 off)")
    fp16: bool = opt(
        False, "--fp16", section=OPTIM,
        help="train in fp16 with dynamic loss scaling: sets fp16.enabled (bf16 off)")
    clip_grad: float | None = opt(
        None, "--clip-grad", section=OPTIM, at_least=0, metavar="NORM",
        help="clip gradients to this global norm, 0 off (sets the DeepSpeed config's gradient_clipping)")
    weight_decay: float | None = opt(
        None, "--weight-decay", section=OPTIM, at_least=0, metavar="WD",
        help="the optimizer's weight decay (sets optimizer.params.weight_decay)")
    zero1_grad_reduce: str = opt(               # ZeRO-1 gradients: reduce-scatter (mtds) | all-reduce (DeepSpeed's)
        "reduce-scatter", "--zero1-grad-reduce", section=OPTIM, choices=ZERO1_GRAD_REDUCE,
        help="ZeRO-1's data-parallel gradient reduction: reduce-scatter, each rank summing only the "
             "partition it updates (2(d-1)/d x the parameters' bytes per step with the all-gather), or "
             "DeepSpeed's own all-reduce (3(d-1)/d) [reduce-scatter]")
    zero2_pipeline_reduce: str = opt(           # ZeRO-2 at --pp > 1: when the gradient partitions are reduced
        "micro-batch", "--zero2-pipeline-reduce", section=OPTIM, choices=ZERO2_PIPELINE_REDUCE,
        help="ZeRO-2 with --pp > 1: reduce-scatter each micro-batch's gradients into the rank's partition "
             "(micro-batch: no whole gradient kept between micro-batches, m x the reduce-scatter's bytes), or "
             "once after the stage's last backward (step: ZeRO-1's bytes and memory) [micro-batch]")
    zero3_pipeline_gather: str = opt(           # ZeRO-3 at --pp > 1: when the stage's parameters are gathered
        "step", "--zero3-pipeline-gather", section=OPTIM, choices=ZERO3_PIPELINE_GATHER,
        help="ZeRO-3 with --pp > 1: gather the stage's parameters once per step at its first forward and free "
             "them after its last backward, gradients reduce-scattered once (step: ZeRO-1's bytes), or gather "
             "before and free after every forward and backward, gradients reduce-scattered per micro-batch "
             "(micro-batch: least memory, 2m all-gathers a step, each issued before its pass's receive so it "
             "overlaps the wait for the other stage) [step]")
    # checkpoints and logs
    save: str | None = opt(
        None, "--save", section=LOGS, metavar="DIR", help="checkpoint directory")
    save_interval: int = opt(
        0, "--save-interval", section=LOGS, at_least=0, note=" (0: save at the end only)",
        help="save every N steps (and at the end) [0]")
    async_save: bool = opt(
        False, "--async-save", section=LOGS, action="store_true",
        help="save checkpoints without stopping training: each rank copies its state to host memory at the "
             "step boundary and a background thread writes it; the checkpoint becomes the one --load finds once "
             "every rank's files are durable (checked at later step boundaries); one save in flight at most, "
             "the last one (and a SIGTERM's) complete before exit")
    keep_last: int = opt(
        0, "--keep-last", section=LOGS, at_least=0, note=" (0 keeps every checkpoint)", metavar="K",
        help="after each complete save delete all but the newest K complete checkpoints [0: keep all]")
    load: str | None = opt(
        None, "--load", section=LOGS, metavar="DIR",
        help="resume from the newest complete checkpoint in DIR (or the global_stepN folder given), naming any "
             "incomplete one skipped; a DIR that does not exist or is empty starts from scratch, so --save DIR "
             "--load DIR both starts and restarts a job")
    log_jsonl: str | None = opt(
        None, "--log-jsonl", section=LOGS, metavar="FILE", help="one JSON object per step (and per evaluation)")
    tensorboard: str | None = opt(
        None, "--tensorboard", "--tensorboard-dir", section=LOGS, metavar="DIR", help="TensorBoard scalars")
    plot: str | None = opt(
        None, "--plot", section=LOGS, metavar="PNG",
        help="write loss / learning-rate / throughput curves here at the end")
    timeline: str | None = opt(                 # Chrome trace JSON (+ .png Gantt) of the last step; bubble per step
        None, "--timeline", section=LOGS, metavar="JSON",
        help="pipeline timeline: measured bubble per stage in every step's log; the last step as a "
             "Chrome trace (open in Perfetto) here and a Gantt chart PNG next to it")
    profile_step: int | None = opt(             # profile this step (torch.profiler; mtds.observe.step_profile)
        None, "--profile-step", section=LOGS, metavar="N",
        help="profile step N with torch.profiler (CPU, and CUDA on GPUs): one console line of where its "
             "time went by kind of work (GEMM, attention, element-wise, copies, reductions, norms, "
             "optimizer, collectives), kernel count and how busy the device was")
    profile_trace: str | None = opt(            # its Chrome trace, one file per rank (.rankR before the suffix)
        None, "--profile-trace", section=LOGS, metavar="JSON",
        help="with --profile-step: that step's Chrome trace, one file per rank (FILE.rankR.json)")
    progress: bool | None = opt(                # None: a bar when stdout is a TTY
        None, "--no-progress", section=LOGS, action="store_false", help="no progress bar even on a terminal")
    check_replicas_interval: int = opt(         # verify TP-replicated/tied weights agree every N steps
        0, "--check-replicas", section=LOGS, at_least=0, note=" (0: off)", metavar="N",
        help="every N steps verify TP-replicated and tied weights are identical [off]")
    trace_comm: bool = opt(                     # count bytes per collective (cheap)
        True, no_flag="cheap, so always on for train.py; benchmarks and tests switch it off from Python")
    dist_timeout_s: float = opt(
        600.0, "--dist-timeout", section=LOGS, above=0, note=" seconds",
        help="seconds before a collective gives up [600]")
    on_nan: str = opt(
        "stop", "--on-nan", section=LOGS, choices=ON_NAN,
        help="a NaN/inf loss or grad norm (bf16/fp32): stop with one line naming the step and the ranks "
             "whose own gradients were non-finite, saving nothing, or skip steps the optimizer did not "
             "apply (ZeRO-1/2) [stop]")
    save_on_signal: bool = opt(                 # SIGTERM/SIGINT: finish the step, save (with --save), exit 0
        True, "--no-save-on-signal", section=LOGS, action="store_false",
        help="on SIGTERM/SIGINT stop after the current step without saving (default: save with --save)")
    log_straggler: bool = opt(
        False, "--log-straggler", section=LOGS, action="store_true",
        help="every --straggler-interval steps gather each rank's step time split into compute and waiting in "
             "collectives, and name a rank whose compute exceeds --straggler-factor x the median rank's (log, "
             "JSONL, TensorBoard)")
    straggler_interval: int = opt(
        10, "--straggler-interval", section=LOGS, at_least=1, metavar="N",
        help="with --log-straggler: steps per straggler report [10]")
    straggler_factor: float = opt(
        1.5, "--straggler-factor", section=LOGS, above=1, metavar="F",
        help="with --log-straggler: a rank computing more than F x the median rank's time per step is named [1.5]")
    heartbeat_timeout_s: float = opt(
        30.0, "--heartbeat-timeout", section=LOGS, at_least=0, note=" seconds (0: off)", metavar="S",
        help="stop (exit 1, naming the rank) when a peer rank is silent this long: dead or frozen where no "
             "socket says so; 0 turns the watchdog off [30]")
    build_lock_timeout_s: float = opt(
        300.0, "--build-lock-timeout", section=LOGS, above=0, note=" seconds", metavar="S",
        help="fail start-up when a torch-extensions build lock is waited on for S seconds [300]")

    def __post_init__(self) -> None:
        check_ranges(self)
        if self.lr_decay not in LR_DECAYS:
            raise ValueError(f"--lr-decay must be cosine, linear or constant, got {self.lr_decay!r}")
        if self.zero1_grad_reduce not in ZERO1_GRAD_REDUCE:
            raise ValueError(f"--zero1-grad-reduce must be reduce-scatter or all-reduce, got {self.zero1_grad_reduce!r}")
        if self.zero2_pipeline_reduce not in ZERO2_PIPELINE_REDUCE:
            raise ValueError(f"--zero2-pipeline-reduce must be micro-batch or step, got {self.zero2_pipeline_reduce!r}")
        if self.zero3_pipeline_gather not in ZERO3_PIPELINE_GATHER:
            raise ValueError(f"--zero3-pipeline-gather must be step or micro-batch, got {self.zero3_pipeline_gather!r}")
        if self.bf16 and self.fp16:
            raise ValueError("--bf16 and --fp16 both given: choose one precision")
        if self.cp_comm_type not in CP_COMM_TYPES:
            raise ValueError(f"--cp-comm-type must be p2p or a2a, got {self.cp_comm_type!r}")
        if self.moe_token_drop_policy not in ("probs", "position"):
            raise ValueError(f"--moe-token-drop-policy must be probs or position, got {self.moe_token_drop_policy!r}")
        if self.moe_token_drop_policy != "probs" and self.moe_expert_capacity_factor is None:
            raise ValueError("--moe-token-drop-policy applies with --moe-expert-capacity-factor F only: add it or "
                             "drop the policy")
        if self.on_nan not in ON_NAN:
            raise ValueError(f"--on-nan must be stop or skip, got {self.on_nan!r}")
        if self.cross_entropy_fusion_impl not in CE_FUSION_IMPLS:
            raise ValueError(f"--cross-entropy-fusion-impl must be native (te is not built), got "
                             f"{self.cross_entropy_fusion_impl!r}")
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
        self._check_stage_layout()

    def _check_stage_layout(self) -> None:
        if self.pipeline_balance not in (None, *PIPELINE_BALANCES):
            raise ValueError(f"--pipeline-balance must be uniform or cost, got {self.pipeline_balance!r}")
        if self.pipeline_layout is not None and self.pipeline_balance is not None:
            raise ValueError(f"--pipeline-layout fixes the partition; --pipeline-balance {self.pipeline_balance} "
                             f"would choose another: give one of the two")
