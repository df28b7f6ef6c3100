"""Random serving traffic for the soak (soak.py): requests arrive, are prefilled in
chunks, decode (one token, or a few as a speculative decode), finish and give their
cache block back, each step's token count drawn from a band in turn."""
from __future__ import annotations

import random
from dataclasses import dataclass

from ..requests import RequestChunk


@dataclass
class _Live:
    """A request the traffic holds: its prompt, the tokens in cache, decodes to go."""

    req_id: str
    prompt: int
    keep_all: bool
    decodes: int
    done: int = 0


class Traffic:
    """Random serving traffic within a runner's limits. Each step aims at a token count
    drawn from one of three bands, in turn: below the trim threshold (a graphed step that
    does not trim), from the threshold to the largest main capture size (a graphed step
    that trims), and above it (an eager step); every other eager step takes chunks of at
    most W tokens or keep-all prefills, so that it has nothing to trim."""

    def __init__(self, seed: int, *, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int,
                 window: int, trim_threshold: int, max_capture_size: int) -> None:
        self.rng = random.Random(seed)
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self.max_tokens, self.window = max_num_batched_tokens, window
        top = max_num_batched_tokens
        bands = [(1, trim_threshold - 1, None), (trim_threshold, max_capture_size, None),
                 (max_capture_size + 1, top, None), (max_capture_size + 1, min(top, max_num_seqs * window), window)]
        self.bands = [(lo, min(hi, top), cap) for lo, hi, cap in bands if lo <= min(hi, top)]
        self.live: dict[str, _Live] = {}
        self._next_id = 0
        self._turn = 0

    def step(self) -> list[RequestChunk]:
        rng = self.rng
        lo, hi, cap = self.bands[self._turn % len(self.bands)]
        self._turn += 1
        room = rng.randint(lo, hi)
        cap = cap or self.max_tokens
        chunks: list[RequestChunk] = []
        for r in list(self.live.values()):  # decodes first, then unfinished prompts
            if room == 0 or len(chunks) == self.max_num_seqs:
                break
            if r.done >= r.prompt and rng.random() < 0.8:
                q = min(room, self.max_model_len - r.done, rng.choice((1, 1, 1, 2, 3, 4)))
                chunks.append(self._chunk(r, q))
                room -= q
        for r in list(self.live.values()):
            if room == 0 or len(chunks) == self.max_num_seqs:
                break
            if r.done < r.prompt:
                q = min(room, r.prompt - r.done, self.max_tokens if r.keep_all else cap)
                chunks.append(self._chunk(r, q))
                room -= q
        while room > 0 and len(chunks) < self.max_num_seqs and len(self.live) < self.max_num_seqs:
            r = self._arrive(keep_all=0.5 if cap < self.max_tokens else 0.15)
            q = min(room, r.prompt, self.max_tokens if r.keep_all else cap)
            chunks.append(self._chunk(r, q))
            room -= q
        return chunks

    def _arrive(self, keep_all: float) -> _Live:
        rng = self.rng
        keep_all = rng.random() < keep_all
        longest = min(self.max_model_len - 8, 2048 if keep_all else self.max_model_len - 8)
        prompt = int(round(2 ** rng.uniform(0, max(1, longest).bit_length() - 1)))
        r = _Live(f"q{self._next_id}", max(1, min(prompt, longest)), keep_all, rng.randint(0, 6))
        self._next_id += 1
        self.live[r.req_id] = r
        return r

    def _chunk(self, r: _Live, q: int) -> RequestChunk:
        seq_len = r.done + q
        kv_start = None
        if not r.keep_all and q > self.window and self.rng.random() < 0.1:
            kv_start = seq_len - self.window + self.rng.randint(1, self.window // 2)  # a later floor
        return RequestChunk(r.req_id, q, seq_len, keep_all=r.keep_all and r.done < r.prompt, kv_start=kv_start)

    def advance(self, chunks: list[RequestChunk]) -> list[str]:
        """Account for a step that ran; returns the requests it finished."""
        finished = []
        for c in chunks:
            r = self.live[c.req_id]
            decoding = r.done >= r.prompt
            r.done = c.seq_len
            if decoding:
                r.decodes -= 1
            if r.done >= r.prompt and (r.decodes <= 0 or r.done >= self.max_model_len - 4):
                finished.append(r.req_id)
                del self.live[r.req_id]
        return finished
