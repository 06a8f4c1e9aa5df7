"""Scheme specs on the command line -> what to launch.

    ptdp:tp=2,pp=2            Megatron TP x DeepSpeed pipeline, ZeRO-1 (ds_configs/cpu_fp32.json)
    ptdp:tp=2,pp=2,sp=1       ... with sequence parallelism (train.py --sequence-parallel)
    ptdp:tp=2,cp=2,comm=a2a   ... with context parallelism (train.py --cp, --cp-comm-type; comm= p2p default)
    ptdp:pp=2,schedule=interleaved,v=2
                              ... with another pipeline schedule (train.py --pipeline-schedule, --virtual-stages)
    zero3                     plain data parallelism with ZeRO-3 (ds_configs/cpu_zero3_fp32.json)
    zero1                     plain data parallelism with ZeRO-1 (ds_configs/cpu_fp32.json, tp=pp=1)
    hf-zero3                  HF transformers model under accelerate + DeepSpeed ZeRO-3 (compare.hf_entry)
    autotp:tp=2               HF model under accelerate + DeepSpeed AutoTP (tensor_parallel.autotp_size)
    ptdp:tp=2,config=my.json  any scheme can name its own DeepSpeed config
    zero1:grad_reduce=all-reduce
                              ... DeepSpeed's own ZeRO-1 gradient all-reduce (train.py --zero1-grad-reduce)
    megatron:tp=2,pp=2        Megatron-core's own GPT (TP, PP with its 1F1B schedule, its distributed optimizer
                              over the data-parallel ranks), in the peers' interpreter (make peers)
    torchtitan:tp=2,fsdp=2    torchtitan's Llama-3 (DTensor TP x FSDP2 over fsdp ranks; fsdp = ranks / tp);
                              trains a Llama model: model=llama-tiny unless --model is one
    autotp:tp=2,model=llama-tiny
                              any scheme can train another model than --model (a preset, a HF config.json,
                              or llama-tiny: compare/llama_tiny.json, gpt2-tiny's shape as a Llama); the
                              row is then compared with that model's own single-host run, not the others
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from mtds.parallel.choices import CP_COMM_TYPES

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIGS = {"ptdp": os.path.join(REPO, "ds_configs", "cpu_fp32.json"),
                   "zero3": os.path.join(REPO, "ds_configs", "cpu_zero3_fp32.json"),
                   "zero1": os.path.join(REPO, "ds_configs", "cpu_fp32.json"),
                   "hf-zero3": os.path.join(REPO, "ds_configs", "cpu_zero3_fp32.json"),
                   "autotp": os.path.join(REPO, "ds_configs", "cpu_fp32.json"),
                   # the peers read the batch, optimizer and clipping from the same config as ptdp
                   "megatron": os.path.join(REPO, "ds_configs", "cpu_fp32.json"),
                   "torchtitan": os.path.join(REPO, "ds_configs", "cpu_fp32.json")}
PEERS = ("megatron", "torchtitan")     # other frameworks, run by compare.peer_launch in their own interpreter
DATA_PARALLEL_ONLY = ("zero3", "zero1", "hf-zero3")     # tp = pp = 1
MODEL_ALIASES = {"llama-tiny": os.path.join(REPO, "compare", "llama_tiny.json")}


@dataclass(frozen=True)
class Scheme:
    kind: str           # "ptdp" | "zero3" | "zero1" | "hf-zero3" | "autotp" | "megatron" | "torchtitan"
    tp: int = 1
    pp: int = 1
    config: str = ""
    sp: int = 0         # 1: sequence parallelism over the TP group
    schedule: str = "1f1b"   # train.py --pipeline-schedule (ptdp with pp > 1)
    v: int = 1               # train.py --virtual-stages (interleaved)
    model: str = ""          # another model than the run's --model (an alias of MODEL_ALIASES, preset or file)
    grad_reduce: str = "reduce-scatter"   # train.py --zero1-grad-reduce (mtds's ZeRO-1 schemes)
    cp: int = 1              # train.py --context-parallel-size (ptdp)
    comm: str = "p2p"        # train.py --cp-comm-type (with cp > 1)
    fsdp: int = 0            # torchtitan: FSDP degree (0: ranks / tp)

    @property
    def name(self) -> str:
        return self._base_name + ("-allreduce" if self.grad_reduce == "all-reduce" else "") + \
            (f"-{self.model_label}" if self.model else "")

    @property
    def model_label(self) -> str:
        return os.path.splitext(os.path.basename(self.model.rstrip("/")))[0] if self.model else ""

    def model_path(self, default: str) -> str:
        """The model this scheme trains: its own (an alias resolved to the shipped file) or `default`."""
        return MODEL_ALIASES.get(self.model, self.model) if self.model else default

    @property
    def _base_name(self) -> str:
        if self.kind in DATA_PARALLEL_ONLY:
            return self.kind
        if self.kind == "autotp":
            return f"autotp-t{self.tp}"
        if self.kind == "megatron":
            return f"megatron-t{self.tp}p{self.pp}"
        if self.kind == "torchtitan":
            return f"torchtitan-t{self.tp}" + (f"f{self.fsdp}" if self.fsdp else "")
        schedule = "" if self.schedule == "1f1b" else f"-{self.schedule}" + (f"-v{self.v}" if self.v > 1 else "")
        cp = f"-c{self.cp}{self.comm}" if self.cp > 1 else ""
        return f"ptdp-t{self.tp}p{self.pp}" + cp + ("-sp" if self.sp else "") + schedule

    @property
    def hf(self) -> bool:
        """Runs the HuggingFace model through accelerate (compare.hf_entry), not train.py."""
        return self.kind in ("hf-zero3", "autotp")

    @property
    def peer(self) -> bool:
        """Another framework's scheme (compare.peer_launch), not mtds's or HF's."""
        return self.kind in PEERS

    @property
    def zero_stage(self) -> int:
        # FSDP2 shards parameters, gradients and optimizer states (ZeRO-3); Megatron's distributed
        # optimizer shards optimizer states (ZeRO-1)
        return 3 if self.kind in ("zero3", "hf-zero3", "torchtitan") else 1

    def data_parallel(self, world: int) -> int:
        """d = world / (t c p): the data-parallel ranks (the c ranks of a context group read the same data)."""
        mp = self.tp * self.pp * self.cp
        if self.fsdp and world != self.tp * self.fsdp:
            raise ValueError(f"{self.name}: tp x fsdp = {self.tp * self.fsdp} must equal the {world} ranks "
                             f"(--nproc, or nodes x ranks per node)")
        if world % mp:
            what = "tp x cp x pp" if self.cp > 1 else "tp x pp"
            raise ValueError(f"{self.name}: {world} ranks (--nproc, --gpus or nodes x ranks per node) are not divisible by {what} = {mp}")
        return world // mp


