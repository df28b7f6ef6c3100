"""A step loop any own model of the test suite can be served by (tests/llama_swa.py,
tests/gqa_rope.py), written only against replay_backend's public API: one cache block
per live request (given back when it finishes, and reused by later ones), the step's
token ids given by the caller or made up, the step protocol's batch and forward
context, the head on each request's last row, and the cache entries a step wrote that
a later step may read.

A model served here has ``window``, ``layers`` (one cache tensor pair per layer),
``replay_from`` (its first replay layer), ``head`` and ``forward(input_ids,
positions) -> (hidden,)``; its cache object has per-layer lists ``k`` and ``v``
indexed by slot.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from replay_backend import CacheLayout, RequestChunk, StepSetup, build_step_batch, set_forward_context


class OwnServer:
    """One cache block per live request. ``compiled``: the model compiled with
    ``replay_backend.compile`` (it builds the served batches in its fixed metadata buffer
    and runs the steps); None runs the eager model, the oracle."""

    def __init__(self, model, make_cache: Callable, compiled=None, max_model_len: int = 256,
                 max_num_seqs: int = 8) -> None:
        p = next(model.parameters())
        self.model, self.compiled = model, compiled
        self.layout = CacheLayout(max_model_len, max_num_seqs)
        self.cache = make_cache(model, self.layout, p.device, p.dtype)
        self.setup = StepSetup(self.layout, model.window, self.cache, p.device)
        self.device = p.device
        self.blocks: dict = {}
        self._free = list(range(max_num_seqs - 1, -1, -1))  # pop() gives the lowest first

    def block(self, req_id) -> int:
        if req_id not in self.blocks:
            if not self._free:
                raise ValueError(f"no free cache block for {req_id!r}: more than {self.layout.num_blocks} live "
                                 "requests")
            self.blocks[req_id] = self._free.pop()
        return self.blocks[req_id]

    def free(self, req_id) -> None:
        """The request finished: its block goes back (its stale entries stay for the next)."""
        self._free.append(self.blocks.pop(req_id))

    def default_tokens(self, r: RequestChunk) -> torch.Tensor:
        vocab = self.model.head.out_features
        return (torch.arange(r.context_len, r.seq_len) * 7 + len(str(r.req_id))) % vocab

    @torch.no_grad()
    def step(self, requests: Sequence[RequestChunk], tokens: Sequence | None = None):
        """Runs one step; returns each request's last-row logits and what the compiled
        model did (a ``StepResult``; None for the eager model)."""
        blocks = [self.block(r.req_id) for r in requests]
        tokens = [self.default_tokens(r) for r in requests] if tokens is None else list(tokens)
        if self.compiled is not None:
            batch = self.compiled.build_batch(requests, tokens, blocks)
        else:
            batch = build_step_batch(requests, tokens, blocks, self.layout, self.model.window, self.device)
        with set_forward_context(self.setup.context(batch)):
            (hidden,) = (self.compiled or self.model)(batch.input_ids, batch.positions)
        result = self.compiled.last_step if self.compiled is not None else None
        return self.model.head(hidden[batch.logits_indices]), result

    # ---- compiling and serving ----------------------------------------------------------
    @torch.no_grad()
    def warm_up(self) -> None:
        """The compiled model's one trace: a dummy step (every write to the pad slot)
        that captures nothing."""
        batch = self.setup.dummy_batch(self.model.window)
        with set_forward_context(self.setup.context(batch, use_graphs=False)):
            self.compiled(batch.input_ids, batch.positions)

    def serve(self) -> dict:
        """Warm up, capture every graph, start serving; returns capture's summary."""
        self.warm_up()
        summary = self.compiled.capture(self.setup)
        self.compiled.start_serving()
        return summary

    # ---- what a step wrote -------------------------------------------------------------
    def written_slots(self, step: Sequence[RequestChunk], layer: int) -> list[int]:
        """The slots of ``layer`` the step wrote that a later step may read: every row's
        before the replay region, the kept rows' (the last W of a prefill, every row of
        a keep_all request) inside it."""
        window, slots = self.model.window, []
        for r in step:
            base = self.layout.base(self.blocks[r.req_id])
            keep = r.query_len if layer < self.model.replay_from or r.keep_all else min(r.query_len, window)
            slots += range(base + r.seq_len - keep, base + r.seq_len)
        return slots

    def written(self, step: Sequence[RequestChunk]) -> list[tuple[int, str, torch.Tensor]]:
        """(layer, "k" or "v", entries) of every cache entry :meth:`written_slots` names."""
        out = []
        for layer in range(len(self.model.layers)):
            idx = torch.tensor(self.written_slots(step, layer), dtype=torch.int64, device=self.device)
            out += [(layer, "k", self.cache.k[layer].index_select(0, idx)),
                    (layer, "v", self.cache.v[layer].index_select(0, idx))]
        return out


def llama_cache(model, layout, device, dtype):
    from llama_swa import LlamaCache

    return LlamaCache(model, layout, device, dtype)


def gqa_cache(model, layout, device, dtype):
    from gqa_rope import GQACache

    return GQACache(model, layout, device, dtype)
