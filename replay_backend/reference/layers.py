"""Building blocks of DSv4.1-mini: RMSNorm, RoPE, manifold hyper-connections (the MoE
is in moe.py)."""
from __future__ import annotations

import torch
from torch import nn

from ..oplib import define_op
from ..passes.roles import declare_row_local
from . import sinkhorn_triton


def init_param(gen: torch.Generator, *shape: int, std: float) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape, generator=gen) * std, requires_grad=False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_angles(positions: torch.Tensor, rope_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, device=positions.device, dtype=torch.float32) / rope_dim))
    ang = positions.float()[:, None] * inv[None, :]
    return torch.cos(ang), torch.sin(ang)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last ``2 * cos.shape[-1]`` dims of ``x`` ([T, ..., D]) by position."""
    r = 2 * cos.shape[-1]
    extra = x.dim() - 2
    c = cos.view(cos.shape[0], *([1] * extra), -1)
    s = sin.view(sin.shape[0], *([1] * extra), -1)
    if inverse:
        s = -s
    nope, rot = x[..., :-r], x[..., -r:].float()
    x1, x2 = rot.chunk(2, dim=-1)
    rot = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).to(x.dtype)
    return torch.cat([nope, rot], dim=-1)


def sinkhorn(logits: torch.Tensor, iters: int) -> torch.Tensor:
    """Softmax over rows, then alternate column/row normalisation: doubly stochastic."""
    m = torch.softmax(logits, dim=-1)
    for _ in range(iters):
        m = m / m.sum(dim=-2, keepdim=True)
        m = m / m.sum(dim=-1, keepdim=True)
    return m


def _sinkhorn_fused(logits: torch.Tensor, iters: int) -> torch.Tensor:
    """:func:`sinkhorn` as one op: one Triton kernel where it can run, else the
    reference. Row-local (each token's matrix alone), no host sync.

    Opaque to Inductor: as a ``triton_op`` (Inductor launches the kernel itself, no
    dispatch into Python) it read its strided input correctly but saved no host time.
    Defined by its schema (oplib.py): in pieces run
    without graphs it is called twice per layer. ``tests/test_gpu.py`` checks this op
    under Inductor with the model's layout."""
    if logits.is_cuda and sinkhorn_triton.available() and sinkhorn_triton.supports(logits):
        return sinkhorn_triton.sinkhorn(logits, iters)
    return sinkhorn(logits.float(), iters)


def _sinkhorn_fake(logits, iters):
    return logits.new_empty(logits.shape, dtype=torch.float32)


sinkhorn_fused = define_op("dsv41::sinkhorn", "(Tensor logits, int iters) -> Tensor", _sinkhorn_fused,
                           _sinkhorn_fake)
declare_row_local(sinkhorn_fused)  # each token's matrix alone


def mm_fp32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` in fp32. For bf16/fp16 CUDA operands that is a tensor-core GEMM with
    an fp32 result: the products of 16-bit values are exact in fp32 and the sums are
    fp32, the same arithmetic as upcasting first, without the fp32 copies and fp32
    (non-tensor-core) GEMM. Elsewhere the operands are upcast."""
    if x.is_cuda and x.dtype == w.dtype and x.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(x, w.t(), out_dtype=torch.float32)
    return x.float() @ w.float().t()


# Init of the mHC mixes (HyperConnection): the projection's scale, relative to one
# that gives mixes of order one per token, and the lead of ``comb``'s diagonal logits.
MIX_PROJECTION_STD = 0.1
COMB_DIAGONAL = 3.0


def branch_std(num_layers: int) -> float:
    """The init scale of a sublayer's output projection: each of the ``2 * num_layers``
    sublayers adds its output to the stream, so the sum stays of the embedding's order."""
    return (2 * num_layers) ** -0.5


class HyperConnection(nn.Module):
    """mHC mixing for one sublayer: from the flattened stream, ``pre``, ``post``, ``comb``.

    The stream is ``[T, hc, H]``; mixes are computed in fp32 from the RMS-scaled stream.
    """

    def __init__(self, hc: int, hidden: int, eps: float, hc_eps: float, iters: int,
                 gen: torch.Generator, sinkhorn_impl: str = "reference") -> None:
        super().__init__()
        self.hc, self.eps, self.hc_eps, self.iters = hc, eps, hc_eps, iters
        self.sinkhorn_impl = sinkhorn_impl
        n = 2 * hc + hc * hc
        # Near identity at init, as a trained model's mixing starts: each stream mostly
        # keeps itself (``comb`` logits lead on the diagonal) and the mixes vary little
        # from token to token (a small projection). With mixes of order one per token
        # the stream is chaotic over 80 sublayers: a rounding step at the embedding
        # moves the last logits by tens of percent (docs/design.md).
        self.weight = init_param(gen, n, hc * hidden, std=MIX_PROJECTION_STD * (hc * hidden) ** -0.5)
        bias = torch.randn(n, generator=gen) * 0.5
        bias[2 * hc:] += COMB_DIAGONAL * torch.eye(hc).flatten()
        self.bias = nn.Parameter(bias, requires_grad=False)

    def forward(self, stream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t, hc = stream.shape[0], self.hc
        flat = stream.reshape(t, -1)
        # The RMS scale is per row, so it applies after the projection: the GEMM then
        # reads the stream as it is instead of a normalised fp32 copy ([T, hc*H], the
        # largest tensor of the layer, written and read once per sublayer).
        scale = torch.rsqrt(flat.float().pow(2).mean(-1, keepdim=True) + self.eps)
        mix = mm_fp32(flat, self.weight) * scale + self.bias.float()
        pre = torch.sigmoid(mix[:, :hc]) + self.hc_eps
        post = 2.0 * torch.sigmoid(mix[:, hc:2 * hc])
        logits = mix[:, 2 * hc:].view(t, hc, hc)
        if self.sinkhorn_impl == "fused":
            comb = torch.ops.dsv41.sinkhorn(logits, self.iters)
        else:
            comb = sinkhorn(logits, self.iters)
        return pre, post, comb


def hc_merge(hidden: torch.Tensor, residual: torch.Tensor, post: torch.Tensor,
             comb: torch.Tensor) -> torch.Tensor:
    """``new[j] = post[j] * hidden + sum_i comb[i, j] * residual[i]`` (fp32 mix)."""
    # Unrolled over the hc inputs: pointwise ops that Inductor fuses into one
    # memory-bound kernel. As a batched matmul (T batches of hc x hc @ hc x H) this was
    # an fp32 cuBLAS kernel taking a third of the GPU time of an 8K-token prefill.
    res = residual.float()
    out = post[..., None] * hidden.float()[:, None, :]
    for i in range(residual.shape[1]):
        out = out + comb[:, i, :, None] * res[:, i, None, :]
    return out.to(residual.dtype)


def hc_collapse(stream: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    return (pre[..., None] * stream.float()).sum(1).to(stream.dtype)
