"""A runner's requests: the cache block each holds, and how many of its positions the
cache holds, which every later chunk of the request reads."""
from __future__ import annotations

from typing import Any

from ..kv_cache import CacheLayout


class RequestBlocks:
    """The cache block given to each request a runner holds, and its cached length."""

    def __init__(self, layout: CacheLayout) -> None:
        self.layout = layout
        self.given: dict[Any, int] = {}
        self._cached: dict[Any, int] = {}  # positions in cache per request, after its last step

    def claim(self, req_ids: list) -> tuple[list[int], list]:
        """Each request's cache block, and the requests given one now: new ones are
        claimed only when all of them fit, so a step that does not fit leaves every
        block as it was."""
        new = [r for r in req_ids if r not in self.given]
        if new:  # a step of requests already running does no block search
            free = sorted(set(range(self.layout.num_blocks)) - set(self.given.values()))
            if len(new) > len(free):
                raise RuntimeError(f"no free cache block for request {new[len(free)]!r}: the step needs "
                                   f"{len(new)} new blocks and {len(free)} of {self.layout.num_blocks} "
                                   "(max_num_seqs) are free")
            self.given.update(zip(new, free))
        return [self.given[r] for r in req_ids], new

    def give_back(self, req_ids) -> None:
        """Blocks claimed for a step that was then refused."""
        for r in req_ids:
            del self.given[r]

    def free(self, req_id) -> None:
        self.given.pop(req_id, None)
        self._cached.pop(req_id, None)

    def cached_len(self, req_id) -> int:
        return self._cached.get(req_id, 0)

    def ran(self, requests) -> None:
        """A step of ``requests`` wrote each one's chunk into its block."""
        for r in requests:
            self._cached[r.req_id] = r.seq_len

    def check_context(self, requests, built: bool = False) -> None:
        """A chunk reads its request's earlier positions from the cache: they must be there.
        ``built``: the requests of a batch built already, which a free() may have made stale."""
        advice = ("(a stale batch: the request was freed since it was built?): run its earlier chunks first, then "
                  "build it with this runner's build_batch") if built else \
            ": run its earlier chunks first (prefill_context)"
        for i, r in enumerate(requests):
            held = self._cached.get(r.req_id, 0)
            if r.context_len > held:
                raise ValueError(f"request {i} (req_id={r.req_id!r}): its chunk starts at position {r.context_len}, "
                                 f"but the cache holds {held} of its positions{' ' if built else ''}{advice}")
