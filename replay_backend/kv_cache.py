"""The cache layout of the step protocol: where each request's KV entries live.

Every request owns one contiguous block of ``max_model_len`` slots, so the slot of
position p is ``base + p`` in every per-token cache (a model's own caches may derive
others, e.g. ``base/2 + p//2`` for a ratio-2 compressed cache). The last slot of
every cache is the *pad slot*: padded rows write there, and nothing ever reads it.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

from .config import is_int

# The longest sequence a cache may hold. Positions reach rotary embeddings as float32
# (the reference model's ``rope_angles``, as in most models), which holds every integer
# exactly only up to 2**24: past it neighbouring positions would share an angle. Far
# above any model's context, so a larger number is a typo, refused before a cache is
# allocated from it.
MAX_MODEL_LEN = 2 ** 24
# The most slots a per-token cache may have, the pad slot (index ``num_slots``)
# included: every slot index must fit an int32, as FlashInfer's page indices do
# (reference/flashinfer_batches.py) and kernels that index a cache with int32 offsets
# need. Bounds the product max_model_len * num_blocks.
MAX_NUM_SLOTS = 2 ** 31 - 1


@dataclass(frozen=True)
class CacheLayout:
    max_model_len: int
    num_blocks: int  # one block per sequence: a runner's max_num_seqs

    def __post_init__(self) -> None:
        n, blocks = self.max_model_len, self.num_blocks
        for name, val in (("max_model_len", n), ("num_blocks", blocks)):
            if not is_int(val):
                raise ValueError(f"CacheLayout.{name} must be an integer, got {type(val).__name__} {val!r}")
        n, blocks = operator.index(n), operator.index(blocks)
        if n <= 0 or n % 2:  # even: a ratio-2 cache holds half of each block
            raise ValueError(f"CacheLayout.max_model_len must be a positive even number, got {n}")
        if n > MAX_MODEL_LEN:
            raise ValueError(f"CacheLayout.max_model_len={n} is above the limit of {MAX_MODEL_LEN} (MAX_MODEL_LEN: "
                             f"positions must stay exact as float32)")
        if blocks <= 0:
            raise ValueError(f"CacheLayout.num_blocks must be positive (one block per sequence: max_num_seqs), "
                             f"got {blocks}")
        if n * blocks + 1 > MAX_NUM_SLOTS:
            raise ValueError(
                f"CacheLayout: max_model_len={n} x num_blocks={blocks} (max_num_seqs) = {n * blocks} slots and the "
                f"pad slot, above the limit of {MAX_NUM_SLOTS} (MAX_NUM_SLOTS: every slot index must fit an int32); "
                f"lower max_model_len or the number of sequences")
        object.__setattr__(self, "max_model_len", n)
        object.__setattr__(self, "num_blocks", blocks)

    @property
    def num_slots(self) -> int:
        return self.max_model_len * self.num_blocks

    @property
    def pad_slot(self) -> int:
        return self.num_slots

    def base(self, block: int) -> int:
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"CacheLayout.base: block {block} is outside [0, num_blocks={self.num_blocks})")
        return block * self.max_model_len
