"""DSv4.1-mini's MoE: continuous top-k routing, routed experts plus one shared expert
(dense, or grouped GEMMs over the pairs sorted by expert), and its shares over ranks."""
from __future__ import annotations

import torch
from torch import nn

from ..oplib import define_op
from ..passes.roles import declare_row_local
from . import moe_triton
from .layers import init_param, mm_fp32
from .parallel import dep_moe, tp_all_reduce


def route(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k experts of each row and their weights, continuous in ``scores``.

    An expert's weight is its score's lead over the best expert left out, normalised
    over the chosen ones (top-1: relative to its own score): an expert enters or leaves
    the top k with weight zero. With
    the usual normalised top-k scores a near-tie between the k-th and the next expert
    is a jump, which a rounding difference (another GEMM tiling, a fused reduction, a
    padded batch) can take in one run and not in another; then one row's output moves
    by a whole expert's share, and every test of a compiled or trimmed step against
    the eager oracle would see that as an error. Continuous weights turn the same
    rounding difference into an output difference of its own size (docs/design.md).
    """
    if k == scores.shape[-1]:  # every expert chosen: nothing is left out
        return scores / scores.sum(-1, keepdim=True), torch.arange(k, device=scores.device).expand_as(scores)
    vals, idx = torch.topk(scores, k + 1, dim=-1)
    lead = vals[:, :k] - vals[:, k:]
    if k == 1:  # normalised over itself it would always be 1: relative to its own score
        return lead / vals[:, :1], idx[:, :1]
    # All k + 1 scores equal (measure zero): no chosen expert leads, the weights are 0.
    return lead / lead.sum(-1, keepdim=True).clamp_min(torch.finfo(lead.dtype).tiny), idx[:, :k]


class MoE(nn.Module):
    """Routed top-k experts plus one shared expert, SwiGLU.

    Static shapes and no host syncs, so a step can be captured. Two equivalent
    implementations: ``dense`` runs every expert on every row, scaled by the routing
    weight (zero when not selected); ``grouped`` sorts the (row, expert) pairs by expert
    and runs one grouped GEMM per projection (CUDA, ``torch._grouped_mm``).
    """

    def __init__(self, hidden: int, n_exp: int, top_k: int, inter: int, shared: int,
                 gen: torch.Generator, impl: str = "auto", permute_impl: str = "auto",
                 out_std: float = 1.0) -> None:
        super().__init__()
        self.top_k, self.impl, self.permute_impl = top_k, impl, permute_impl
        self.router = init_param(gen, n_exp, hidden, std=hidden ** -0.5)
        self.w_gate_up = init_param(gen, n_exp, 2 * inter, hidden, std=hidden ** -0.5)
        self.w_down = init_param(gen, n_exp, hidden, inter, std=out_std * inter ** -0.5)
        self.s_gate_up = init_param(gen, 2 * shared, hidden, std=hidden ** -0.5)
        self.s_down = init_param(gen, hidden, shared, std=out_std * shared ** -0.5)
        # 0..E-1: the grouped path finds each expert's end in the sorted pairs (not state).
        self.register_buffer("expert_ids", torch.arange(n_exp), persistent=False)
        # Over several ranks (parallel.py): this rank's experts are first_expert onwards.
        self.parallel = None
        self.first_expert = 0

    def shard(self, p) -> None:
        """Keep this rank's experts and its share of the shared expert (parallel.py)."""
        self.parallel = p
        n = self.router.shape[0] // p.ep_size
        self.first_expert = p.ep_rank * n
        if n < self.router.shape[0]:
            self.w_gate_up = nn.Parameter(self.w_gate_up[self.first_expert:self.first_expert + n].clone())
            self.w_down = nn.Parameter(self.w_down[self.first_expert:self.first_expert + n].clone())
            self.expert_ids = torch.arange(n, device=self.expert_ids.device)
        if p.tp_size > 1:  # column- then row-parallel: this rank's slice of the intermediate size
            s = self.s_down.shape[1] // p.tp_size
            lo = p.tp_rank * s
            gate, up = self.s_gate_up.chunk(2, dim=0)
            self.s_gate_up = nn.Parameter(torch.cat([gate[lo:lo + s], up[lo:lo + s]]))
            self.s_down = nn.Parameter(self.s_down[:, lo:lo + s].clone())

    @staticmethod
    def _swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        g, u = (x @ gate_up.t()).chunk(2, dim=-1)
        return (torch.nn.functional.silu(g) * u) @ down.t()

    def _use_grouped(self, x: torch.Tensor) -> bool:
        if self.impl == "dense":
            return False
        ok = x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
        if self.impl == "grouped" and not ok:
            raise RuntimeError("moe_impl='grouped' needs bf16 CUDA tensors and torch._grouped_mm")
        return ok

    def _use_kernels(self) -> bool:
        """The grouped path's sort, SwiGLU and combine as Triton kernels (moe_triton.py)."""
        if self.permute_impl == "triton" and not moe_triton.available():
            raise RuntimeError("moe_permute_impl='triton' but triton is not importable")
        return self.permute_impl != "reference" and moe_triton.available()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.parallel
        if p is not None and p.exchanges:  # DEP: every data-parallel rank's rows meet here
            routed = dep_moe(x, self.router, self.w_gate_up, self.w_down, self.first_expert, self.top_k,
                             p.dp_group.group_name)
            return tp_all_reduce(self._swiglu(x, self.s_gate_up, self.s_down) + routed, p)
        scores = torch.softmax(mm_fp32(x, self.router), dim=-1)
        top_w, top_i = route(scores, self.top_k)
        if self.w_gate_up.shape[0] < scores.shape[1]:  # this rank's experts only (parallel.py)
            out = local_experts(x, top_w, top_i, self.w_gate_up, self.w_down, self.first_expert,
                                self._swiglu(x, self.s_gate_up, self.s_down))
            return tp_all_reduce(out, p)
        if self._use_grouped(x):
            routed = torch.ops.dsv41.moe_grouped(x, top_w, top_i, self.w_gate_up, self.w_down, self.expert_ids,
                                                 self._use_kernels())
            out = self._swiglu(x, self.s_gate_up, self.s_down) + routed
        else:
            combine = torch.zeros_like(scores).scatter(1, top_i, top_w).to(x.dtype)
            out = self._swiglu(x, self.s_gate_up, self.s_down)
            for e in range(self.router.shape[0]):
                out = out + combine[:, e:e + 1] * self._swiglu(x, self.w_gate_up[e], self.w_down[e])
        if p is not None:  # tensor parallel, every expert here: the shared expert is split
            out = tp_all_reduce(out, p)
        return out


def local_experts(x: torch.Tensor, top_w: torch.Tensor, top_i: torch.Tensor, w_gate_up: torch.Tensor,
                  w_down: torch.Tensor, first_expert: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The routed experts ``first_expert`` onwards (``w_gate_up.shape[0]`` of them) of
    each row, weighted by its routing, added to ``out`` (zeros when None): one rank's
    share of the routed sum, whose shares over the ranks add up to every expert's."""
    n = w_gate_up.shape[0]
    mine = (top_i >= first_expert) & (top_i < first_expert + n)
    # Other ranks' experts get weight 0 at a clamped slot: scatter_add keeps them out.
    combine = torch.zeros((x.shape[0], n), dtype=top_w.dtype, device=x.device).scatter_add(
        1, (top_i - first_expert).clamp(0, n - 1), torch.where(mine, top_w, torch.zeros_like(top_w))).to(x.dtype)
    out = torch.zeros_like(x) if out is None else out
    for e in range(n):
        out = out + combine[:, e:e + 1] * MoE._swiglu(x, w_gate_up[e], w_down[e])
    return out


def _moe_grouped(x: torch.Tensor, top_w: torch.Tensor, top_i: torch.Tensor, w_gate_up: torch.Tensor,
                 w_down: torch.Tensor, expert_ids: torch.Tensor, kernels: bool) -> torch.Tensor:
    """Routed experts as grouped GEMMs over (token, expert) pairs sorted by expert.

    An opaque op: it permutes rows internally but is row-local as a whole (each output
    row depends on its own input row), which the replay-region check cannot see through
    a sort. Device-only work, no host sync, so it can be captured. In steps whose main
    layers run without graphs every launch here is on the host's critical path:
    ``kernels`` sorts, applies the SwiGLU and combines with the Triton kernels of
    moe_triton.py (four launches for about twelve), whose results are the PyTorch ops'
    to the bit.
    """
    t, k = top_i.shape
    kernels = kernels and moe_triton.fits(t, k)
    if kernels:
        src_rows, slot_of, offs = moe_triton.route(top_i, expert_ids.shape[0])
    else:
        experts, order = torch.sort(top_i.reshape(-1), stable=True)
        src_rows = order // k
        # The group ends from one search in the sorted experts (``expert_ids`` is 0..E-1)
        # rather than a histogram and its prefix sum: fewer launches.
        offs = torch.searchsorted(experts, expert_ids, right=True, out_int32=True)  # pairs with expert <= e
    xs = x.index_select(0, src_rows)  # lighter on the host than advanced indexing
    gu = torch._grouped_mm(xs, w_gate_up.transpose(1, 2), offs=offs)
    if kernels:
        y = torch._grouped_mm(moe_triton.silu_mul(gu), w_down.transpose(1, 2), offs=offs)
        return moe_triton.combine(y, top_w, slot_of, x.dtype)
    g, u = gu.chunk(2, dim=-1)
    y = torch._grouped_mm((torch.nn.functional.silu(g) * u).to(x.dtype), w_down.transpose(1, 2), offs=offs)
    # Unsort (row p of y is pair order[p]; a permutation, so the copy is deterministic)
    # and weight per row: a fixed-order sum, so replays are bit-identical.
    y = torch.empty_like(y).index_copy_(0, order, y).view(t, k, -1)
    return (y.float() * top_w[..., None]).sum(1).to(x.dtype)


def _moe_grouped_fake(x, top_w, top_i, w_gate_up, w_down, expert_ids, kernels):
    return torch.empty_like(x)


moe_grouped = define_op("dsv41::moe_grouped",
                        "(Tensor x, Tensor top_w, Tensor top_i, Tensor w_gate_up, Tensor w_down, "
                        "Tensor expert_ids, bool kernels) -> Tensor",
                        _moe_grouped, _moe_grouped_fake)
declare_row_local(moe_grouped)  # it sorts rows by expert, but each output row is its input row's
