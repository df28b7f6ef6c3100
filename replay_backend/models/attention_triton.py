"""Triton kernel for DSv4.1 attention on CUDA (the reference stays in attention_ops).

One program handles up to ``BLOCK_M`` consecutive rows of one request for one head. The
key set is the union of two contiguous segments: the global entries complete at the
block's last row, and the SWA positions from the block's lowest window start to its
last row; per-row masks cut each row's exact set. The online softmax starts at the
head's sink logit with mass 1, which puts the sink in the denominator and keeps the
running max finite for rows whose keys are all masked.

Everything per step is host-built metadata (one small tensor per view), so the op has
no device-to-host sync.
"""
from __future__ import annotations

import torch

from ._triton import KeptKernel, aligned, available, tl, triton  # noqa: F401  (available: callers ask this module)

BLOCK_M = 64
NUM_FIELDS = 9


def row_blocks(query_start_loc, seq_lens, kv_start, cache_base, window: int,
               block_m: int = BLOCK_M) -> list[int]:
    """Host metadata, ``NUM_FIELDS`` ints per block of rows, flat: ``row0, nrows, pos0,
    cache_base, floor``, the block's first SWA key without / with the floor, and its
    global entry count for ratio 1 / ratio 2 (scalars are precomputed here so the kernel
    only loads them). Flat, as it goes into the step's metadata tensor: every step builds
    it on the host before its first kernel, so no list per block."""
    out: list[int] = []
    add = out.extend
    for i, seq_len in enumerate(seq_lens):
        r0, r1 = query_start_loc[i], query_start_loc[i + 1]
        shift, base, floor = seq_len - r1, cache_base[i], kv_start[i]  # row r holds position r + shift
        for a in range(r0, r1, block_m):
            pos0 = a + shift
            end = pos0 + min(block_m, r1 - a)  # the block's last position + 1
            lo = max(pos0 - window + 1, 0)
            add((a, end - pos0, pos0, base, floor, min(lo, end), min(max(lo, floor), end), end, end // 2))
    return out


if triton is not None:

    @triton.jit
    def _online_step(q, k, valid, m_i, l_i, acc, scale, PRECISION: tl.constexpr):
        """One key tile of the online softmax; masked keys contribute nothing."""
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(k.dtype), k, input_precision=PRECISION)
        return m_new, l_i, acc

    # The strides and the layer's kind are constexprs and ``window`` is not specialised
    # on: with the pointers' 16-byte alignment (which Triton specialises on, and
    # ``attend`` puts in its key) and the dtypes, they fix the build (KeptKernel).
    @triton.jit(do_not_specialize=["window"])
    def _attn_kernel(Q, Kswa, Kglob, Out, Sink, Blocks, window, scale,
                     STRIDE_QT: tl.constexpr, STRIDE_QH: tl.constexpr, STRIDE_OT: tl.constexpr,
                     STRIDE_OH: tl.constexpr, FLOORED: tl.constexpr, RATIO: tl.constexpr,
                     HAS_GLOB: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     PRECISION: tl.constexpr):
        bid = tl.program_id(0)
        h = tl.program_id(1)
        meta = Blocks + bid * 9  # NUM_FIELDS
        row0 = tl.load(meta)
        nrows = tl.load(meta + 1)
        pos0 = tl.load(meta + 2)
        base = tl.load(meta + 3)
        if FLOORED:
            floor = tl.load(meta + 4)
            lo = tl.load(meta + 6)
        else:
            floor = tl.load(meta + 4) * 0
            lo = tl.load(meta + 5)
        if RATIO == 1:
            g_last = tl.load(meta + 7)
        else:
            g_last = tl.load(meta + 8)
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D)
        rmask = offs_m < nrows
        q = tl.load(Q + (row0 + offs_m)[:, None] * STRIDE_QT + h * STRIDE_QH + offs_d[None, :],
                    mask=rmask[:, None], other=0.0)
        pos = pos0 + offs_m
        sink = tl.load(Sink + h).to(tl.float32)
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + sink
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32) + 1.0
        acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
        if HAS_GLOB:
            gbase = base // RATIO
            g_row = (pos + 1) // RATIO
            for start in range(0, g_last, BLOCK_N):
                offs_n = start + tl.arange(0, BLOCK_N)
                k = tl.load(Kglob + (gbase + offs_n)[:, None] * D + offs_d[None, :],
                            mask=(offs_n < g_last)[:, None], other=0.0)
                m_i, l_i, acc = _online_step(q, k, offs_n[None, :] < g_row[:, None], m_i, l_i, acc,
                                             scale, PRECISION)
        lo_row = tl.maximum(tl.maximum(pos - window + 1, floor), 0)
        hi = pos0 + nrows
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            k = tl.load(Kswa + (base + offs_n)[:, None] * D + offs_d[None, :],
                        mask=(offs_n < hi)[:, None], other=0.0)
            ok = (offs_n[None, :] >= lo_row[:, None]) & (offs_n[None, :] <= pos[:, None])
            m_i, l_i, acc = _online_step(q, k, ok, m_i, l_i, acc, scale, PRECISION)
        out = acc / l_i[:, None]
        tl.store(Out + (row0 + offs_m)[:, None] * STRIDE_OT + h * STRIDE_OH + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=rmask[:, None])

    _KERNEL = KeptKernel(_attn_kernel)


def attend(q: torch.Tensor, out: torch.Tensor, swa: torch.Tensor, glob: torch.Tensor | None,
           ratio: int, blocks: torch.Tensor, window: int, floored: bool, sink: torch.Tensor,
           scale: float) -> None:
    """Write attention for every row covered by ``blocks`` into ``out`` ([T, heads, D])."""
    nb = blocks.shape[0]
    if nb == 0:
        return
    heads, d = q.shape[1], q.shape[2]
    if q.stride(2) != 1 or out.stride(2) != 1 or not swa.is_contiguous():
        raise ValueError("attention inputs must be contiguous in the head dim")
    has_glob = glob is not None
    ptrs = (q, swa, glob if has_glob else swa, out, sink, blocks)
    consts = {"STRIDE_QT": q.stride(0), "STRIDE_QH": q.stride(1), "STRIDE_OT": out.stride(0),
              "STRIDE_OH": out.stride(1), "FLOORED": bool(floored), "RATIO": ratio, "HAS_GLOB": has_glob,
              "D": d, "BLOCK_M": BLOCK_M, "BLOCK_N": 64,
              # fp32 models get exact fp32 dots (the tests' tight comparisons); bf16 uses tensor cores.
              "PRECISION": "ieee" if q.dtype == torch.float32 else "tf32"}
    key = (q.device.index, *[x.dtype for x in ptrs], *aligned(*ptrs), *consts.values())
    _KERNEL(key, (nb, heads, 1), q.device, (*ptrs, window, scale), consts)
