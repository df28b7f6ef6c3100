"""The trim op's row moves on steps without trim I/O graphs, in one launch each way.

A step whose main layers run without graphs has no fixed addresses to capture the
gathers against (trim_io.py), so per step the op gathers every row tensor into the
region's inputs and scatters the region's outputs back. As PyTorch ops that is a launch
per row tensor (``index_select``, tens of microseconds of host time each)
plus a fill and an ``index_copy_`` per output. Here one Triton kernel gathers the
replay rows of all row tensors (one program per row and tensor) and one writes every
output whole: each main row takes its replay row's result, or zeros when trimmed.

The scatter finds a main row's replay row by binary search in the replay rows, which
``ReplayBatch`` keeps ascending and unique (batch.replay_rows). Each kernel takes up to
``MAX_TENSORS`` tensors of any dtypes, each with contiguous rows. On the CPU the
PyTorch ops run; on CUDA so do they, as a counted fallback, where Triton is missing, a
layout does not fit or the kernel fails to build. The checks use shapes only (Python
ints), and run once per signature of the tensors (``RowMoves``): run per step, they cost
about as much host time as one of the launches.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from ..fallbacks import Fallback
from ..compat import graphs as compat_graphs
from ..compat.triton import INTERPRETED, kept_launch, tl, triton

MAX_TENSORS = 6
BLOCK = 1024


if triton is not None:
    @triton.jit
    def _copy_row(src, dst, width, src_row, dst_row, keep, BLOCK: tl.constexpr, ROW_BLOCKS: tl.constexpr):
        # ``keep`` false: nothing loaded, zeros stored, so trimmed rows are never stale
        # (a bound rather than ``inside & keep``: one comparison makes the load's mask).
        # A static loop over the widest row: a runtime bound is a Python ``range`` over a
        # tensor in Triton's interpreter, which numpy 2 refuses.
        limit = tl.where(keep, width, 0)
        for i in tl.static_range(ROW_BLOCKS):
            offs = i * BLOCK + tl.arange(0, BLOCK)
            v = tl.load(src + src_row * width + offs, mask=offs < limit, other=0)
            tl.store(dst + dst_row * width + offs, v, mask=offs < width)

    # n and the widths change with the step: not specialised on, so one build per
    # direction and dtype signature serves every step (warmed at capture, ``RowMoves.warm``).
    # Nor is pointer alignment: a row starts at ``row * width`` for a width the build does
    # not know, so alignment would not widen a load, and the build is then fixed by the
    # dtypes and constexprs alone (``Plan.key``).
    @triton.jit(do_not_specialize=["n", "w0", "w1", "w2", "w3", "w4", "w5"],
                do_not_specialize_on_alignment=["rows", "s0", "s1", "s2", "s3", "s4", "s5",
                                                "d0", "d1", "d2", "d3", "d4", "d5"])
    def _move(rows, n, s0, s1, s2, s3, s4, s5, d0, d1, d2, d3, d4, d5, w0, w1, w2, w3, w4, w5,
              SCATTER: tl.constexpr, SEARCH_STEPS: tl.constexpr, BLOCK: tl.constexpr, ROW_BLOCKS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        t = tl.program_id(1)
        if SCATTER:  # ``row`` is a main row: find it among the ``n`` ascending replay rows
            lo = row * 0
            hi = lo + n
            for _ in tl.static_range(SEARCH_STEPS):
                active = lo < hi
                mid = (lo + hi) // 2
                v = tl.load(rows + mid, mask=active, other=0)
                right = active & (v < row)
                lo = tl.where(right, mid + 1, lo)
                hi = tl.where(active & (v >= row), mid, hi)
            keep = (lo < n) & (tl.load(rows + lo, mask=lo < n, other=-1) == row)
            src_row = lo
        else:  # ``row`` is a replay row: gather its main row
            keep = row < n
            src_row = tl.load(rows + row)
        dst_row = row
        if t == 0:
            _copy_row(s0, d0, w0, src_row, dst_row, keep, BLOCK, ROW_BLOCKS)
        elif t == 1:
            _copy_row(s1, d1, w1, src_row, dst_row, keep, BLOCK, ROW_BLOCKS)
        elif t == 2:
            _copy_row(s2, d2, w2, src_row, dst_row, keep, BLOCK, ROW_BLOCKS)
        elif t == 3:
            _copy_row(s3, d3, w3, src_row, dst_row, keep, BLOCK, ROW_BLOCKS)
        elif t == 4:
            _copy_row(s4, d4, w4, src_row, dst_row, keep, BLOCK, ROW_BLOCKS)
        else:
            _copy_row(s5, d5, w5, src_row, dst_row, keep, BLOCK, ROW_BLOCKS)


def _row_width(x: torch.Tensor) -> int | None:
    """Elements per row when ``x``'s rows are contiguous and packed, else None."""
    if x.dim() == 0 or not x.is_contiguous():
        return None
    return math.prod(x.shape[1:])


