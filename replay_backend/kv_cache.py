"""KV caches of a DSv4.1 model: each layer's own SWA KV, each source's global KV.

Every request owns one contiguous block of ``max_model_len`` slots, so the slot of
position p is ``base + p`` in every per-token cache (and ``base/2 + p//2`` in a
ratio-2 global cache). The last row of every cache is the *pad slot*: padded rows
and incomplete compression pairs write there, and nothing ever reads it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # the layout is the core's; only the caches know a model's shape
    from .models.config import ModelConfig


@dataclass(frozen=True)
class CacheLayout:
    max_model_len: int
    num_blocks: int

    def __post_init__(self) -> None:
        if self.max_model_len <= 0 or self.max_model_len % 2:
            raise ValueError(f"max_model_len must be a positive even number, got {self.max_model_len}")
        if self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")

    @property
    def num_slots(self) -> int:
        return self.max_model_len * self.num_blocks

    @property
    def pad_slot(self) -> int:
        return self.num_slots

    def base(self, block: int) -> int:
        return block * self.max_model_len


class KVCaches:
    """Owns the cache tensors; the attention ops find them through the forward context."""

    def __init__(self, cfg: ModelConfig, layout: CacheLayout, device, dtype) -> None:
        self.cfg = cfg
        self.layout = layout
        hd, n = cfg.head_dim, layout.num_slots
        self.swa = [torch.zeros(n + 1, hd, device=device, dtype=dtype) for _ in range(cfg.num_layers)]
        self.glob: dict[int, torch.Tensor] = {}
        self.raw: dict[int, torch.Tensor] = {}  # ratio-2 sources: per-token (kv, gate) awaiting its pair
        for src in cfg.kv_source_layer_ids:
            ratio = cfg.compress_ratio(src)
            self.glob[src] = torch.zeros(n // ratio + 1, hd, device=device, dtype=dtype)
            if ratio == 2:
                self.raw[src] = torch.zeros(n + 1, 2 * hd, device=device, dtype=torch.float32)

    def global_pad_slot(self, src: int) -> int:
        return self.glob[src].shape[0] - 1

    def nbytes(self) -> int:
        tensors = [*self.swa, *self.glob.values(), *self.raw.values()]
        return sum(t.numel() * t.element_size() for t in tensors)
