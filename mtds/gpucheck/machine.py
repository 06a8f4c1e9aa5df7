"""Which device the check runs on, how many ranks it may use, and the versions it reports.

``auto`` is CUDA (NCCL, one rank per GPU) wherever torch sees a GPU, else CPU (gloo); nothing below
picks CPU unless asked or unless no GPU is there.
"""
from __future__ import annotations

from dataclasses import dataclass

CPU_WORLD = 2           # gloo ranks on CPU: enough for p = 2; more only costs time on a small machine
MAX_GPUS = 8


@dataclass(frozen=True)
class Machine:
    device: str                 # "cpu" | "cuda"
    ranks: int                  # ranks the checks may use (GPUs on CUDA)
    name: str                   # torch.cuda.get_device_name, or "CPU"

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"


def resolve(device: str, gpus: int | None) -> Machine:
    """The machine for ``--device``/``--gpus``; ``ValueError`` (one line, with the fix) otherwise."""
    import torch
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"--device must be auto, cpu or cuda, got {device!r}")
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "auto":
        device = "cuda" if have else "cpu"
    if device == "cuda" and not have:
        raise ValueError("--device cuda: torch sees no GPU (torch.cuda.is_available() is False); install a CUDA "
                         "build of torch or use --device cpu")
    if gpus is not None and not 1 <= gpus <= MAX_GPUS:
        raise ValueError(f"--gpus must be between 1 and {MAX_GPUS}, got {gpus}")
    if device == "cpu":
        if gpus is not None:
            raise ValueError("--gpus applies to --device cuda (CPU runs use 2 gloo ranks): drop --gpus")
        return Machine("cpu", CPU_WORLD, "CPU")
    if gpus is not None and gpus > have:
        raise ValueError(f"--gpus {gpus}: only {have} GPU(s) visible (one rank per GPU); use --gpus {have} or fewer")
    return Machine("cuda", min(gpus or have, MAX_GPUS), torch.cuda.get_device_name(0))


def versions() -> dict[str, str]:
    """torch, CUDA, NCCL, DeepSpeed, transformers and Python versions (what the report names)."""
    import platform

    import torch
    out = {"python": platform.python_version(), "torch": torch.__version__}
    out["cuda"] = torch.version.cuda or "none (CPU build)"
    try:
        nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else None
        out["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl or "n/a (no GPU)")
    except Exception as err:      # a torch built without NCCL
        out["nccl"] = f"n/a ({type(err).__name__})"
    for module in ("deepspeed", "transformers"):
        try:
            out[module] = __import__(module).__version__
        except Exception as err:
            out[module] = f"missing ({type(err).__name__})"
    return out
