"""A second own model, unlike tests/llama_swa.py where the backend could care: written only
against replay_backend's public API.

* Rotary position embeddings on q and k, from the ``positions`` input (no learned
  position embedding): the replay region takes ``positions`` through ``replay_begin``
  beside the hidden state and computes its angles from the kept rows' positions.
* Grouped-query attention: ``heads`` query heads share ``kv_heads`` key/value heads
  (4 and 2 by default); the cache holds the KV heads only.
* Window layers on both sides of the cut: layer 0 is a window layer before the replay
  region (it never applies a floor), layer 1 the full-attention KV source, layers
  2 .. 5 the window layers of the region. One custom op serves every window layer and
  reads the floor from the view it is given (``view.replay``), so the same op applies
  no floor in layer 0 and the request's ``kv_start`` in the region.
* The out-argument protocol: each block allocates ``out`` and the op writes into it.
* An RMSNorm'd SwiGLU MLP with separate gate and up projections.
* In the replay layers the value heads reach attention through ``.contiguous()`` of a
  strided view of the fused projection (layer 0 and 1 pass the strided view itself).
"""
from __future__ import annotations

import torch
from torch import nn

from replay_backend import (CacheLayout, declare_attention, get_forward_context, replay_begin, replay_end)


def _gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer: int,
                   window: int) -> None:
    """Write this step's KV heads at the rows' slots, then attend from the cache. A row at
    position p of request i reads the keys at ``[max(p - window + 1, floor_i), p]``
    (``window`` 0: ``[floor_i, p]``), ``floor_i = kv_start[i]`` when the view is read by
    the replay layers (``view.replay``), else 0. Query head h reads KV head
    ``h // (heads // kv_heads)``."""
    ctx = get_forward_context()
    view, cache = ctx.active, ctx.kv
    n = view.num_tokens
    kc, vc = cache.k[layer], cache.v[layer]
    # index_put through the slot mapping (llama_swa uses index_copy_): k and v may be
    # strided views; the cache holds kv_heads heads per slot.
    kc[view.slot_mapping] = k[:n].to(kc.dtype)
    vc[view.slot_mapping] = v[:n].to(vc.dtype)
    group = q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5
    qsl = view.query_start_loc
    for i, seq_len in enumerate(view.seq_lens):
        r0, r1 = qsl[i], qsl[i + 1]
        if r1 == r0:
            continue
        floor = view.kv_start[i] if view.replay else 0
        p0 = seq_len - (r1 - r0)
        # Keys from the lowest one any row may read: never below the floor (a trimmed
        # step left the entries there unwritten), never below the first row's window.
        k0 = max(floor, p0 - window + 1 if window else 0, 0)
        base = view.cache_base[i]
        keys = kc[base + k0:base + seq_len].float().repeat_interleave(group, dim=1)  # [K, H, D]
        vals = vc[base + k0:base + seq_len].float().repeat_interleave(group, dim=1)
        qp = torch.arange(p0, seq_len, device=q.device)[:, None]
        kp = torch.arange(k0, seq_len, device=q.device)[None, :]
        lo = torch.clamp(qp - window + 1, min=floor) if window else torch.full_like(qp, floor)
        allowed = (kp <= qp) & (kp >= lo)  # [Q, K]
        s = torch.einsum("qhd,khd->qhk", q[r0:r1].float(), keys) * scale
        s = s.masked_fill(~allowed[:, None, :], float("-inf"))
        # A row below its floor reads no key: zero weights (never used), not NaN.
        w = torch.where(allowed.any(-1)[:, None, None], torch.softmax(s, dim=-1), torch.zeros_like(s))
        out[r0:r1] = torch.einsum("qhk,khd->qhd", w, vals).to(out.dtype)
    out[n:] = 0  # padded rows: never read


@torch.library.custom_op("gqa_rope::window_attention", mutates_args=("out",))
def window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer: int,
                     window: int) -> None:
    _gqa_attention(q, k, v, out, layer, window)


@torch.library.custom_op("gqa_rope::full_attention", mutates_args=("out",))
def full_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer: int) -> None:
    _gqa_attention(q, k, v, out, layer, 0)


@window_attention.register_fake
def _(q, k, v, out, layer, window):
    return None


