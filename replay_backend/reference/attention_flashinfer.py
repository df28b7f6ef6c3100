"""DSv4.1 attention through FlashInfer's paged prefill kernels (``attention_impl="flashinfer"``).

A row's softmax runs over the union of two key sets, the layer's own SWA keys and the
global entries of its source, plus a per-head sink. FlashInfer computes each key set as
one attention state (output and log-sum-exp); :func:`merge` combines the two with the
sink into the layer's output, which is the same softmax because a softmax over a union
of disjoint sets is the log-sum-exp-weighted mix of the softmaxes over each set.

Each key set is a batch of causal requests over a page table of page size 1, whose
entries are cache slots (flashinfer_batches.py).

FlashInfer plans a batch on the host (``plan()``) and then runs it. Plans are made
outside graphs: :meth:`FlashInferAttention.prepare` is the forward context's
``prepare_view`` hook, which the backend calls for the view the replay region runs on,
before the region runs or its graph replays; the runner plans the whole batch before
the model runs, for the main layers only where the replay layers run in a region. A
replay graph is captured with wrappers of its own size in FlashInfer's CUDA-graph mode
(fixed buffers, a fixed request count), which each later plan refills. So is a FULL
graph: before it replays, its step plans the whole batch for the main layers and the
replay twin for the replay layers into wrappers of the graph's size, and a ratio-r
global part's row permutations into fixed buffers; inside the graph, attention finds
those plans by its view's graph size (``_plans_of``), with no host code to point it.
"""
from __future__ import annotations

import torch

from ..fallbacks import process_fallback
from . import flashinfer_compat, flashinfer_import
from .flashinfer_batches import PartSets, global_part, layout_of, padded, swa_part
from .flashinfer_run import PLAN, PLANS, Planned
from .flashinfer_staging import TURNS, SlotStaging, Wrapper


# FlashInfer splits a plan's keys across programs to fill the GPU whatever the keys per
# row, and its split costs a partial state per chunk written, read back and merged by a
# further kernel. Where each row reads few keys (an SWA row at most the window) that
# costs more than the parallelism gives, so a plan outside graphs may split only where
# some row reads at least this many keys: the Triton kernel's threshold (its own
# MIN_SPLIT_KEYS, attention_triton.py), below which a split's walk is short there too.
MIN_SPLIT_KEYS = 2048


