"""A minimal step runner: owns the KV caches and the requests' blocks, runs steps.

It serves mixed steps (prefill chunks with cached context, decodes, requests that keep
all rows) and prefill-only runs of long prompts chunked by ``max_num_batched_tokens``.
The model is the eager one, or compiled with a ``ReplayBackend`` through
``replay_backend.compile``, whose compiled model owns serving (capture, direct calls,
the fixed metadata buffer): the runner is a client of that public API. It sets the
forward context around each call and runs the head on last rows, and on every row of
a request that asks for prompt logprobs (``keep_all``).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from ..batch import StepBatch, build_step_batch
from ..requests import RequestChunk, validate_requests
from ..dispatch.decide import StepInfo, StepResult, TrimRecord
from ..forward_context import ForwardContext, set_forward_context
from ..kv_cache import CacheLayout
from .kv_caches import KVCaches
from .batch_owner import check_runs_here
from .blocks import RequestBlocks
from .prompts import PromptTokens, schedule_prefill
from . import attention_ops
from . import attention_triton
from .attention_flashinfer import FlashInferAttention
from .flashinfer_import import check_supported
from .dsv41_mini import DSv41Mini
from ..config import MAX_NUM_BATCHED_TOKENS, check_size
from ..serving import ReplayCompiled, StepSetup

log = logging.getLogger("replay_backend")


@dataclass
class StepOutput:
    logits: torch.Tensor  # [R, vocab] fp32, each request's last row
    batch: StepBatch
    result: StepResult | None  # what the compiled model did (None: the eager model ran)
    # Per request that keeps all rows: the log-probability each of its rows gives the
    # prompt token at the next position ([rows] fp32; the last row's next token is the
    # one after the chunk, where the cache has room for it).
    prompt_logprobs: dict = field(default_factory=dict)

    @property
    def step(self) -> StepInfo | None:
        """The main layers' part of ``result`` (kind, tokens, padded tokens)."""
        return self.result.step_info if self.result is not None else None

    @property
    def trim(self) -> TrimRecord | None:
        """The replay region's part of ``result``, None without a region."""
        return self.result.trim_record if self.result is not None else None


