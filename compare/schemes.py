"""Scheme specs on the command line -> what to launch.

    ptdp:tp=2,pp=2            Megatron TP x DeepSpeed pipeline, ZeRO-1 (ds_configs/cpu_fp32.json)
    ptdp:tp=2,pp=2,sp=1       ... with sequence parallelism (train.py --sequence-parallel)
    zero3                     plain data parallelism with ZeRO-3 (ds_configs/cpu_zero3_fp32.json)
    ptdp:tp=2,config=my.json  any scheme can name its own DeepSpeed config
"""
from __future__ import annotations

import os
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIGS = {"ptdp": os.path.join(REPO, "ds_configs", "cpu_fp32.json"),
                   "zero3": os.path.join(REPO, "ds_configs", "cpu_zero3_fp32.json")}


@dataclass(frozen=True)
class Scheme:
    kind: str           # "ptdp" | "zero3"
    tp: int = 1
    pp: int = 1
    config: str = ""
    sp: int = 0         # 1: sequence parallelism over the TP group

    @property
    def name(self) -> str:
        return "zero3" if self.kind == "zero3" else f"ptdp-t{self.tp}p{self.pp}" + ("-sp" if self.sp else "")

    def data_parallel(self, world: int) -> int:
        if world % (self.tp * self.pp):
            raise ValueError(f"{self.name}: --nproc {world} is not divisible by tp x pp = {self.tp * self.pp}")
        return world // (self.tp * self.pp)


def parse_scheme(text: str) -> Scheme:
    kind, _, rest = text.partition(":")
    if kind not in DEFAULT_CONFIGS:
        raise ValueError(f"unknown scheme {text!r}: use ptdp[:tp=T,pp=P] or zero3")
    fields = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in ("tp", "pp", "sp", "config"):
            raise ValueError(f"bad option {item!r} in {text!r}: use tp=T, pp=P, sp=0|1 or config=FILE")
        fields[key] = value if key == "config" else int(value)
    if kind == "zero3" and (fields.get("tp", 1) != 1 or fields.get("pp", 1) != 1 or fields.get("sp", 0)):
        raise ValueError("zero3 runs with tp=1, pp=1 (DeepSpeed's ZeRO-3 cannot combine with its pipeline)")
    if fields.get("sp", 0) and fields.get("tp", 1) < 2:
        raise ValueError(f"{text!r}: sequence parallelism (sp=1) needs tp > 1")
    fields.setdefault("config", DEFAULT_CONFIGS[kind])
    return Scheme(kind, **fields)