@full_attention.register_fake
def _(q, k, v, out, layer):
    return None


declare_attention(window_attention)  # both sides of the cut
declare_attention(full_attention, kv_source=True)  # every later step reads all of its KV


class GQACache:
    """One key and one value tensor per layer, ``kv_heads`` heads per slot, and the pad slot."""

    def __init__(self, model: "GQARope", layout: CacheLayout, device, dtype) -> None:
        shape = (layout.num_slots + 1, model.kv_heads, model.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in model.layers]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in model.layers]


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``x`` [T, heads, D] by angles ``cos``/``sin`` [T, 1, D]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class GQABlock(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, mlp: int, layer: int,
                 window: int | None, contiguous_v: bool) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.layer, self.window, self.contiguous_v = layer, window, contiguous_v
        self.attn_norm, self.mlp_norm = nn.RMSNorm(hidden, eps=1e-6), nn.RMSNorm(hidden, eps=1e-6)
        self.qkv = nn.Linear(hidden, (heads + 2 * kv_heads) * head_dim, bias=False)
        self.o = nn.Linear(heads * head_dim, hidden, bias=False)
        self.gate = nn.Linear(hidden, mlp, bias=False)
        self.up = nn.Linear(hidden, mlp, bias=False)
        self.down = nn.Linear(mlp, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        t, hd = x.shape[0], self.head_dim
        qkv = self.qkv(self.attn_norm(x))
        q = qkv[:, :self.heads * hd].view(t, self.heads, hd)
        k = qkv[:, self.heads * hd:(self.heads + self.kv_heads) * hd].view(t, self.kv_heads, hd)
        v = qkv[:, (self.heads + self.kv_heads) * hd:].view(t, self.kv_heads, hd)  # strided rows
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        if self.contiguous_v:
            v = v.contiguous()
        out = torch.empty_like(q)  # the out-argument protocol: allocated by the caller
        if self.window is None:
            torch.ops.gqa_rope.full_attention(q, k, v, out, self.layer)
        else:
            torch.ops.gqa_rope.window_attention(q, k, v, out, self.layer, self.window)
        x = x + self.o(out.flatten(1))
        h = self.mlp_norm(x)
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))


class GQARope(nn.Module):
    """``kinds``: one letter per layer, ``w`` a window layer, ``f`` full attention (a KV
    source). The replay region starts after the last ``f``."""

    def __init__(self, vocab: int = 96, hidden: int = 32, heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
                 mlp: int = 48, kinds: str = "wfwwww", window: int = 12, rope_theta: float = 1000.0,
                 seed: int = 0) -> None:
        super().__init__()
        if heads % kv_heads or head_dim % 2 or set(kinds) - {"w", "f"}:
            raise ValueError("heads must be a multiple of kv_heads, head_dim even, kinds of 'w' and 'f'")
        torch.manual_seed(seed)
        self.heads, self.kv_heads, self.head_dim, self.window = heads, kv_heads, head_dim, window
        self.replay_from = kinds.rfind("f") + 1
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(
            GQABlock(hidden, heads, kv_heads, head_dim, mlp, i, None if c == "f" else window,
                     contiguous_v=i >= self.replay_from) for i, c in enumerate(kinds))
        self.norm, self.head = nn.RMSNorm(hidden, eps=1e-6), nn.Linear(hidden, vocab, bias=False)
        self.register_buffer("inv_freq", rope_theta ** -(torch.arange(0, head_dim, 2).float() / head_dim),
                             persistent=False)

    def angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = positions.float()[:, None] * self.inv_freq[None, :]
        f = torch.cat((f, f), dim=-1)[:, None, :]  # [T, 1, D]
        return f.cos(), f.sin()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor]:
        x = self.embed(input_ids)
        cos, sin = self.angles(positions)
        for layer in self.layers[:self.replay_from]:
            x = layer(x, cos, sin)
        # The region reads nothing row-indexed from outside but what passes the marker:
        # the positions travel with the hidden state and the angles are made anew.
        x, positions = replay_begin(x, positions, window=self.window)
        cos, sin = self.angles(positions)
        for layer in self.layers[self.replay_from:]:
            x = layer(x, cos, sin)
        (x,) = replay_end(x)
        return (self.norm(x),)
