"""Triton kernel for DSv4.1 attention on CUDA (the reference is attention_reference.py).

One program handles up to ``BLOCK_M`` consecutive rows of one request for one head. The
key set is the union of two contiguous segments: the global entries complete at the
block's last row, and the SWA positions from the block's lowest window start to its
last row; per-row masks cut each row's exact set. The online softmax starts at the
head's sink logit with mass 1, which puts the sink in the denominator and keeps the
running max finite for rows whose keys are all masked.

Few blocks over many global keys (a replay batch of one long prompt: 2 blocks x 16
heads = 32 programs walking 4,096 keys in turn, on a GPU of 132 SMs) leave the GPU
mostly idle while each program loops. Then the global keys are split into chunks, one
program per (block, head, chunk), each writing its unnormalised partial softmax
(running max, mass, weighted sum) to a scratch buffer, and a second kernel merges the
chunks. How many chunks is host arithmetic on the view's sizes (``split_plan``); each
block cuts its own global keys into that many, in whole key tiles, in the kernel.

Everything per step is host-built metadata (one small tensor per view), so the op has
no device-to-host sync.
"""
from __future__ import annotations

import functools

import torch

from ..compat.triton import KeptKernel, aligned, available, tl, triton  # noqa: F401  (available: callers ask this module)

BLOCK_M = 64
BLOCK_N = 64
NUM_FIELDS = 9
# Split the global keys while fewer programs than this many per SM would run, the
# longest block's into chunks of at least MIN_CHUNK keys (below that a chunk's fixed
# cost, its partial's write and read, outweighs the parallelism it adds; a shorter
# block's chunks are shorter, their programs launched and their records written
# anyway), and only from MIN_SPLIT_KEYS on.
# Below it the walk is short and the split's merge launch and scratch buffer cost about
# what it saves (scripts/attention_split_probe.py measures both sides per shape).
PROGRAMS_PER_SM = 4
MIN_CHUNK = 256
MIN_SPLIT_KEYS = 2048


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