def parse_scheme(text: str) -> Scheme:
    kind, _, rest = text.partition(":")
    if kind not in DEFAULT_CONFIGS:
        raise ValueError(f"unknown scheme {text!r}: use ptdp[:tp=T,pp=P], zero3, zero1, hf-zero3, autotp:tp=T, "
                         f"megatron[:tp=T,pp=P] or torchtitan[:tp=T,fsdp=F]")
    fields = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in ("tp", "pp", "sp", "cp", "comm", "config", "schedule", "v", "model", "grad_reduce",
                                 "fsdp"):
            raise ValueError(f"bad option {item!r} in {text!r}: use tp=T, pp=P, sp=0|1, cp=C, comm=p2p|a2a, "
                             f"schedule=NAME, v=V, config=FILE, model=NAME|FILE, grad_reduce=reduce-scatter|all-reduce "
                             f"or fsdp=F (torchtitan)")
        fields[key] = value if key in ("config", "schedule", "model", "grad_reduce", "comm") else int(value)
    if ("cp" in fields or "comm" in fields) and kind != "ptdp":
        raise ValueError(f"{text!r}: cp= and comm= are context-parallel options of ptdp schemes")
    if fields.get("comm", "p2p") not in CP_COMM_TYPES or fields.get("cp", 1) < 1:
        raise ValueError(f"{text!r}: cp= is a positive size and comm= p2p or a2a")
    if fields.get("grad_reduce", "reduce-scatter") not in ("reduce-scatter", "all-reduce") or \
            ("grad_reduce" in fields and kind in ("zero3", "hf-zero3", "autotp", *PEERS)):
        raise ValueError(f"{text!r}: grad_reduce= is reduce-scatter or all-reduce, for mtds's ZeRO-1 schemes "
                         f"(ptdp, zero1)")
    if kind != "ptdp" and ("schedule" in fields or "v" in fields):
        raise ValueError(f"{text!r}: schedule= and v= are pipeline options of ptdp schemes")
    if "schedule" in fields or "v" in fields:
        from mtds.rules.schedule import chunks_problem, name_problem   # the rulebook's, before anything launches
        name = fields.get("schedule", "1f1b")
        problem = name_problem(name) or chunks_problem(name, fields.get("pp", 1), fields.get("v", 1))
        if problem is not None:
            raise ValueError(problem)
    if kind in PEERS:
        _check_peer(kind, fields, text)
    elif "fsdp" in fields:
        raise ValueError(f"{text!r}: fsdp= is the FSDP degree of torchtitan schemes")
    if kind in DATA_PARALLEL_ONLY and (fields.get("tp", 1) != 1 or fields.get("pp", 1) != 1 or fields.get("sp", 0)):
        raise ValueError(f"{kind} runs with tp=1, pp=1 (data parallelism only)")
    if kind == "autotp" and (fields.get("pp", 1) != 1 or fields.get("sp", 0)):
        raise ValueError("autotp runs with pp=1 and no sequence parallelism (DeepSpeed AutoTP has neither)")
    if kind == "autotp":
        fields.setdefault("tp", 2)
    if fields.get("sp", 0) and fields.get("tp", 1) < 2:
        raise ValueError(f"{text!r}: sequence parallelism (sp=1) needs tp > 1")
    fields.setdefault("config", DEFAULT_CONFIGS[kind])
    return Scheme(kind, **fields)


