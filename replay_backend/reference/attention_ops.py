"""DSv4.1 attention as ``torch.library`` custom ops, one per layer kind.

The ops are opaque to Dynamo (fake impls return nothing), follow the out-argument
protocol (they write into ``out``, which the preceding graph piece
allocated, so a captured next piece reads a stable address), and read the step's
layout, the KV caches and the replay floor from the forward context.

They run the reference implementation (attention_reference.py: plain PyTorch, CPU and
GPU), the Triton kernels, or FlashInfer, as the model's ``attention_impl`` and the
device choose; inside a FULL graph, attention_graph.py's.
"""
from __future__ import annotations

import torch

from ..compat import dynamo as compat_dynamo
from ..dispatch.decide import StepKind
from ..batch import ViewField, int64_tensor
from ..forward_context import get_forward_context
from ..oplib import define_op, no_output
from ..passes.roles import CudagraphSupport, declare_attention
from ..step_metadata import to_device
from . import attention_graph, attention_reference, attention_triton, flashinfer_run
from . import cache_triton

# The attention kernel's per-view row blocks (attention_triton.row_blocks): built with
# the step's other metadata, so they reach the device in its one copy.
ATTN_BLOCKS = "attn_blocks"


def attn_row_blocks(query_start_loc, seq_lens, kv_start, cache_base, window: int) -> torch.Tensor:
    """:func:`attention_triton.row_blocks` as a flat int64 host tensor."""
    return int64_tensor(attention_triton.row_blocks(query_start_loc, seq_lens, kv_start, cache_base, window))


def attn_max_blocks(max_tokens: int, max_requests: int) -> int:
    """The most row blocks of one view: at most ``ceil(q / BLOCK_M)`` per request."""
    return max_tokens // attention_triton.BLOCK_M + max_requests


# The slots of the ratio-2 compressed global caches, one per row: the model's own
# arithmetic on the step protocol's slots (kv_caches.py), sent with the step's metadata.
COMP_SLOTS = "comp_slots"


