"""Sizes a caller gives: their limits, their checks, and the capture-size schedules and
lookup built from them (config.py re-exports each name)."""
from __future__ import annotations

import bisect
import operator

# The most tokens one step may hold (max_num_batched_tokens, and so every capture size
# and the trim threshold). The backend sizes a step's metadata for it up front (6
# int64 per token and the model's view fields, step_metadata.metadata_capacity) and
# each graph's static buffers for its size; past 2**20 tokens one bf16 activation of a 4096-wide model alone is
# 8 GiB, so a larger number is a typo that would otherwise surface as an allocation
# of terabytes.
MAX_NUM_BATCHED_TOKENS = 2 ** 20
# The most requests one step may hold: each brings at least one token.
MAX_NUM_SEQS = MAX_NUM_BATCHED_TOKENS
TOKENS_WHY = "MAX_NUM_BATCHED_TOKENS: a step's metadata and graph buffers are sized for its tokens"
SEQS_WHY = "MAX_NUM_SEQS: each of a step's requests brings at least one token"


def is_int(val) -> bool:
    """An integer of any kind (numpy's too), not a bool, a float or a string."""
    if isinstance(val, bool):
        return False
    try:
        operator.index(val)
    except TypeError:
        return False
    return True


def check_size(name: str, val, lo: int = 1, hi: int | None = None, why: str = "") -> int:
    """``val`` as an int in ``[lo, hi]``, else a ValueError naming ``name``, the value
    and the limit (and ``why`` that limit): for a size a caller gives, checked where
    it is given, before anything is allocated from it."""
    if not is_int(val):
        raise ValueError(f"{name} must be an integer, got {type(val).__name__} {val!r}")
    val = operator.index(val)
    if val < lo:
        raise ValueError(f"{name} must be >= {lo}, got {val}")
    if hi is not None and val > hi:
        raise ValueError(f"{name}={val} is above the limit of {hi}" + (f" ({why})" if why else ""))
    return val


def default_capture_sizes(max_size: int) -> list[int]:
    """The published PIECEWISE schedule: 1, 2, 4, then multiples of 8 up to 256, then of
    16, up to ``max_size`` (which is always included)."""
    max_size = check_size("max_size", max_size, hi=MAX_NUM_BATCHED_TOKENS, why=TOKENS_WHY)
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, max_size + 1, 16)]
    return sorted({s for s in sizes if s <= max_size} | {max_size})


def default_replay_capture_sizes(window: int, max_cudagraph_capture_size: int,
                                 max_num_seqs: int) -> list[int]:
    """Step W up to 16*W, then 1/8 of each power-of-two interval, up to the bound."""
    window = check_size("window", window)
    check_size("max_cudagraph_capture_size", max_cudagraph_capture_size)
    check_size("max_num_seqs", max_num_seqs)
    bound = min(max_cudagraph_capture_size, max_num_seqs * window)
    sizes, s = [], window
    while s < bound:
        sizes.append(s)
        s += max(window, 2 ** (s.bit_length() - 4))
    sizes.append(bound)
    return sorted(set(sizes))


def padded_size(sizes: list[int] | tuple[int, ...], n: int) -> int | None:
    """Smallest size >= n, or None when n is above the largest. ``sizes`` ascending: the
    step path keeps its lists sorted, since sorting 80 sizes per step is host time."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None
