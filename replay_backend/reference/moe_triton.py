"""Triton kernels for the grouped MoE's permutation and combine (``moe._moe_grouped``).

The grouped GEMMs take the (token, expert) pairs sorted by expert. In PyTorch that is a
stable sort, a division for each pair's source row and a search for the group ends;
after the GEMMs come the unsort, a cast, the weighting, a sum and a cast back. Each is
a launch on the host's critical path in steps whose main layers run without graphs,
and the sort, unsort and sum were GPU time as well. Here the sort is a counting sort in two
launches, and the SwiGLU between the GEMMs and the combine are one each:

* ``_count``: per block of pairs, how many go to each expert.
* ``_place``: per block, each pair's slot in the sorted order: the start of its
  expert's group, plus that expert's pairs in earlier blocks, plus the earlier ones in
  its own block. That is the stable sort's order, so the GEMMs see the same rows in the
  same order as after ``torch.sort``, and the group ends are the same.
* ``_silu_mul``: between the GEMMs, ``silu(g) * u`` in one pass (PyTorch: two
  elementwise kernels, 1.2 ms of GPU time in a 4,096-token step of mini-2k), rounded
  where PyTorch rounds: the SiLU to the dtype, then the product. Its exp and division
  are the accurate ones (libdevice's ``exp``, ``div_rn``), as in PyTorch's kernel.
* ``_combine``: per token, the fp32 products of its pairs' GEMM rows and routing
  weights, summed in pair order and rounded to the output dtype. The products are
  rounded before they are added (the build has fused multiply-add off, as PyTorch's
  separate product and sum have it), so the result is the PyTorch ops' to the bit:
  with top_k <= 2 the order of the sum cannot matter either.

Each kernel's build is fixed by its key (``KeptKernel``): the step's sizes are not
specialised on, so one build per model serves every step.
"""
from __future__ import annotations

import torch

from ..compat.triton import INTERPRETED, KeptKernel, aligned, libdevice, tl, triton
from ..compat.triton import available  # noqa: F401  (callers ask this module)

BLOCK = 256  # pairs per program of the counting sort
MAX_BLOCKS = 256  # blocks one sort takes: every program reads all blocks' counts
MAX_PAIRS = BLOCK * MAX_BLOCKS  # 32,768 tokens at top_k 2; larger steps sort in PyTorch
BLOCK_H = 1024  # hidden columns per program of the combine and of silu(g) * u
# Triton's interpreter (the CPU tests) has no libdevice: its exp is numpy's there.
_ACCURATE_EXP = not INTERPRETED