def _programs(device: torch.device) -> int:
    """FlashInfer's work items before it splits no further (two per SM, one KV head)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    return 2 * sms


class FlashInferAttention:
    """One runner's FlashInfer plans: wrappers for the whole batch, for a replay region
    run without graphs, and per replay-graph size; :meth:`prepare` plans a view.

    ``max_rows`` bounds the rows of a view planned without a graph (the runner's token
    budget), ``max_request_rows`` the rows of one request of capture's dummy views.
    ``factory(graph_buffers)`` makes a wrapper (``graph_buffers``: None, or the
    CUDA-graph buffers by FlashInfer's argument names); the default makes FlashInfer's
    ``BatchPrefillWithPagedKVCacheWrapper`` on this object's workspaces. The CPU tests
    pass an emulation of it. ``strict``: the ``flashinfer_graph_split`` and
    ``flashinfer_direct_call`` fallbacks are errors."""

    # Outside inference mode: a wrapper's buffers and workspaces outlive the call that
    # made them and every plan updates them in place, which an inference tensor refuses
    # outside inference mode; runners plan both inside it (steps) and outside (capture).
    @torch.inference_mode(False)
    def __init__(self, cfg, num_slots: int, max_num_seqs: int, max_rows: int, max_request_rows: int, device,
                 dtype, factory=None, strict: bool = False) -> None:
        self.parts = PartSets.of(cfg)  # first: it refuses a config this attention cannot serve
        self.cfg, self.device, self.dtype, self.strict = cfg, torch.device(device), dtype, strict
        self.cuda = self.device.type == "cuda"
        self.num_slots, self.max_num_seqs = num_slots, max_num_seqs
        self.max_request_rows = max(1, min(cfg.window, max_request_rows))
        self.programs = _programs(self.device)
        ratios = cfg.global_ratios
        heads, d = cfg.num_heads, cfg.head_dim
        # Work items (three int32 arrays), per-request and per-row arrays, alignment.
        batch = self.graph_batch(max_rows) * max(ratios | {1})
        items = self.programs + -(-max_rows * heads // 16) + batch
        self.int_bytes = 16 * (items + max_rows + batch) + (64 << 10)
        self.factory = factory or self._flashinfer_wrapper
        self.workspace = torch.zeros(1, dtype=torch.uint8, device=device)  # the probe's, below
        # A graph plan that does not split reads its work list past the end, which must
        # start cleared (flashinfer_compat). Where this FlashInfer's cannot be, every
        # graph plan splits: FlashInfer's guarded path, at the cost of scratch and a merge.
        self.graphs_split = not flashinfer_compat.clear_plan_memory(self.factory(None))
        if self.graphs_split:
            process_fallback("flashinfer_graph_split", _SPLIT_WHY, strict)
        # Without staging buffers to hand out in turns, a plan waits for the previous
        # plan's copies (flashinfer_staging).
        self.turns = 1 if self.graphs_split else TURNS
        # A plan splits its keys (scratch in the float workspace) only into at most
        # ``programs`` work items of at most 128 rows, FlashInfer's scratch being per query
        # head: the largest scratch any plan takes. Graph plans keep that bound by
        # splitting only where they have fewer items (_graph_splits); where every graph
        # plan splits, a graph's worst case: a tile of up to 128 rows per row tile, and a
        # partial tile per request.
        rows = self.programs * 128
        if self.graphs_split:
            rows = max(rows, max_rows * heads + 128 * self.graph_batch(max_rows))
        self.float_bytes = heads * rows * (d + 1) * 4 + (1 << 20)
        if factory is None:
            self.workspace = torch.zeros(self.float_bytes, dtype=torch.uint8, device=device)
        self._wrappers: dict[tuple, Wrapper] = {}
        self._staging: dict[object, SlotStaging] = {}
        self._pages: dict[tuple, torch.Tensor] = {}  # per part: its graph wrappers' page table
        self._perms: dict[tuple, torch.Tensor] = {}  # per (graph size, part): its fixed row permutations

    # ---- planning: on the host, outside graphs ----------------------------------------
    @torch.inference_mode(False)
    def prepare(self, view, size: int | None) -> None:
        """Plan ``view`` for every layer that may read it (the forward context's hook):
        ``size`` is the size of the graph that reads it (a replay graph, whose replay
        layers read a replay view; a FULL step's graph, whose main layers read the whole
        batch and replay layers its replay twin), else None. Parts whose wrappers still
        hold this view's plan are not planned again."""
        if size is not None:
            self._prepare(view, size, self.parts.replay_layers if view.replay else self.parts.main_layers)
        elif view.trimmed:  # the replay rows: the replay layers read them
            self._prepare(view, "replay", self.parts.replay_layers)
        elif view.replay:  # the whole batch as the replay layers read it (plans shared with it)
            self._prepare(view, "main", self.parts.replay_layers)
        else:  # the whole batch: every layer may read it
            self._prepare(view, "main", self.parts.every)

    @torch.inference_mode(False)
    def prepare_main(self, view) -> None:
        """Plan the whole batch's ``view`` for the main layers only. A runner whose
        replay layers run in a replay region calls this in its metadata build: the
        region calls :meth:`prepare` for the view it runs on, so a step that trims never
        plans the whole batch's floored SWA keys, which only the replay layers read."""
        self._prepare(view, "main", self.parts.main_layers)

    def _prepare(self, view, slot, parts: tuple) -> None:
        """Plan the ``parts`` of ``view`` that its wrappers of ``slot`` (a replay
        graph's size, "main" or "replay") do not hold, and point attention at exactly
        ``parts``: another part, even one planned for this view before, may since have
        been planned over, and reading it must be an error, not another view's plan."""
        plans = view.derived.setdefault(PLANS, {}).setdefault(slot, {})
        stale = [part for part in parts if (p := plans.get(part)) is None or p.wrapper.holds is not p]
        if stale:
            size = slot if isinstance(slot, int) else None
            layouts = {}
            for part in stale:
                kind, arg = part
                reqs, perm = (swa_part(view, self.cfg.window, arg), None) if kind == "swa" else global_part(view, arg)
                if size is not None:
                    reqs = padded(reqs, view.num_tokens, size, self.graph_batch(size, _ratio(part)))
                    if perm is not None:  # the pad rows' request comes last, in view order
                        perm = torch.cat([perm, torch.arange(view.num_tokens, size, dtype=perm.dtype)])
                layouts[part] = layout_of(reqs, perm)
            plans.update(self._plan(slot, layouts, size))
        view.derived[PLAN] = {part: plans[part] for part in parts}

    def graph_batch(self, size: int, ratio: int = 1) -> int:
        """The request count of every plan of a graph of ``size`` rows for a part of
        ``ratio`` (1: SWA): two sub-requests (the rows without keys, the rest) per
        request, of a served view or of capture's dummy view, or at ratio r per residue
        class of its rows, which a request of n rows has min(r, n) of; and the pad rows'
        request. A graph of ``size`` rows holds at most ``size`` requests."""
        reqs = min(size, max(self.max_num_seqs, -(-size // self.max_request_rows)))
        return 2 * min(ratio * reqs, size) + 1

    def _graph_splits(self, size: int, batch: int) -> bool:
        # FlashInfer's CUDA-graph plans always split, into at least ``programs`` items,
        # or its worst-case tile count for the graph's rows where that is more: split only
        # below it, where the rows alone leave the GPU short of work.
        return (self.graphs_split
                or -(-size * self.cfg.num_heads // 16) + batch - 1 < self.programs)

    def _plan(self, slot, layouts: dict, size: int | None) -> dict:
        if self.cuda and torch.cuda.is_current_stream_capturing():
            # Its copies would be captured and replayed from host memory later plans reuse.
            raise RuntimeError(f"attention_impl='flashinfer': a plan of slot {slot!r} inside a CUDA graph capture: "
                               "every view a graph reads must be planned before the graph runs (prepare_view with "
                               "the graph's size)")
        staging = self._staging.get(slot)
        if staging is None:
            staging = self._staging[slot] = SlotStaging(self.turns, self.cuda)
        turn = staging.begin()
        # One host tensor for every part's arrays; the page tables and permutations
        # reach the device in one copy of it.
        small = [x for lay in layouts.values() for x in lay.small]
        host = staging.hold(turn, torch.cat([torch.tensor(small, dtype=torch.int32),
                                             *(lay.kv_indices for lay in layouts.values()),
                                             *(t for lay in layouts.values() if lay.perm is not None
                                               for t in (lay.perm, lay.unperm))]))
        try:
            return self._plan_parts(slot, layouts, size, turn, host, len(small))
        finally:
            staging.end(turn)

    def _plan_parts(self, slot, layouts: dict, size: int | None, turn: int, host: torch.Tensor,
                    tables: int) -> dict:
        # ``host``: every part's small arrays (``tables`` entries), then their page tables,
        # then their permutations, each followed by its inverse.
        dev = host.to(self.device, non_blocking=True)
        planned, at = {}, 0
        perm_at = tables + sum(lay.kv_indices.numel() for lay in layouts.values())
        for part, lay in layouts.items():
            b = lay.batch
            qo, kv, lens, last = (host[at + o:at + o + n] for o, n in ((0, b + 1), (b + 1, b + 1), (2 * b + 2, b),
                                                                       (3 * b + 2, b)))
            at += 4 * b + 2
            k = lay.kv_indices.numel()
            wrapper = self._wrapper(slot, part, size, b, k)
            kind, _ = part
            # A graph wrapper's plans keep the policy its capture fixed (Wrapper.split):
            # an unsplit graph plan reads its work list past its end, which only
            # wrappers made unsplit have cleared (flashinfer_compat).
            row_keys = lay.keys if kind == "global" else min(lay.keys, self.cfg.window)
            split = size is not None or row_keys >= MIN_SPLIT_KEYS
            wrapper.plan(turn, split, qo_indptr=qo, paged_kv_indptr=kv, paged_kv_indices=dev[tables:tables + k],
                         paged_kv_last_page_len=last, seq_lens=lens, num_qo_heads=self.cfg.num_heads,
                         num_kv_heads=1, head_dim_qk=self.cfg.head_dim, page_size=1, causal=True,
                         window_left=self.cfg.window - 1 if kind == "swa" else -1,
                         sm_scale=self.cfg.head_dim ** -0.5, q_data_type=self.dtype, kv_data_type=self.dtype,
                         # known here; FlashInfer would find it by a Python loop over the requests
                         max_token_per_sequence=lay.longest)
            tables += k
            perm = unperm = None
            if lay.perm is not None:
                n = lay.perm.numel()
                both = dev[perm_at:perm_at + 2 * n]
                perm_at += 2 * n
                if size is not None:  # a graph reads them where it read them at capture
                    both = self._fixed_perms(slot, part, size).copy_(both)
                perm, unperm = both[:n], both[n:]
            planned[part] = wrapper.holds = Planned(wrapper, lay.rows, perm, unperm)
        return planned

    def _fixed_perms(self, slot, part, size: int) -> torch.Tensor:
        """The row permutation and its inverse of ``part`` in the graph of ``size`` rows
        (``slot``), back to back at one address for every plan of it."""
        buf = self._perms.get((slot, part))
        if buf is None:
            buf = self._perms[(slot, part)] = torch.zeros(2 * size, dtype=torch.int32, device=self.device)
        return buf

    def _page_table(self, part, pages: int) -> torch.Tensor:
        """A page-index buffer for a graph wrapper of ``part``: one per part, shared by
        its graphs of every size, which never run at once and each of which is planned
        (its page table copied in, in stream order) before it replays. A served view's
        requests own disjoint slots, so its page table is at most the cache's slot
        count; capture's dummy requests all read the same slots, and a graph larger
        than the cache lists more: a wrapper whose first plan lists more pages than the
        part's buffer holds gets a buffer of its own."""
        need = max(self.num_slots, pages)
        buf = self._pages.get(part)
        if buf is None or buf.numel() < need:
            buf = torch.zeros(need, dtype=torch.int32, device=self.device)
            self._pages.setdefault(part, buf)
        return buf

    def _wrapper(self, slot, part, size: int | None, batch: int, pages: int) -> Wrapper:
        """The wrapper of ``(slot, part)``, made on its first plan, of ``batch`` requests
        listing ``pages`` page indices."""
        w = self._wrappers.get((slot, part))
        if w is None:
            buffers = None
            if size is not None:  # CUDA-graph mode: fixed addresses, refilled by each plan
                i32 = dict(dtype=torch.int32, device=self.device)
                buffers = {"qo_indptr_buf": torch.zeros(batch + 1, **i32),
                           "paged_kv_indptr_buf": torch.zeros(batch + 1, **i32),
                           "paged_kv_indices_buf": self._page_table(part, pages),
                           "paged_kv_last_page_len_buf": torch.zeros(batch, **i32)}
            split = size is None or self._graph_splits(size, batch)
            w = self._wrappers[(slot, part)] = Wrapper(self.factory(buffers), split, self.turns, self.cuda,
                                                       self._run_fallback)
        return w

    def _run_fallback(self, detail: str) -> None:
        process_fallback("flashinfer_direct_call", f"a FlashInfer plan's calls go through its run(): {detail}",
                         self.strict)

    def _flashinfer_wrapper(self, graph_buffers: dict | None):
        # fa2: FlashInfer's kernels with CUDA-graph plans, sliding windows and page size 1.
        kw = {} if graph_buffers is None else dict(use_cuda_graph=True, **graph_buffers)
        w = flashinfer_import.load().BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend="fa2", **kw)
        # Its own int workspace (8 MiB, and as much pinned) is sized for any plan; this
        # model's plans need far less, and a runner holds two wrappers per replay size.
        w.reset_workspace_buffer(self.workspace, torch.empty(self.int_bytes, dtype=torch.uint8, device=self.device))
        return w


_SPLIT_WHY = ("this FlashInfer does not keep a plan's work list where flashinfer_compat finds it, so every "
              "replay-graph plan splits its keys (FlashInfer's guarded CUDA-graph path: more float workspace "
              "and a merge kernel per call), and each plan waits for the GPU to copy the previous plan of its "
              "slot")


def _ratio(part) -> int:
    kind, arg = part
    return arg if kind == "global" else 1