def row_blocks(width: int) -> int:
    """Blocks per row for the widest row, a power of two (one build per model)."""
    return 1 << max(0, -(-width // BLOCK) - 1).bit_length()


def search_steps(n: int) -> int:
    """Binary-search iterations for ``n`` replay rows: 16 up to 65,535 rows, so that one
    build serves every step (spare iterations do nothing)."""
    return max(16, max(n, 1).bit_length())


def fit(srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor], rows_t: torch.Tensor,
        scatter: bool) -> list[int] | str:
    """The row widths of the (src, dst) pairs, or why the kernel cannot move them."""
    if not 0 < len(srcs) <= MAX_TENSORS or len(srcs) != len(dsts):
        return f"{len(srcs)} tensors into {len(dsts)} (the kernel takes 1 to {MAX_TENSORS} pairs)"
    n, widths, cuda = rows_t.shape[0], [], rows_t.is_cuda
    for i, (a, b) in enumerate(zip(srcs, dsts)):
        if a.is_cuda != cuda or b.is_cuda != cuda:  # the launcher's error would disable the kernel
            return f"tensor {i}: on {a.device} / {b.device} with the rows on {rows_t.device}"
        if a.dtype != b.dtype:
            return f"tensor {i}: {a.dtype} into {b.dtype}"
        w = _row_width(a)
        if w is None or w != _row_width(b):
            return f"tensor {i}: rows not contiguous or of unequal widths ({tuple(a.shape)}, {tuple(b.shape)})"
        if (a if scatter else b).shape[0] < n or a.shape[0] != srcs[0].shape[0] or b.shape[0] != dsts[0].shape[0]:
            return f"tensor {i}: {a.shape[0]} / {b.shape[0]} rows for {n} replay rows"
        widths.append(w)
    return widths


class Plan(NamedTuple):
    """The checked layout of one signature (direction, tensor count, the sources' and the
    destinations' row count): what each launch for it passes besides the tensors."""

    k: int  # tensors
    limit: int  # most replay rows a launch may move: the rows of the side they index
    widths: tuple[int, ...]  # row widths, then zeros for the unused slots
    consts: tuple  # SCATTER, SEARCH_STEPS, BLOCK, ROW_BLOCKS
    device: int | None  # the CUDA device, for its current stream
    key: tuple  # the build's key: the constexprs and dtypes fix it


def make_plan(srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor], rows_t: torch.Tensor,
              scatter: bool) -> Plan | str:
    """:func:`fit`'s checks, then the launch arguments they fix, or why the kernel
    cannot move these tensors."""
    widths = fit(srcs, dsts, rows_t, scatter)
    if isinstance(widths, str):
        return widths
    limit = (srcs if scatter else dsts)[0].shape[0]
    # SEARCH_STEPS from the limit: enough for any n up to it, and 16 (one build) below 65,536.
    consts = (scatter, search_steps(limit) if scatter else 0, BLOCK, row_blocks(max(widths)))
    device = rows_t.device.index
    # Pad slots repeat tensor 0 and fit() checked each pair's dtypes: this fixes the build.
    key = (device, rows_t.dtype, consts, *(x.dtype for x in srcs))
    return Plan(len(srcs), limit, (*widths, *[0] * (MAX_TENSORS - len(srcs))), consts, device, key)


def arguments(plan: Plan, rows_t: torch.Tensor, srcs: Sequence[torch.Tensor],
              dsts: Sequence[torch.Tensor], raw: bool = False) -> tuple[tuple[int, int, int], tuple]:
    """The grid and the kernel's arguments, constexprs last (unused slots repeat tensor
    0: the grid has ``k`` columns, so they never run). ``raw``: device addresses instead
    of the tensors, for a kept build's launch. Triton's launcher asks the driver about
    every tensor it is given (``cuPointerGetAttribute``, to refuse host memory), 13 per
    launch here, padding included; an address it takes as it is. Host memory is refused
    by :func:`fit` instead, once per signature, whose tensors come from fixed producers
    (``RowMoves``)."""
    n, pad = rows_t.shape[0], MAX_TENSORS - plan.k
    grid = (dsts[0].shape[0] if plan.consts[0] else n, plan.k, 1)
    if raw:
        rows_t, srcs, dsts = rows_t.data_ptr(), [x.data_ptr() for x in srcs], [x.data_ptr() for x in dsts]
    return grid, (rows_t, n, *srcs, *(srcs[0],) * pad, *dsts, *(dsts[0],) * pad, *plan.widths, *plan.consts)


def launch(rows_t: torch.Tensor, srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor],
           scatter: bool, plan: Plan | None = None):
    """The kernel over ``len(srcs)`` (src, dst) pairs through Triton's entry: gather
    ``dsts[i][:n] = srcs[i][rows_t]``, or scatter ``dsts[i][rows_t] = srcs[i][:n]`` with
    the other rows of ``dsts[i]`` zero (n = len(rows_t)). ``plan``: as :func:`make_plan`
    gives it. Returns the build that ran (None under the interpreter or with no rows)."""
    if plan is None:
        plan = make_plan(srcs, dsts, rows_t, scatter)
        if isinstance(plan, str):
            raise ValueError(f"row moves: {plan}")
    grid, args = arguments(plan, rows_t, srcs, dsts)
    if not grid[0]:
        return None
    c = plan.consts
    build = _move[grid](*args[:-len(c)], SCATTER=c[0], SEARCH_STEPS=c[1], BLOCK=c[2], ROW_BLOCKS=c[3])
    return build if hasattr(build, "__getitem__") else None