def comp_slots(positions: torch.Tensor, slots: torch.Tensor, layout) -> torch.Tensor:
    """Global entry m of a ratio-2 cache pools positions 2m and 2m+1; it is written when
    its odd position arrives (the even one is already in the raw cache), so even
    positions, and rows writing the pad slot, write the compressed cache's pad slot."""
    pad = layout.num_slots // 2
    return torch.where((positions % 2 == 1) & (slots < layout.pad_slot), slots // 2, pad)


# What a runner passes to ``build_step_batch`` for this model: the compressed slots,
# and the Triton kernel's row blocks where it attends.
COMP_FIELD = {COMP_SLOTS: ViewField(comp_slots, per_row=True)}
VIEW_FIELDS = {**COMP_FIELD,
               ATTN_BLOCKS: ViewField(attn_row_blocks, attention_triton.NUM_FIELDS, max_rows=attn_max_blocks)}

# The view's longest sequence, kept in ``AttnView.derived``: it bounds the global keys
# any row reads, which sizes the attention kernel's split (attention_triton.split_plan).
LONGEST = "longest_seq_len"

def _use_triton(impl: str, device: torch.device) -> bool:
    """Whether the Triton kernels write the caches (and, for "auto" and "triton",
    attend)."""
    if impl == "reference":
        return False
    if impl == "triton":
        if not attention_triton.available():
            raise RuntimeError("attention_impl='triton' but triton is not importable")
        return True
    return device.type == "cuda" and attention_triton.available()


def effective_attention(impl: str, device) -> str:
    """What ``attention_impl`` runs on ``device``: "triton", "reference" or "flashinfer"
    ("auto" resolved)."""
    if impl == "flashinfer":
        return impl
    return "triton" if _use_triton(impl, torch.device(device)) else "reference"


def view_fields(impl: str, device) -> dict:
    """The metadata a runner builds with each batch for ``impl`` on ``device``: the
    compressed slots, and the row blocks that the Triton kernel reads, and the reference
    attention inside FULL graphs. FlashInfer plans its own, and building blocks it never
    reads would cost each step host time before its first kernel, growing with its rows."""
    return COMP_FIELD if effective_attention(impl, device) == "flashinfer" else VIEW_FIELDS


def cudagraph_support(setup) -> CudagraphSupport:
    """What these ops can run inside a FULL graph for ``setup``: any batch where its
    views carry the row blocks (the Triton kernel and the reference attention read
    only the graph layout's device metadata there); with FlashInfer, any batch whose
    step plans its views into the graph's wrappers before the graph replays (the
    setup's ``prepare_view``: FlashInfer's CUDA-graph wrappers read fixed buffers
    that each plan refills)."""
    impl = getattr(getattr(setup.kv, "cfg", None), "attention_impl", None)
    if impl == "flashinfer":
        return CudagraphSupport.ALWAYS if setup.prepare_view is not None else CudagraphSupport.NEVER
    if ATTN_BLOCKS not in setup.view_fields:
        return CudagraphSupport.NEVER
    return CudagraphSupport.ALWAYS


def split_warmup_seq_len(cfg, max_model_len: int, device) -> int:
    """The sequence length of a one-block warm-up request whose attention takes every
    split variant of the kernel that a served step can take (0: none can: no Triton
    kernel, the split off, or no context reaches MIN_SPLIT_KEYS global entries).

    A variant is a Triton build, about 1 s, made by the first call that needs it. Only
    steps whose rows read many global keys split, and no capture step does, so without
    this warm-up the first long prompt served would build them inside its step. The
    variants differ by the floor (main or replay layer) and the ratio of the cache read,
    so the request is long enough for the largest ratio's cache to split too, where
    ``max_model_len`` allows."""
    if not cfg.attention_split or effective_attention(cfg.attention_impl, device) != "triton":
        return 0
    ratios = cfg.global_ratios
    if not ratios:
        return 0
    seq_len = min(max_model_len, attention_triton.MIN_SPLIT_KEYS * max(ratios))
    return seq_len if seq_len // min(ratios) >= attention_triton.MIN_SPLIT_KEYS else 0


def _run_attention(layer: int, q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor,
                   out: torch.Tensor, compress=None) -> None:
    ctx = get_forward_context()
    view, caches = ctx.active, ctx.kv
    cfg = caches.cfg
    if compress is not None and view.replay:
        raise RuntimeError(f"layer {layer} is a KV source and cannot run in the replay region")
    if view.graph is not None:
        _graph_attention(layer, q, kv, sink, out, compress, view, caches, ctx.plan)
        return
    n = view.num_tokens
    if q.shape[0] < n:
        raise RuntimeError(f"layer {layer}: attention got {q.shape[0]} rows for {n} tokens")
    swa = caches.swa[layer]
    use_triton = _use_triton(cfg.attention_impl, q.device)
    _write_kv(layer, kv, compress, n, view.slot_mapping, view.derived[COMP_SLOTS].view(-1), caches, use_triton)
    glob, ratio = _global_keys(layer, caches)
    # The replay floor binds the replay layers only, in every step, trimmed or not: the
    # view says whether they read it.
    floored = view.replay
    scale = q.shape[-1] ** -0.5
    if cfg.attention_impl == "flashinfer":
        flashinfer_run.attend(q, out, swa, glob, ratio, view, floored, sink)
    elif use_triton:
        blocks = view.derived.get(ATTN_BLOCKS)
        if blocks is None:  # a view not built by build_step_batch
            blocks = view.derived[ATTN_BLOCKS] = to_device(attn_row_blocks(
                view.query_start_loc, view.seq_lens, view.kv_start, view.cache_base, cfg.window),
                q.device).view(-1, attention_triton.NUM_FIELDS)
        longest = view.derived.get(LONGEST)
        if longest is None:  # per view, not per layer
            longest = view.derived[LONGEST] = max(view.seq_lens)
        attention_triton.attend(q, out, swa, glob, ratio, blocks, cfg.window, floored, sink, scale,
                                longest if cfg.attention_split else 0)
    else:
        attention_reference.attend_view(q, out, swa, glob, ratio, view, floored, cfg.window, sink, scale)
    if out.shape[0] > n:
        out[n:] = 0  # padded rows: deterministic, never read


def _write_kv(layer: int, kv: torch.Tensor, compress, n: int, slots: torch.Tensor, comp_slots: torch.Tensor,
              caches, use_triton: bool) -> None:
    """The step's ``n`` rows of KV into the layer's SWA cache at ``slots``, and where the
    layer is a KV source (``compress``) its compressor's entries at ``comp_slots``."""
    cfg, swa = caches.cfg, caches.swa[layer]
    if use_triton:
        if compress is not None:
            kv_c, gate, norm_w = compress
            compress = (kv_c, gate, norm_w, caches.raw.get(layer), caches.glob[layer], comp_slots, cfg.rms_eps)
        cache_triton.write(kv, swa, slots, n, compress)
    else:
        swa.index_copy_(0, slots, kv[:n].to(swa.dtype))
        if compress is not None:
            attention_reference.compress_kv(layer, *compress, n, slots, comp_slots, caches, cfg.rms_eps)


def _global_keys(layer: int, caches) -> tuple[torch.Tensor | None, int]:
    """The global cache the layer reads (its source's; None: none) and its ratio."""
    src = caches.cfg.global_source(layer)
    return (caches.glob[src], caches.cfg.compress_ratio(src)) if src is not None else (None, 1)


def _graph_attention(layer: int, q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, out: torch.Tensor,
                     compress, view, caches, plan) -> None:
    """Attention that a FULL graph can hold: every row of the graph layout, read from
    its fixed device metadata only (``view.graph``), with one grid and one split for
    every step of its size. Padding rows write the pad slot and attend to nothing
    (zeros). Pieces run it too for a batch laid out so, whose steps then compute alike
    in a FULL graph and in pieces. ``plan``: the step's (the context's)."""
    cfg, g = caches.cfg, view.graph
    swa = caches.swa[layer]
    use_triton = _use_triton(cfg.attention_impl, q.device)
    _write_kv(layer, kv, compress, g.rows, g.slot_mapping, g.derived[COMP_SLOTS].view(-1), caches, use_triton)
    glob, ratio = _global_keys(layer, caches)
    out.zero_()  # the padding rows, which no block covers
    if cfg.attention_impl == "flashinfer":  # a FULL step's plans cover the padding rows, planned before it
        flashinfer_run.attend(q, out, swa, glob, ratio, view, view.replay, sink,
                              in_full_graph=plan is not None and plan.kind is StepKind.FULL)
        return
    scale = q.shape[-1] ** -0.5
    blocks = g.derived[ATTN_BLOCKS]
    if use_triton:
        attention_triton.attend(q, out, swa, glob, ratio, blocks, cfg.window, view.replay, sink, scale,
                                g.max_model_len if cfg.attention_split else 0)
    else:
        attention_graph.attend_blocks(q, out, swa, glob, ratio, blocks, cfg.window, view.replay, sink, scale,
                                      g.max_model_len)


def _swa_attention(q, kv, sink, out, layer: int) -> None:
    """Layers below the first KV source: own sliding-window KV only."""
    _run_attention(layer, q, kv, sink, out)


def _global_attention(q, kv, sink, out, layer: int) -> None:
    """Own SWA KV plus the global KV of the latest source below (replay layers included)."""
    _run_attention(layer, q, kv, sink, out)


def _source_attention(q, kv, comp_kv, comp_gate, comp_norm, sink, out, layer: int) -> None:
    """KV source layers: run the compressor, then attend like ``global_attention``."""
    _run_attention(layer, q, kv, sink, out, compress=(comp_kv, comp_gate, comp_norm))


_ATTN_SCHEMA = "(Tensor q, Tensor kv, Tensor sink, Tensor(a!) out, int layer) -> ()"
swa_attention = define_op("dsv41::swa_attention", _ATTN_SCHEMA, _swa_attention, no_output,
                          compat_dynamo.step_dependent_tags())
global_attention = define_op("dsv41::global_attention", _ATTN_SCHEMA, _global_attention, no_output,
                             compat_dynamo.step_dependent_tags())
source_attention = define_op(
    "dsv41::source_attention",
    "(Tensor q, Tensor kv, Tensor comp_kv, Tensor? comp_gate, Tensor comp_norm, Tensor sink, "
    "Tensor(a!) out, int layer) -> ()",
    _source_attention, no_output, compat_dynamo.step_dependent_tags())


ATTENTION_OPS = (
    "dsv41::swa_attention",
    "dsv41::global_attention",
    "dsv41::source_attention",
)
declare_attention(swa_attention, global_attention, cudagraph_support=cudagraph_support)
# Its compressor writes the global KV.
declare_attention(source_attention, kv_source=True, cudagraph_support=cudagraph_support)
