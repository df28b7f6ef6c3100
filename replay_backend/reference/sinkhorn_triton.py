"""Triton kernel for the mHC Sinkhorn mix (softmax, then alternating normalisation).

The reference (``layers.sinkhorn``) is ``1 + 2 * iters`` small reductions, which
Inductor emits as about two kernels per iteration: 40 launches per hyper-connection
at 20 iterations, 3,200 per forward of a 40-layer model. Here one program keeps
``BLOCK`` tokens' ``hc x hc`` matrices in registers for all iterations: one launch.
"""
from __future__ import annotations

import torch

from ..compat.triton import KeptKernel, aligned, available, tl, triton  # noqa: F401  (available: callers ask this module)

BLOCK = 64


if triton is not None:
    # ``n_rows`` is not specialised on and the stride is a constexpr: with the pointers'
    # alignment (in ``sinkhorn``'s key) and the dtype they fix the build (KeptKernel).
    @triton.jit(do_not_specialize=["n_rows"])
    def _sinkhorn_kernel(x_ptr, out_ptr, n_rows, STRIDE_ROW: tl.constexpr, ITERS: tl.constexpr,
                         HC: tl.constexpr, BLOCK_T: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        i = tl.arange(0, HC)
        j = tl.arange(0, HC)
        mask = (rows < n_rows)[:, None, None]
        cell = i[None, :, None] * HC + j[None, None, :]
        # Rows past the end load zeros: a uniform matrix, finite, never stored.
        m = tl.load(x_ptr + rows[:, None, None].to(tl.int64) * STRIDE_ROW + cell, mask=mask, other=0.0)
        m = m.to(tl.float32)
        m = tl.exp(m - tl.max(m, axis=2, keep_dims=True))
        m = m / tl.sum(m, axis=2, keep_dims=True)
        for _ in tl.static_range(ITERS):
            m = m / tl.sum(m, axis=1, keep_dims=True)
            m = m / tl.sum(m, axis=2, keep_dims=True)
        tl.store(out_ptr + rows[:, None, None].to(tl.int64) * (HC * HC) + cell, m, mask=mask)

    _KERNEL = KeptKernel(_sinkhorn_kernel)


def supports(logits: torch.Tensor) -> bool:
    """[T, hc, hc] with hc a power of two and each row's hc*hc values contiguous."""
    t, a, b = logits.shape
    return a == b and a & (a - 1) == 0 and logits.stride(2) == 1 and logits.stride(1) == a


def sinkhorn(logits: torch.Tensor, iters: int) -> torch.Tensor:
    t, hc, _ = logits.shape
    out = torch.empty((t, hc, hc), dtype=torch.float32, device=logits.device)
    if t:
        consts = {"STRIDE_ROW": logits.stride(0), "ITERS": iters, "HC": hc, "BLOCK_T": BLOCK}
        key = (logits.device.index, logits.dtype, *aligned(logits, out), *consts.values())
        _KERNEL(key, (triton.cdiv(t, BLOCK), 1, 1), logits.device, (logits, out, t), consts)
    return out