class RowMoves:
    """Gather into the region and scatter back for the trim op (``ReplayRuntime``): the
    kernel on CUDA, the PyTorch ops elsewhere. Where CUDA tensors cannot take the kernel
    (no Triton, a layout it does not take, a kernel that fails to build) that is a
    fallback: ``fallback(reason, detail)`` counts it, logs it once, or raises when strict.

    The layout checks run once per signature (direction, tensor count, row counts) and
    their result is kept: every step passes new tensors, but from the same producers (a
    compiled piece's outputs, the region's static buffers and graph outputs), whose
    dtypes, devices and row layouts are fixed by their code and row counts. Per step only
    the number of replay rows is checked against the kept limit. A caller whose tensors
    change layout at equal row counts needs a RowMoves of its own.

    Each build is kept by its key and launched directly afterwards (``direct_launcher``):
    Triton's entry derives the build from all 20 arguments on every call, and its
    launch path looks up the device and stream and calls the launch hooks, which cost
    about as much host time as the PyTorch ops the kernel replaces."""

    def __init__(self, fallback: Callable[[str, str], None]) -> None:
        self._fallback = fallback
        self._plans: dict[tuple, Plan | str] = {}  # by signature
        self._launchers: dict[tuple, Callable] = {}  # kept builds by their key (Plan.key)
        self._stream = compat_graphs.raw_stream_getter()
        self._broken: str | None = None if triton is not None else "Triton is not installed"

    def _kernel(self, srcs, dsts, rows_t, scatter: bool) -> bool:
        if not (rows_t.is_cuda or INTERPRETED):
            return False  # the CPU path, not a fallback
        sig = (scatter, len(srcs), srcs[0].shape[0] if srcs else 0, dsts[0].shape[0] if dsts else 0)
        plan = self._plans.get(sig)
        if plan is None:
            plan = self._plans[sig] = make_plan(srcs, dsts, rows_t, scatter)
        why = self._broken or (plan if isinstance(plan, str) else None)
        if why is None and rows_t.shape[0] > plan.limit:
            why = f"{rows_t.shape[0]} replay rows for {plan.limit} rows"
        if why is None:
            try:
                kept = self._launchers.get(plan.key)
                if kept is not None:
                    grid, args = arguments(plan, rows_t, srcs, dsts, raw=True)
                    if grid[0]:
                        kept(grid, self._stream(plan.device), *args)
                else:
                    build = launch(rows_t, srcs, dsts, scatter, plan)
                    if build is not None:
                        self._launchers[plan.key] = kept_launch(build)
                return True
            except Exception as e:  # noqa: BLE001 - the PyTorch ops still serve
                why = self._broken = f"the kernel failed: {type(e).__name__}: {e}"
        self._fallback(Fallback.ROW_MOVES_KERNEL, f"trim op row moves: {why}; a launch per tensor instead")
        return False

    def warm(self, rows: Sequence[torch.Tensor], res: Sequence[torch.Tensor]) -> None:
        """Build both kernels for the dtypes of ``rows`` and ``res`` before serving
        (outside any graph capture), moving one row into scratch tensors: the first
        steps whose main layers run without graphs come after capture."""
        one = torch.zeros(1, dtype=torch.int64, device=rows[0].device)
        self.gather(rows, [torch.empty_like(x[:1]) for x in rows], one)
        self.scatter(res, [torch.empty_like(r) for r in res], one)

    def gather(self, rows: Sequence[torch.Tensor], bufs: Sequence[torch.Tensor], rows_t: torch.Tensor) -> None:
        """``bufs[i][:n] = rows[i][rows_t]`` (n = len(rows_t)); rows past n keep their values."""
        if not self._kernel(rows, bufs, rows_t, scatter=False):
            n = rows_t.shape[0]
            for x, b in zip(rows, bufs):
                if b.shape[0] < n:  # index_select would resize the short view, not fail
                    raise ValueError(f"row moves: {n} replay rows into a buffer of {b.shape[0]} rows")
                torch.index_select(x, 0, rows_t, out=b[:n])

    def scatter(self, res: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], rows_t: torch.Tensor) -> None:
        """``outs[i][rows_t] = res[i][:n]``, every other row of ``outs[i]`` zero."""
        if not self._kernel(res, outs, rows_t, scatter=True):
            n = rows_t.shape[0]
            for r, o in zip(res, outs):
                o.zero_()  # trimmed rows: zeros nobody reads, never stale data
                o.index_copy_(0, rows_t, r[:n])