class StepRunner:
    def __init__(self, model: DSv41Mini, *, max_num_seqs: int = 8, max_model_len: int = 4096,
                 max_num_batched_tokens: int = 16384, forward: Callable | None = None,
                 backend=None, attention_wrapper_factory: Callable | None = None) -> None:
        """``max_num_batched_tokens``: the most tokens of a step (with a backend, at most
        the backend's own), prompts chunked to it. ``attention_wrapper_factory``: for
        ``attention_impl="flashinfer"``, what makes the FlashInfer wrappers
        (attention_flashinfer.FlashInferAttention; the CPU tests pass an emulation), by
        default FlashInfer's own."""
        # Sizes first, before anything is allocated from them.
        check_size("StepRunner.max_num_batched_tokens", max_num_batched_tokens, hi=MAX_NUM_BATCHED_TOKENS,
                   why="a step's metadata and buffers are sized for its tokens")
        p = next(model.parameters())
        self.model = model
        self.cfg = model.cfg
        self.device, self.dtype = p.device, p.dtype
        self.layout = CacheLayout(max_model_len, max_num_seqs)
        self.tokens = PromptTokens(self.cfg.vocab_size, max_model_len)
        self.view_fields = attention_ops.view_fields(self.cfg.attention_impl, self.device)
        self.kv = KVCaches(self.cfg, self.layout, self.device, self.dtype)
        # FlashInfer plans each view on the host before attention reads it (prepare_view).
        self.attention = None
        if self.cfg.attention_impl == "flashinfer":
            if attention_wrapper_factory is None:
                check_supported(self.device, self.dtype)
            rows = max(max_num_batched_tokens, backend.config.max_num_batched_tokens if backend else 0) + 1
            self.attention = FlashInferAttention(self.cfg, self.kv.swa[0].shape[0], max_num_seqs, rows,
                                                 max_model_len, self.device, self.dtype, attention_wrapper_factory,
                                                 strict=backend is not None and backend.config.strict)
        # With a backend, a step over its own limit is refused too: schedule within both.
        self.max_num_batched_tokens = min(max_num_batched_tokens, backend.config.max_num_batched_tokens) \
            if backend is not None else max_num_batched_tokens
        prepare = self.attention.prepare if self.attention is not None else None
        self.setup = StepSetup(self.layout, self.cfg.window, self.kv, self.device, self.view_fields, prepare)
        # With a ReplayBackend the model is compiled through it (``forward``: a
        # torch.compile-d callable that routes the trace into it, one trace for several
        # backends); the compiled model serves every step, this runner only calls it.
        self.backend = backend
        self.compiled: ReplayCompiled | None = None
        if backend is not None:
            self.compiled = ReplayCompiled(model, ("input_ids", "positions"), backend, traced=forward,
                                           setup=self.setup)
            self.forward = self.compiled
        else:
            self.forward = forward if forward is not None else model
        self.blocks = RequestBlocks(self.layout)
        # capture()'s step that builds the attention's split variants, seconds (None: no
        # such step ran: no Triton, the split off, or no context long enough to split)
        self.split_warmup_s: float | None = None

    # ---- cache blocks --------------------------------------------------------------
    def block_of(self, req_id) -> int:
        return self.blocks.claim([req_id])[0][0]

    @property
    def blocks_given(self) -> dict:
        """The cache block this runner gave each request it holds (read-only use)."""
        return self.blocks.given

    def free(self, req_id) -> None:
        self.blocks.free(req_id)

    def cached_len(self, req_id) -> int:
        """How many of the request's positions the cache holds (0 for an unknown request)."""
        return self.blocks.cached_len(req_id)

    # ---- steps ---------------------------------------------------------------------
    @torch.inference_mode()
    def build_batch(self, requests: Iterable[RequestChunk]) -> StepBatch:
        """The step of ``requests``, its new requests given cache blocks. A step refused
        claims no block, and with a compiled model it fails the step: data-parallel
        ranks raise ``RankFailed`` naming this one rather than wait for it."""
        requests = list(requests)
        try:
            validate_requests(requests, self.layout, self.cfg.window, self.max_num_batched_tokens)
            self.blocks.check_context(requests)
            blocks, new = self.blocks.claim([r.req_id for r in requests])  # the last check: it claims blocks
        except Exception as e:  # noqa: BLE001 - whatever refused it, this rank runs no step
            if self.compiled is not None:
                self.compiled.fail_step(e)
            raise
        tokens = [self.tokens.for_step(r.req_id, r.context_len, r.seq_len) for r in requests]
        if self.compiled is None:
            return build_step_batch(requests, tokens, blocks, self.layout, self.cfg.window, self.device,
                                    self.max_num_batched_tokens, view_fields=self.view_fields, owner=self)
        try:  # as the compiled model serves it (its metadata buffer); refused, it fails the step itself
            return self.compiled.build_batch(requests, tokens, blocks, self.max_num_batched_tokens, owner=self)
        except BaseException:
            self.blocks.give_back(new)
            raise

    @torch.inference_mode()
    def run(self, batch: StepBatch, eager_replay: str = "off", forward: Callable | None = None,
            use_graphs: bool = True) -> StepOutput:
        """Run one step of ``batch``, which this runner's :meth:`build_batch` built: its
        cache blocks are the ones this runner gave its requests, which hold their context.
        A batch that writes no block (a dummy one: every row to the pad slot) may come
        from anywhere with this runner's layout."""
        fwd = forward if forward is not None else self.forward
        try:
            check_runs_here(self, batch)
            if not batch.pad_writes:  # and each request's context is in its block
                self.blocks.check_context(batch.requests, built=True)
        except ValueError as e:
            if fwd is self.compiled:  # data-parallel ranks raise naming this one, not wait for it
                self.compiled.fail_step(e)
            raise
        if fwd is self.compiled and not self.backend.has_run and not batch.pad_writes and self.backend.dp_group is None:
            self._trace()
        if fwd is not self.compiled:
            batch.check_current()  # the compiled model checks it itself
        in_region = fwd is self.compiled and self.backend.replays_in_region
        ctx = self._context(batch, in_region, eager_replay=eager_replay, use_graphs=use_graphs)
        with set_forward_context(ctx):
            hidden = fwd(batch.input_ids, batch.positions)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        if not batch.pad_writes:  # the cache now holds each request's chunk, in its block (checked above)
            self.blocks.ran(batch.requests)
        return StepOutput(logits, batch, ctx.result, self.tokens.logprobs(batch, hidden, self.model.compute_logits))

    def step(self, requests: Iterable[RequestChunk], eager_replay: str = "off",
             forward: Callable | None = None) -> StepOutput:
        return self.run(self.build_batch(requests), eager_replay, forward)

    def prefill(self, prompts: dict[Any, int], eager_replay: str = "off",
                forward: Callable | None = None) -> dict[Any, torch.Tensor]:
        """Prefill whole prompts (``req_id -> length``) in chunked steps; returns each
        request's last-row logits from the step that finished it."""
        ids, lengths = list(prompts), list(prompts.values())
        out: dict[Any, torch.Tensor] = {}
        for plan in schedule_prefill(lengths, self.max_num_batched_tokens):
            reqs = [RequestChunk(ids[j], q, s) for j, q, s in plan]
            res = self.step(reqs, eager_replay, forward)
            for k, (j, _, s) in enumerate(plan):
                if s == lengths[j]:
                    out[ids[j]] = res.logits[k]
        return out

    def prefill_context(self, requests: Iterable[RequestChunk], eager_replay: str = "off",
                        forward: Callable | None = None) -> None:
        """Fill the cache with each request's context (the tokens before its chunk)."""
        prompts = {r.req_id: r.context_len for r in requests if r.context_len > 0}
        if prompts:
            self.prefill(prompts, eager_replay, forward)

    def idle_step(self) -> None:
        """This data-parallel rank has no request this step: it still takes part, with a
        dummy step the compiled model pads to the ranks' agreed size."""
        if self.compiled is None:
            raise RuntimeError("idle_step needs a StepRunner built with backend=ReplayBackend(...)")
        with torch.inference_mode():
            self.compiled.idle_step()

    # ---- compiled models ------------------------------------------------------------
    def start_serving(self) -> None:
        """Warm-up is over: a recompile is an error from now on, and served steps are
        built into the compiled model's fixed metadata buffer. :meth:`capture` ends with
        this; without graphs call it after the warm-up steps."""
        if self.compiled is None:
            raise RuntimeError("start_serving needs a StepRunner built with backend=ReplayBackend(...)")
        self.compiled.start_serving(self.setup)

    @torch.inference_mode()
    def dummy_batch(self, num_tokens: int, context: int = 0) -> StepBatch:
        """:func:`~replay_backend.batch.dummy_step_batch` for this runner's cache."""
        return self.setup.dummy_batch(num_tokens, context)

    def _compiled_for_capture(self) -> ReplayCompiled:
        if self.compiled is None:
            raise RuntimeError("graphs need a StepRunner built with backend=ReplayBackend(...)")
        if not self.backend.has_run:  # graphs come from capture(), in its order
            self._trace()
        return self.compiled

    def _trace(self) -> None:
        """The compiled model's one trace and compile, on a dummy step of W tokens that
        captures nothing: before capture, and before the runner's first step of its own,
        since Inductor lowers the pieces with the traced token count as its size hint,
        and at one token some of its layout choices (a select from an expanded hidden
        state) hold at one token only. :meth:`run` leaves it out with data-parallel
        ranks, whose every step is agreed: a rank that failed its first step would
        trace on its next while the others did not, one agreement apart."""
        self.run(self.dummy_batch(self.cfg.window), use_graphs=False)

    def plan_batch(self, batch: StepBatch, in_region: bool) -> None:
        """The attention's host-side plans of ``batch``'s whole view (FlashInfer's; none
        for the other kernels), as :meth:`run` makes them before the model: for the main
        layers only where the replay layers run in a replay region (``in_region``, see
        ``ReplayBackend.replays_in_region``), whose trim op plans the view they read."""
        att = self.attention
        if att is None:
            return
        if in_region:
            att.prepare_main(batch.view)
        else:
            att.prepare(batch.view, None)

    def _context(self, batch: StepBatch, in_region: bool = False, **kw) -> ForwardContext:
        """The forward context of a step of ``batch``, its whole batch planned."""
        self.plan_batch(batch, in_region)
        prepare = self.attention.prepare if self.attention is not None else None
        return ForwardContext(batch, self.kv, prepare_view=prepare, **kw)

    def estimate_graph_memory(self):
        """Graph memory :meth:`capture` would take (CUDA), measured without capturing."""
        return self._compiled_for_capture().estimate_graph_memory(self.setup)

    def capture(self) -> dict:
        """Warm up (a compile step, then a long-context step where the attention can
        split), capture main graphs then replay graphs (largest first), start serving.

        Returns the per-runner capture summary. Without CUDA the same sequence runs
        with emulated graphs."""
        compiled = self._compiled_for_capture()
        self._build_split_attention()  # before capture, whose end starts the served-step counts
        with torch.inference_mode():
            summary = compiled.capture(self.setup)
        self.start_serving()
        return summary

    def _build_split_attention(self) -> None:
        """One step (no graphs) whose attention takes the kernel's split variants, so that
        no served step builds them (attention_ops.split_warmup_seq_len)."""
        seq_len = attention_ops.split_warmup_seq_len(self.cfg, self.layout.max_model_len, self.device)
        if not seq_len:
            return
        # One block of rows: few programs, which is when the plan splits.
        rows = min(self.cfg.window, attention_triton.BLOCK_M, seq_len)
        t0 = time.perf_counter()
        with torch.inference_mode():
            self.run(self.dummy_batch(rows, context=seq_len - rows), use_graphs=False)
        self.split_warmup_s = time.perf_counter() - t0
        log.info("dsv41_replay: attention split variants ready (a %d-token context) in %.1f s",
                 seq_len, self.split_warmup_s)