if triton is not None:
    @triton.jit(do_not_specialize=["n_pairs"])
    def _count(top_i, counts, n_pairs, E_PAD: tl.constexpr, BLOCK: tl.constexpr):
        b = tl.program_id(0)
        q = b * BLOCK + tl.arange(0, BLOCK)
        e = tl.load(top_i + q, mask=q < n_pairs, other=-1)  # -1: a pad pair hits no expert
        ex = tl.arange(0, E_PAD)
        hit = (e[:, None] == ex[None, :]).to(tl.int32)
        tl.store(counts + b * E_PAD + ex, tl.sum(hit, axis=0))

    @triton.jit(do_not_specialize=["n_pairs"])
    def _place(top_i, counts, ends, src_rows, slot_of, n_pairs, E: tl.constexpr, E_PAD: tl.constexpr,
               K: tl.constexpr, BLOCK: tl.constexpr, MAX_BLOCKS: tl.constexpr):
        b = tl.program_id(0)
        blocks = tl.arange(0, MAX_BLOCKS)
        ex = tl.arange(0, E_PAD)
        # Every program reads the whole table of counts (at most MAX_BLOCKS x E_PAD):
        # cheaper than a third launch for the prefix sums.
        table = tl.load(counts + blocks[:, None] * E_PAD + ex[None, :],
                        mask=(blocks < tl.cdiv(n_pairs, BLOCK))[:, None], other=0)
        total = tl.sum(table, axis=0)
        end = tl.cumsum(total, axis=0)  # pairs with expert <= e: the group ends
        earlier = tl.sum(tl.where((blocks < b)[:, None], table, 0), axis=0)
        base = end - total + earlier  # this block's first slot per expert
        if b == 0:
            tl.store(ends + ex, end, mask=ex < E)
        q = b * BLOCK + tl.arange(0, BLOCK)
        inside = q < n_pairs
        e = tl.load(top_i + q, mask=inside, other=-1)
        hit = (e[:, None] == ex[None, :]).to(tl.int32)
        rank = tl.cumsum(hit, axis=0) - hit  # earlier pairs of the same expert in this block
        slot = tl.sum(hit * (base[None, :] + rank), axis=1)
        tl.store(slot_of + q, slot, mask=inside)
        tl.store(src_rows + slot, q // K, mask=inside)

    @triton.jit
    def _silu_mul(gu, h, I: tl.constexpr, BLOCK_I: tl.constexpr, ACCURATE_EXP: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        inside = c < I
        g = tl.load(gu + r * (2 * I) + c, mask=inside, other=0).to(tl.float32)
        u = tl.load(gu + r * (2 * I) + I + c, mask=inside, other=0).to(tl.float32)
        if ACCURATE_EXP:
            e = libdevice.exp(-g)
        else:
            e = tl.exp(-g)
        s = tl.math.div_rn(g, 1.0 + e).to(h.dtype.element_ty).to(tl.float32)
        tl.store(h + r * I + c, (s * u).to(h.dtype.element_ty), mask=inside)

    @triton.jit
    def _combine(y, w, slot_of, out, H: tl.constexpr, K: tl.constexpr, BLOCK_H: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        inside = h < H
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for j in tl.static_range(K):
            p = tl.load(slot_of + t * K + j).to(tl.int64)
            wj = tl.load(w + t * K + j).to(tl.float32)
            acc += tl.load(y + p * H + h, mask=inside, other=0).to(tl.float32) * wj
        tl.store(out + t * H + h, acc.to(out.dtype.element_ty), mask=inside)

    _COUNT = KeptKernel(_count)
    _PLACE = KeptKernel(_place)
    _SILU_MUL = KeptKernel(_silu_mul)
    _COMBINE = KeptKernel(_combine, enable_fp_fusion=False)


def fits(tokens: int, top_k: int) -> bool:
    """Whether one sort takes this many pairs (else the PyTorch ops run)."""
    return tokens * top_k <= MAX_PAIRS


def route(top_i: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pairs of ``top_i`` ([T, K] expert ids) sorted by expert, stably.

    Returns ``src_rows`` (int64, [T*K]: the token of the pair at each sorted slot),
    ``slot_of`` (int32, [T*K]: each pair's slot, pairs in ``top_i``'s order) and
    ``ends`` (int32, [E]: the group ends, as ``torch._grouped_mm`` takes them)."""
    t, k = top_i.shape
    n, dev = t * k, top_i.device
    if not fits(t, k):
        raise ValueError(f"moe route: {n} pairs, more than one sort takes ({MAX_PAIRS})")
    top_i = top_i.contiguous()
    src_rows = torch.empty(n, dtype=torch.int64, device=dev)
    slot_of = torch.empty(n, dtype=torch.int32, device=dev)
    ends = (torch.empty if n else torch.zeros)(num_experts, dtype=torch.int32, device=dev)
    if n:
        e_pad = triton.next_power_of_2(num_experts)
        blocks = triton.cdiv(n, BLOCK)
        counts = torch.empty((blocks, e_pad), dtype=torch.int32, device=dev)
        count_c = {"E_PAD": e_pad, "BLOCK": BLOCK}
        _COUNT((dev.index, top_i.dtype, *aligned(top_i, counts), *count_c.values()), (blocks, 1, 1), dev,
               (top_i, counts, n), count_c)
        place_c = {"E": num_experts, "E_PAD": e_pad, "K": k, "BLOCK": BLOCK, "MAX_BLOCKS": MAX_BLOCKS}
        ptrs = (top_i, counts, ends, src_rows, slot_of)
        _PLACE((dev.index, top_i.dtype, *aligned(*ptrs), *place_c.values()), (blocks, 1, 1), dev,
               (*ptrs, n), place_c)
    return src_rows, slot_of, ends


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """``silu(g) * u`` for ``g, u = gu.chunk(2, dim=-1)`` (``gu``: [P, 2I], rows
    contiguous), in ``gu``'s dtype."""
    p, i = gu.shape[0], gu.shape[1] // 2
    gu = gu.contiguous()
    h = torch.empty((p, i), dtype=gu.dtype, device=gu.device)
    if p:
        consts = {"I": i, "BLOCK_I": min(BLOCK_H, triton.next_power_of_2(i)), "ACCURATE_EXP": _ACCURATE_EXP}
        key = (gu.device.index, gu.dtype, *aligned(gu, h), *consts.values())
        _SILU_MUL(key, (p, triton.cdiv(i, consts["BLOCK_I"]), 1), gu.device, (gu, h), consts)
    return h


def combine(y: torch.Tensor, top_w: torch.Tensor, slot_of: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``out[t] = sum_j y[slot_of[t, j]] * top_w[t, j]`` in fp32, as ``dtype``: the
    GEMM rows ``y`` ([T*K, H], sorted) back in token order, weighted and summed."""
    t, k = top_w.shape
    h = y.shape[1]
    out = torch.empty((t, h), dtype=dtype, device=y.device)
    if t:
        y, top_w = y.contiguous(), top_w.contiguous()
        consts = {"H": h, "K": k, "BLOCK_H": min(BLOCK_H, triton.next_power_of_2(h))}
        ptrs = (y, top_w, slot_of, out)
        key = (y.device.index, *(p.dtype for p in ptrs), *aligned(*ptrs), *consts.values())
        _COMBINE(key, (t, triton.cdiv(h, consts["BLOCK_H"]), 1), y.device, ptrs, consts)
    return out
