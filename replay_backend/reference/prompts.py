"""A runner's prompts: each request's deterministic tokens and the log-probabilities a
step gives them, and whole prompts cut into chunked-prefill steps within a token
budget."""
from __future__ import annotations

import zlib

import torch

from ..step_metadata import to_device


class PromptTokens:
    """Deterministic prompt tokens (int64, on the host), so two runners see the same
    request: ``(seed * 2654435761 + p * 40503 + p * p % 977) % vocab`` at position p,
    seed from the request id. The position terms are kept for every position of the
    cache: computed per step they were eight host ops before a step's first kernel."""

    # Chunks of at most this many tokens (decodes, speculative decodes) come as lists:
    # Python arithmetic on a few ints takes less host time than tensor ops on them.
    SHORT = 16

    def __init__(self, vocab: int, max_len: int) -> None:
        p = torch.arange(max_len, dtype=torch.int64)
        self.vocab, self.max_len = vocab, max_len
        self.by_position = (p * 40503) % vocab + (p * p) % 977
        self._by_position = self.by_position.tolist()

    def __call__(self, req_id, start: int, end: int) -> torch.Tensor:
        return (self.by_position[start:end] + self._seed(req_id)).remainder_(self.vocab)

    def for_step(self, req_id, start: int, end: int) -> list[int] | torch.Tensor:
        """The same tokens as a step's batch takes them: a short chunk's as a list."""
        if end - start > self.SHORT:
            return self(req_id, start, end)
        seed = self._seed(req_id)
        return [(t + seed) % self.vocab for t in self._by_position[start:end]]

    def logprobs(self, batch, hidden: torch.Tensor, compute_logits) -> dict:
        """Each keep-all request of ``batch`` (a ``StepBatch``): the log-probability each
        of its rows of ``hidden`` gives the prompt token at the next position, where the
        cache has room for it ([rows] fp32). Such a request is never trimmed, so every
        one of its rows holds its result."""
        out = {}
        qsl = batch.view.query_start_loc
        for i, r in enumerate(batch.requests):
            if not r.keep_all:
                continue
            nxt = self(r.req_id, r.context_len + 1, min(r.seq_len + 1, self.max_len))
            rows = hidden[qsl[i]:qsl[i] + nxt.shape[0]]
            lp = torch.log_softmax(compute_logits(rows).float(), dim=-1)
            # pinned and asynchronous: a served step never waits for the GPU
            out[r.req_id] = lp.gather(1, to_device(nxt, lp.device)[:, None])[:, 0]
        return out

    def _seed(self, req_id) -> int:
        return zlib.crc32(str(req_id).encode()) * 2654435761 % self.vocab


def schedule_prefill(lengths: list[int], budget: int) -> list[list[tuple[int, int, int]]]:
    """Greedy chunked prefill: steps of ``(request index, query_len, seq_len)`` that use
    at most ``budget`` tokens each, requests served in order."""
    if budget <= 0:
        raise ValueError(f"max_num_batched_tokens must be positive, got {budget}")
    if any(n < 1 for n in lengths):
        raise ValueError(f"prompt lengths must be >= 1, got {lengths}")
    done = [0] * len(lengths)
    steps = []
    i = 0
    while i < len(lengths):
        room, step = budget, []
        j = i
        while j < len(lengths) and room > 0:
            q = min(room, lengths[j] - done[j])
            if q > 0:
                done[j] += q
                step.append((j, q, done[j]))
                room -= q
            j += 1
        steps.append(step)
        while i < len(lengths) and done[i] == lengths[i]:
            i += 1
    return steps