def split_plan(num_blocks: int, heads: int, max_global: int, num_sms: int) -> int:
    """How many chunks each (block, head) walks its global keys in, in parallel (1: no
    split): enough to bring the programs up to ``PROGRAMS_PER_SM`` per SM, each chunk of
    the longest block at least MIN_CHUNK keys, where the blocks read at least
    MIN_SPLIT_KEYS global keys."""
    if max_global < MIN_SPLIT_KEYS:
        return 1
    programs = num_blocks * heads
    want = -(-PROGRAMS_PER_SM * num_sms // max(programs, 1))
    return chunks(max_global, min(want, max_global // MIN_CHUNK))


def chunks(max_global: int, splits: int) -> int:
    """How many chunks of whole key tiles ``max_global`` keys take when cut into about
    ``splits`` (fewer where rounding each chunk up to whole tiles leaves some empty).
    The kernel cuts each block's own keys so, the longest block's into this many."""
    if splits < 2 or max_global <= 0:
        return 1
    chunk = -(-max_global // splits)
    chunk = -(-chunk // BLOCK_N) * BLOCK_N
    return -(-max_global // chunk)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    """SMs of a CUDA device (a fixed fact, looked up once); Triton's interpreter runs
    on the CPU, where a split plan needs some count: that of an H200."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


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

    @triton.jit
    def _record(Part, split, bid, h, REC: tl.constexpr):
        """Where the partial record of (chunk, block, head) starts: ``Part`` holds
        [chunks, blocks, heads] records of REC fp32 values (BLOCK_M maxima, BLOCK_M
        masses, then the [BLOCK_M, D] weighted sum); both kernels' grids are (blocks,
        heads, ...)."""
        return Part + ((split * tl.num_programs(0) + bid) * tl.num_programs(1) + h) * REC

    # The strides, the layer's kind and whether it splits are constexprs, and ``window``
    # is not specialised on: with the pointers' 16-byte alignment (which Triton
    # specialises on, and ``attend`` puts in its key) and the dtypes, they fix the build
    # (KeptKernel).
    @triton.jit(do_not_specialize=["window"])
    def _attn_kernel(Q, Kswa, Kglob, Out, Sink, Blocks, Part, window, scale,
                     STRIDE_QT: tl.constexpr, STRIDE_QH: tl.constexpr, STRIDE_OT: tl.constexpr,
                     STRIDE_OH: tl.constexpr, FLOORED: tl.constexpr, RATIO: tl.constexpr,
                     HAS_GLOB: tl.constexpr, SPLIT: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
        bid = tl.program_id(0)
        h = tl.program_id(1)
        split = tl.program_id(2)
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
        # The sink and the SWA keys belong to chunk 0; the other chunks start empty, at
        # a running max of -1e30: finite, so a tile of masked keys rescales by exp(0).
        first = split == 0
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.where(first, sink, -1.0e30)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32) + first.to(tl.float32)
        acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
        if HAS_GLOB:
            gbase = base // RATIO
            g_row = (pos + 1) // RATIO
            if SPLIT:
                # Each block cuts its own keys into the grid's chunks: a FULL graph's grid
                # is sized for the longest sequence it may serve, and a shorter one
                # still spreads over every chunk instead of filling the first alone.
                chunk = tl.cdiv(tl.cdiv(g_last, tl.num_programs(2)), BLOCK_N) * BLOCK_N
                g_lo = split * chunk
                g_hi = tl.minimum(g_lo + chunk, g_last)
            else:
                g_lo = 0
                g_hi = g_last
            for start in range(g_lo, g_hi, BLOCK_N):
                offs_n = start + tl.arange(0, BLOCK_N)
                k = tl.load(Kglob + (gbase + offs_n)[:, None] * D + offs_d[None, :],
                            mask=(offs_n < g_hi)[:, None], other=0.0)
                m_i, l_i, acc = _online_step(q, k, offs_n[None, :] < g_row[:, None], m_i, l_i, acc,
                                             scale, PRECISION)
        lo_row = tl.maximum(tl.maximum(pos - window + 1, floor), 0)
        hi = tl.where(first, pos0 + nrows, lo)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            k = tl.load(Kswa + (base + offs_n)[:, None] * D + offs_d[None, :],
                        mask=(offs_n < hi)[:, None], other=0.0)
            ok = (offs_n[None, :] >= lo_row[:, None]) & (offs_n[None, :] <= pos[:, None])
            m_i, l_i, acc = _online_step(q, k, ok, m_i, l_i, acc, scale, PRECISION)
        if SPLIT:  # the block's rows only: a decode block holds one row of BLOCK_M
            rec = _record(Part, split, bid, h, BLOCK_M * (D + 2))
            tl.store(rec + offs_m, m_i, mask=rmask)
            tl.store(rec + BLOCK_M + offs_m, l_i, mask=rmask)
            tl.store(rec + 2 * BLOCK_M + offs_m[:, None] * D + offs_d[None, :], acc, mask=rmask[:, None])
        else:
            out = acc / l_i[:, None]
            tl.store(Out + (row0 + offs_m)[:, None] * STRIDE_OT + h * STRIDE_OH + offs_d[None, :],
                     out.to(Out.dtype.element_ty), mask=rmask[:, None])

    @triton.jit(do_not_specialize=["splits"])
    def _merge_kernel(Part, Out, Blocks, splits, STRIDE_OT: tl.constexpr, STRIDE_OH: tl.constexpr,
                      D: tl.constexpr, BLOCK_M: tl.constexpr):
        """The chunks' partial softmaxes of one (block, head) as one: rescaled to their
        common max, summed, normalised."""
        bid = tl.program_id(0)
        h = tl.program_id(1)
        row0 = tl.load(Blocks + bid * 9)  # NUM_FIELDS
        nrows = tl.load(Blocks + bid * 9 + 1)
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D)
        # Rows past the block's own were never written: they read as an empty partial
        # (no mass), and their output is never stored.
        rmask = offs_m < nrows
        m = tl.zeros([BLOCK_M], dtype=tl.float32) - 1.0e30
        for s in range(0, splits):
            m = tl.maximum(m, tl.load(_record(Part, s, bid, h, BLOCK_M * (D + 2)) + offs_m, mask=rmask,
                                      other=-1.0e30))
        l_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
        for s in range(0, splits):
            rec = _record(Part, s, bid, h, BLOCK_M * (D + 2))
            w = tl.exp(tl.load(rec + offs_m, mask=rmask, other=-1.0e30) - m)
            l_sum += tl.load(rec + BLOCK_M + offs_m, mask=rmask, other=0.0) * w
            acc += tl.load(rec + 2 * BLOCK_M + offs_m[:, None] * D + offs_d[None, :], mask=rmask[:, None],
                           other=0.0) * w[:, None]
        out = acc / l_sum[:, None]
        tl.store(Out + (row0 + offs_m)[:, None] * STRIDE_OT + h * STRIDE_OH + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=rmask[:, None])

    _KERNEL = KeptKernel(_attn_kernel)
    _MERGE = KeptKernel(_merge_kernel)


def attend(q: torch.Tensor, out: torch.Tensor, swa: torch.Tensor, glob: torch.Tensor | None,
           ratio: int, blocks: torch.Tensor, window: int, floored: bool, sink: torch.Tensor,
           scale: float, max_seq_len: int = 0, splits: int | None = None) -> None:
    """Write attention for every row covered by ``blocks`` into ``out`` ([T, heads, D]).

    ``max_seq_len``: the longest sequence among the view's requests, which bounds the
    global keys any block reads (0: unknown, no split). ``splits`` forces a chunk count
    (tests); by default ``split_plan`` picks it."""
    nb = blocks.shape[0]
    if nb == 0:
        return
    heads, d = q.shape[1], q.shape[2]
    if q.stride(2) != 1 or out.stride(2) != 1 or not swa.is_contiguous():
        raise ValueError("attention inputs must be contiguous in the head dim")
    has_glob = glob is not None
    max_global = max_seq_len // ratio if has_glob else 0
    splits = split_plan(nb, heads, max_global, _num_sms(q.device)) if splits is None else chunks(max_global, splits)
    split = splits > 1
    # The chunks' partial records, fp32. Per call: between pieces the caching allocator
    # serves it, inside a FULL graph the graph's pool. Without a split the kernel never
    # touches it, and ``sink`` stands in.
    part = torch.empty(splits * nb * heads * BLOCK_M * (d + 2), dtype=torch.float32,
                       device=q.device) if split else sink
    ptrs = (q, swa, glob if has_glob else swa, out, sink, blocks, part)
    consts = {"STRIDE_QT": q.stride(0), "STRIDE_QH": q.stride(1), "STRIDE_OT": out.stride(0),
              "STRIDE_OH": out.stride(1), "FLOORED": bool(floored), "RATIO": ratio, "HAS_GLOB": has_glob,
              "SPLIT": split, "D": d, "BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N,
              # fp32 models get exact fp32 dots (the tests' tight comparisons); bf16 uses tensor cores.
              "PRECISION": "ieee" if q.dtype == torch.float32 else "tf32"}
    key = (q.device.index, *[x.dtype for x in ptrs], *aligned(*ptrs), *consts.values())
    _KERNEL(key, (nb, heads, splits), q.device, (*ptrs, window, scale), consts)
    if split:
        mconsts = {"STRIDE_OT": out.stride(0), "STRIDE_OH": out.stride(1), "D": d, "BLOCK_M": BLOCK_M}
        mkey = (q.device.index, out.dtype, *aligned(part, out, blocks), *mconsts.values())
        _MERGE(mkey, (nb, heads, 1), q.device, (part, out, blocks, splits), mconsts)
