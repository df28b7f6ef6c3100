"""A small Llama-style decoder written only against replay_backend's public API: the
model of docs/bring-your-own-model.md, and the second model of the test suite.

Layers 0 .. ``full_layers - 1`` attend causally over every earlier position: later
steps read all of their KV, so they must see every row and are declared KV sources.
The other layers attend over a sliding window of ``window`` positions and form the
replay region: a prefill's later steps read only its last ``window`` rows of their KV,
and these layers apply the replay floor in every step (the view they read says so).
The model owns its KV cache (one key and one value tensor per layer, addressed by the
step's slots) and its step loop (:class:`LlamaServer`).
"""
from __future__ import annotations

import torch
from torch import nn

from replay_backend import CacheLayout, declare_attention, get_forward_context, replay_begin, replay_end

from own_server import OwnServer


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer: int,
               window: int) -> None:
    """Write this step's keys and values into the layer's cache, then attend, one request
    at a time, from the cache: row at position p reads positions ``[lo, p]`` with
    ``lo = max(p - window + 1, floor)`` (``window`` 0: every earlier position), where the
    floor is the request's ``kv_start`` in the replay layers (``view.replay``), else 0."""
    ctx = get_forward_context()
    view, cache = ctx.active, ctx.kv
    floored = view.replay
    n = view.num_tokens
    kc, vc = cache.k[layer], cache.v[layer]
    kc.index_copy_(0, view.slot_mapping, k[:n].to(kc.dtype))
    vc.index_copy_(0, view.slot_mapping, v[:n].to(vc.dtype))
    qsl, scale = view.query_start_loc, q.shape[-1] ** -0.5
    for i, seq_len in enumerate(view.seq_lens):
        r0, r1 = qsl[i], qsl[i + 1]
        if r1 == r0:
            continue
        base, floor, p0 = view.cache_base[i], view.kv_start[i] if floored else 0, seq_len - (r1 - r0)
        # No row reads below its floor: keys start there (whatever a trimmed row left below).
        k0 = max(floor, p0 - window + 1 if window else 0, 0)
        qp = torch.arange(p0, seq_len, device=q.device)
        kp = torch.arange(k0, seq_len, device=q.device)
        lo = torch.clamp(qp - window + 1, min=floor) if window else torch.full_like(qp, floor)
        mask = (kp[None] <= qp[:, None]) & (kp[None] >= lo[:, None])
        s = torch.einsum("qhd,khd->hqk", q[r0:r1].float(), kc[base + k0:base + seq_len].float()) * scale
        # A row below its floor reads no key: its output (never used) is zero, not NaN.
        p = torch.softmax(s.masked_fill(~mask[None], float("-inf")), dim=-1).nan_to_num(0.0)
        out[r0:r1] = torch.einsum("hqk,khd->qhd", p, vc[base + k0:base + seq_len].float()).to(out.dtype)
    out[n:] = 0  # padded rows: never read


@torch.library.custom_op("llama_swa::full_attention", mutates_args=("out",))
def full_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer: int) -> None:
    _attention(q, k, v, out, layer, 0)


@torch.library.custom_op("llama_swa::window_attention", mutates_args=("out",))
def window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer: int,
                     window: int) -> None:
    _attention(q, k, v, out, layer, window)


@full_attention.register_fake
def _(q, k, v, out, layer):
    return None


@window_attention.register_fake
def _(q, k, v, out, layer, window):
    return None


# Both are breaks between graph pieces; the full layers' KV is read by every later
# step, so they are KV sources and must come before the replay region.
declare_attention(window_attention)
declare_attention(full_attention, kv_source=True)


class LlamaCache:
    def __init__(self, model: "LlamaSWA", layout: CacheLayout, device, dtype) -> None:
        shape = (layout.num_slots + 1, model.heads, model.head_dim)  # the last slot: padded rows
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in model.layers]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in model.layers]


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, layer: int, window: int | None) -> None:
        super().__init__()
        self.heads, self.layer, self.window = heads, layer, window
        self.attn_norm, self.mlp_norm = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.up = nn.Linear(hidden, 4 * hidden, bias=False)
        self.down = nn.Linear(2 * hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.attn_norm(x)).view(x.shape[0], 3, self.heads, -1).unbind(1)
        out = torch.empty_like(q)  # allocated here: the out-argument protocol
        if self.window is None:
            torch.ops.llama_swa.full_attention(q, k, v, out, self.layer)
        else:
            torch.ops.llama_swa.window_attention(q, k, v, out, self.layer, self.window)
        x = x + self.o(out.flatten(1))
        gate, up = self.up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(nn.functional.silu(gate) * up)


class LlamaSWA(nn.Module):
    def __init__(self, vocab: int = 128, hidden: int = 32, heads: int = 4, layers: int = 6,
                 full_layers: int = 2, window: int = 8, max_len: int = 512, seed: int = 0,
                 replay_from: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.heads, self.head_dim, self.window, self.full_layers = heads, hidden // heads, window, full_layers
        # The first layer of the replay region: after the full layers, unless a test
        # misplaces it to see the backend refuse a KV source inside the region.
        self.replay_from = full_layers if replay_from is None else replay_from
        self.embed, self.pos = nn.Embedding(vocab, hidden), nn.Embedding(max_len, hidden)
        self.layers = nn.ModuleList(Block(hidden, heads, i, None if i < full_layers else window)
                                    for i in range(layers))
        self.norm, self.head = nn.RMSNorm(hidden), nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor]:
        x = self.embed(input_ids) + self.pos(positions)
        for layer in self.layers[:self.replay_from]:
            x = layer(x)
        (x,) = replay_begin(x, window=self.window)
        for layer in self.layers[self.replay_from:]:
            x = layer(x)
        (x,) = replay_end(x)
        return (self.norm(x),)


class LlamaServer(OwnServer):
    """The model's own step loop (tests/own_server.py) over its own cache. ``compiled``:
    the model compiled with ``replay_backend.compile``, which builds the served batches
    (in its fixed metadata buffer) and runs the steps; None runs the eager model."""

    def __init__(self, model: LlamaSWA, compiled=None, max_model_len: int = 256, max_num_seqs: int = 8) -> None:
        super().__init__(model, LlamaCache, compiled, max_model_len, max_num_seqs)

    tokens = OwnServer.default_tokens
