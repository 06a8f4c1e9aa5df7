"""Weight-mapping tables: one row per (our global layer, our parameter) <-> HF key(s) + a transform.

Tensors on our side are *full* (unsharded, unpadded) logical weights in nn.Linear [out, in] layout,
with fused projections in segment order: QKV as [q | k | v], SwiGLU input as [gate | up].
Every transform is a pure permutation/concatenation, so HF -> ours -> HF is bit-exact.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Mapping

import torch

TRANSFORMS = ("copy", "transpose", "neox_qkv", "concat", "experts", "interleaved_glu")


@dataclass(frozen=True)
class WeightMap:
    layer: int                    # our global layer index (0 emb, 1..L blocks, L+1 final norm, L+2 head)
    name: str                     # parameter name inside that layer's module, e.g. "attention.qkv.weight"
    hf_keys: tuple[str, ...]      # HF state-dict key(s) holding this tensor
    transform: str = "copy"
    heads: int = 0                # neox_qkv: number of attention heads
    sizes: tuple[int, ...] = ()   # concat: size of each HF piece along dim 0; experts: of each expert's pieces

    def to_ours(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        if self.transform == "copy":
            return tensors[0]
        if self.transform == "transpose":        # GPT-2 Conv1D stores [in, out]; GPT-OSS's experts [E, in, out]
            return tensors[0].transpose(-2, -1).contiguous()
        if self.transform == "neox_qkv":          # HF rows are [head, (q,k,v), head_dim]; ours [(q,k,v), head, d]
            w = tensors[0]
            return w.reshape(self.heads, 3, -1, *w.shape[1:]).transpose(0, 1).reshape(w.shape).contiguous()
        if self.transform == "concat":            # separate q/k/v or gate/up -> one fused tensor
            return torch.cat(tensors, dim=0)
        if self.transform == "experts":           # per-expert 2-D keys (e0 pieces, e1 pieces, ...) -> [E, ...]
            n = len(self.sizes)
            return torch.stack([torch.cat(tensors[i:i + n], dim=0) for i in range(0, len(tensors), n)])
        if self.transform == "interleaved_glu":   # GPT-OSS: gate, up interleaved on the last dim ([E, h, 2F] or
            w = tensors[0]                        # [E, 2F]) -> [gate | up], weights as [E, 2F, h]
            w = torch.cat([w[..., 0::2], w[..., 1::2]], dim=-1)
            return (w.transpose(1, 2) if w.dim() == 3 else w).contiguous()
        raise ValueError(f"unknown transform {self.transform!r}; known: {', '.join(TRANSFORMS)}")

    def to_hf(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        if self.transform == "copy":
            return [tensor]
        if self.transform == "transpose":
            return [tensor.transpose(-2, -1).contiguous()]
        if self.transform == "neox_qkv":
            w = tensor
            return [w.reshape(3, self.heads, -1, *w.shape[1:]).transpose(0, 1).reshape(w.shape).contiguous()]
        if self.transform == "concat":
            return [p.contiguous() for p in tensor.split(list(self.sizes), dim=0)]
        if self.transform == "experts":
            return [p.contiguous() for expert in tensor for p in expert.split(list(self.sizes), dim=0)]
        if self.transform == "interleaved_glu":
            w = tensor.transpose(1, 2) if tensor.dim() == 3 else tensor
            gate, up = w.chunk(2, dim=-1)
            return [torch.stack([gate, up], dim=-1).flatten(-2).contiguous()]
        raise ValueError(f"unknown transform {self.transform!r}; known: {', '.join(TRANSFORMS)}")


def rows_by_layer(table: Iterable[WeightMap]) -> dict[int, list[WeightMap]]:
    out: dict[int, list[WeightMap]] = {}
    for row in table:
        out.setdefault(row.layer, []).append(row)
    return dict(sorted(out.items()))


def table_to_layers(table: list[WeightMap], get_tensor: Callable[[str], torch.Tensor],
                    layers: Iterable[int] | None = None) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """Lazily yield (global layer index, {our name: full tensor}); reads only that layer's HF keys."""
    wanted = None if layers is None else set(layers)
    for index, rows in rows_by_layer(table).items():
        if wanted is not None and index not in wanted:
            continue
        yield index, {row.name: row.to_ours([get_tensor(k) for k in row.hf_keys]) for row in rows}


def table_to_hf(table: list[WeightMap],
                layers: Mapping[int, Mapping[str, torch.Tensor]] | Iterable[tuple[int, Mapping[str, torch.Tensor]]]
                ) -> dict[str, torch.Tensor]:
    """Inverse of table_to_layers: HF state dict from our per-layer full tensors (all layers needed)."""
    layers = dict(layers.items() if isinstance(layers, Mapping) else layers)
    state: dict[str, torch.Tensor] = {}
    for row in table:
        if row.layer not in layers or row.name not in layers[row.layer]:
            raise KeyError(f"layer {row.layer} is missing {row.name!r} (needed for HF keys {list(row.hf_keys)})")
        for key, tensor in zip(row.hf_keys, row.to_hf(layers[row.layer][row.name]), strict=True):
            state[key] = tensor
    return state
