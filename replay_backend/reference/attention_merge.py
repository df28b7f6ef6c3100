"""Two attention states and a per-head sink merged into one softmax's output.

A softmax over a union of disjoint key sets is the mix of the softmaxes over each set,
each weighted by its mass ``exp(lse)``; the sink adds ``exp(sink)`` to the denominator
only. attention_flashinfer.py computes one state per key set with FlashInfer (whose
log-sum-exp is base 2) and merges them here: one Triton kernel on CUDA, PyTorch ops
elsewhere.
"""
from __future__ import annotations

import math

import torch

from ..compat.triton import KeptKernel, aligned, tl, triton
from ..compat.triton import available as triton_available

LN2 = math.log(2.0)


def merge(out: torch.Tensor, o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor | None,
          lse_b: torch.Tensor | None, sink: torch.Tensor, b_rows: torch.Tensor | None = None) -> None:
    """``out`` = the softmax over both states' keys and the sink: each state weighted by
    its mass ``exp(lse)`` (base-2 ``lse``, FlashInfer's), the sink adding ``exp(sink)`` to
    the denominator only. A state without keys (lse -inf) weighs nothing. ``b_rows``
    (int32 or int64, one per row of ``out``) is where row ``i``'s second state lies in
    ``o_b`` and ``lse_b``, for a state computed with its rows permuted (None: row ``i``)."""
    if out.shape[0] == 0:
        return
    if triton_available() and out.is_cuda:
        _merge_triton(out, o_a, lse_a, o_b, lse_b, sink, b_rows)
        return
    if o_b is not None and b_rows is not None:
        o_b, lse_b = o_b.index_select(0, b_rows), lse_b.index_select(0, b_rows)
    # A state without keys has lse -inf (a NaN where its kernel divided 0 by 0): no weight.
    a = torch.nan_to_num(lse_a * LN2, nan=-math.inf)
    s = sink.float()[None, :]
    m = torch.maximum(a, s)
    states = [(o_a, a)]
    if o_b is not None:
        b = torch.nan_to_num(lse_b * LN2, nan=-math.inf)
        m = torch.maximum(m, b)
        states.append((o_b, b))
    den = torch.exp(s - m)
    acc = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
    for o, lse in states:
        w = torch.exp(lse - m)
        den = den + w
        acc += torch.where(w[..., None] > 0, o.float() * w[..., None], 0.0)
    out.copy_((acc / den[..., None]).to(out.dtype))


if triton is not None:
    # No alignment is assumed where it varies from call to call, so one build serves
    # them all: ``BRows`` is a slice of a plan's device arrays at any int32 offset, and
    # ``LB`` the second row of the states' shared lse, ``rows * heads`` floats in.
    @triton.jit(do_not_specialize=["heads"], do_not_specialize_on_alignment=["LB", "BRows"])
    def _merge_kernel(Out, OA, LA, OB, LB, BRows, Sink, heads, STRIDE_OT: tl.constexpr, STRIDE_OH: tl.constexpr,
                      HAS_B: tl.constexpr, B_ROWS: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr):
        """One row: its heads' states and sink merged (see :func:`merge`)."""
        row = tl.program_id(0)
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, D)
        hmask = offs_h < heads
        state = row * heads + offs_h  # lse [rows, heads] and o [rows, heads, D], contiguous
        tile = state[:, None] * D + offs_d[None, :]
        s = tl.load(Sink + offs_h, mask=hmask, other=0.0).to(tl.float32)
        a = tl.load(LA + state, mask=hmask, other=float("-inf")) * 0.6931471805599453
        a = tl.where(a == a, a, float("-inf"))
        m = tl.maximum(a, s)
        if HAS_B:
            if B_ROWS:
                state_b = tl.load(BRows + row).to(tl.int32) * heads + offs_h
            else:
                state_b = state
            b = tl.load(LB + state_b, mask=hmask, other=float("-inf")) * 0.6931471805599453
            b = tl.where(b == b, b, float("-inf"))
            m = tl.maximum(m, b)
        wa = tl.exp(a - m)
        den = wa + tl.exp(s - m)
        oa = tl.load(OA + tile, mask=hmask[:, None], other=0.0).to(tl.float32)
        acc = tl.where(wa[:, None] > 0, oa * wa[:, None], 0.0)
        if HAS_B:
            wb = tl.exp(b - m)
            den += wb
            ob = tl.load(OB + state_b[:, None] * D + offs_d[None, :], mask=hmask[:, None], other=0.0).to(tl.float32)
            acc += tl.where(wb[:, None] > 0, ob * wb[:, None], 0.0)
        dst = Out + row * STRIDE_OT + offs_h[:, None] * STRIDE_OH + offs_d[None, :]
        tl.store(dst, (acc / den[:, None]).to(Out.dtype.element_ty), mask=hmask[:, None])

    _MERGE = KeptKernel(_merge_kernel)


def _merge_triton(out, o_a, lse_a, o_b, lse_b, sink, b_rows=None) -> None:
    rows, heads, d = out.shape
    if out.stride(2) != 1:
        raise ValueError("attention output must be contiguous in the head dim")
    has_b = o_b is not None
    by_rows = has_b and b_rows is not None
    if by_rows and b_rows.shape != (rows,):
        raise ValueError(f"b_rows must hold one index per output row ({rows}), got shape {tuple(b_rows.shape)}")
    ptrs = (out, o_a, lse_a, o_b if has_b else o_a, lse_b if has_b else lse_a, b_rows if by_rows else sink, sink)
    consts = {"STRIDE_OT": out.stride(0), "STRIDE_OH": out.stride(1), "HAS_B": has_b, "B_ROWS": by_rows, "D": d,
              "BLOCK_H": triton.next_power_of_2(heads)}
    key = (out.device.index, *[x.dtype for x in ptrs], *aligned(*ptrs[:4], ptrs[6]), *consts.values())
    _MERGE(key, (rows, 1, 1), out.device, (*ptrs, heads), consts)