def _check_peer(kind: str, fields: dict, text: str) -> None:
    """What the peers' schemes run here: Megatron-core TP x PP x DP; torchtitan TP x FSDP (its pipeline
    schedules and the sequence parallelism of either are not wired into compare/peer_entry.py)."""
    if fields.get("sp", 0) or "schedule" in fields or "v" in fields or "cp" in fields:
        raise ValueError(f"{text!r}: the peer schemes take tp=, pp= (megatron), fsdp= (torchtitan), model= and "
                         f"config=; sequence, context parallelism and other schedules are not wired for them")
    if kind == "megatron" and "fsdp" in fields:
        raise ValueError(f"{text!r}: fsdp= is torchtitan's; Megatron-core's data parallelism is ranks / (tp x pp)")
    if kind == "torchtitan" and fields.get("pp", 1) != 1:
        raise ValueError(f"{text!r}: torchtitan runs tp x fsdp here (its pipeline schedules are not wired on CPU)")
    if kind == "torchtitan" and fields.get("fsdp", 1) < 1:
        raise ValueError(f"{text!r}: fsdp= is a positive FSDP degree")


def for_run(scheme: Scheme, run_model: str) -> Scheme:
    """A torchtitan scheme trains Llama models only: given a run of another family, it trains llama-tiny
    (then compared with llama-tiny's own rows and reference, as any scheme with model=)."""
    if scheme.kind != "torchtitan" or scheme.model:
        return scheme
    from dataclasses import replace

    from mtds.hf.resolve import resolve_model_config
    return scheme if resolve_model_config(run_model).architecture == "llama" else replace(scheme, model="llama-tiny")
