"""KV caches of a DSv4.1 model: each layer's own SWA KV, each source's global KV, in the
step protocol's layout (``replay_backend.kv_cache.CacheLayout``): position p of a
request at ``base`` is slot ``base + p`` (``base/2 + p//2`` in a ratio-2 global cache);
the last slot of each cache is the pad slot.
"""
from __future__ import annotations

import torch

from ..kv_cache import CacheLayout
from .config import ModelConfig


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
