"""A toy model for the FULL graph tests, written only against replay_backend's public
API: two single-head causal attention layers, with a KV cache, and no replay region.

Its attention comes in several ops, one per way an op can declare what FULL graphs
it supports (``CudagraphSupport``), and one written wrongly for a FULL graph. The
model takes the op's name (``attention=``):

* ``always``, ``uniform``, ``never``: read only device data (the view's slot mapping,
  at the graph layout's fixed address in a step run within one, ``view.graph``, and
  the ``positions`` input), declared ALWAYS, UNIFORM_DECODE and NEVER;
* ``undeclared``: the same, declared an attention op without a support;
* ``host_read``: right outside a FULL graph, and declared ALWAYS, yet it attends one
  request at a time from the view's host fields (``query_start_loc``, ``seq_lens``,
  ``cache_base``), which inside a FULL graph are the captured step's.

A model served here fits tests/own_server.py's ``OwnServer`` (``toy_cache``).
"""
from __future__ import annotations

import torch
from torch import nn

from replay_backend import CacheLayout, CudagraphSupport, declare_attention, get_forward_context

OPS = ("always", "uniform", "never", "undeclared", "host_read")


def _attend_device(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                   out: torch.Tensor, layer: int) -> None:
    """Write each row's key and value at its slot, then let row r (at position p) read
    the keys of positions ``[0, p]`` of its request's block, whose first slot is
    ``slot - p``. Only device tensors: every row of the view's slot mapping at once."""
    ctx = get_forward_context()
    view, cache = ctx.active, ctx.kv
    slots = view.graph.slot_mapping if view.graph is not None else view.slot_mapping
    n = slots.shape[0]
    kc, vc = cache.k[layer], cache.v[layer]
    kc.index_copy_(0, slots, k[:n])
    vc.index_copy_(0, slots, v[:n])
    pos = positions[:n]
    span = torch.arange(cache.max_model_len, device=q.device)
    idx = ((slots - pos)[:, None] + span).clamp(max=kc.shape[0] - 1)  # padding rows: the pad slot
    s = torch.einsum("rd,rkd->rk", q[:n], kc[idx]) * q.shape[-1] ** -0.5
    s = s.masked_fill(span[None, :] > pos[:, None], float("-inf"))
    out[:n] = torch.einsum("rk,rkd->rd", torch.softmax(s, dim=-1), vc[idx])
    out[n:] = 0


def _attend_host(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                 out: torch.Tensor, layer: int) -> None:
    """The same attention, one request at a time, from the view's host fields."""
    ctx = get_forward_context()
    view, cache = ctx.active, ctx.kv
    n = view.num_tokens
    kc, vc = cache.k[layer], cache.v[layer]
    kc.index_copy_(0, view.slot_mapping, k[:n])
    vc.index_copy_(0, view.slot_mapping, v[:n])
    qsl = view.query_start_loc
    out.zero_()
    for i, seq_len in enumerate(view.seq_lens):
        r0, r1 = qsl[i], qsl[i + 1]
        base = view.cache_base[i]
        qp = torch.arange(seq_len - (r1 - r0), seq_len, device=q.device)
        kp = torch.arange(seq_len, device=q.device)
        s = q[r0:r1] @ kc[base:base + seq_len].T * q.shape[-1] ** -0.5
        s = s.masked_fill(kp[None, :] > qp[:, None], float("-inf"))
        out[r0:r1] = torch.softmax(s, dim=-1) @ vc[base:base + seq_len]


def _register(name: str, impl) -> None:
    @torch.library.custom_op(f"full_toy::{name}", mutates_args=("out",))
    def op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, out: torch.Tensor,
           layer: int) -> None:
        impl(q, k, v, positions, out, layer)

    @op.register_fake
    def _(q, k, v, positions, out, layer):
        return None


for _name in OPS:
    _register(_name, _attend_host if _name == "host_read" else _attend_device)

declare_attention(torch.ops.full_toy.always, cudagraph_support=CudagraphSupport.ALWAYS)
declare_attention(torch.ops.full_toy.host_read, cudagraph_support=CudagraphSupport.ALWAYS)
declare_attention(torch.ops.full_toy.uniform, cudagraph_support=CudagraphSupport.UNIFORM_DECODE)
declare_attention(torch.ops.full_toy.never, cudagraph_support=CudagraphSupport.NEVER)
declare_attention(torch.ops.full_toy.undeclared)


class ToyCache:
    """One key and one value tensor per layer, and the pad slot."""

    def __init__(self, model: "ToyModel", layout: CacheLayout, device, dtype) -> None:
        shape = (layout.num_slots + 1, model.hidden)
        self.max_model_len = layout.max_model_len
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in model.layers]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in model.layers]


def toy_cache(model, layout, device, dtype):
    return ToyCache(model, layout, device, dtype)


class ToyLayer(nn.Module):
    def __init__(self, hidden: int, layer: int, attention: str) -> None:
        super().__init__()
        self.layer, self.attention = layer, attention
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        out = torch.empty_like(q)  # the out-argument protocol
        getattr(torch.ops.full_toy, self.attention)(q.contiguous(), k.contiguous(), v.contiguous(), positions,
                                                    out, self.layer)
        return x + self.o(out)


class ToyModel(nn.Module):
    """``attention``: the op every layer calls (one of ``OPS``)."""

    def __init__(self, attention: str = "always", vocab: int = 64, hidden: int = 16, layers: int = 2,
                 window: int = 8, seed: int = 0) -> None:
        super().__init__()
        if attention not in OPS:
            raise ValueError(f"attention must be one of {OPS}, got {attention!r}")
        torch.manual_seed(seed)
        self.hidden, self.window = hidden, window
        self.replay_from = layers  # no replay region: every layer's rows are kept
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(ToyLayer(hidden, i, attention) for i in range(layers))
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor]:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, positions)
        return (x,)
