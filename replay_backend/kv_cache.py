"""The cache layout of the step protocol: where each request's KV entries live.

Every request owns one contiguous block of ``max_model_len`` slots, so the slot of
position p is ``base + p`` in every per-token cache (a model's own caches may derive
others, e.g. ``base/2 + p//2`` for a ratio-2 compressed cache). The last slot of
every cache is the *pad slot*: padded rows write there, and nothing ever reads it.
"""
from __future__ import annotations

from dataclasses import dataclass


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
