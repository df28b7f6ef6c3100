"""DSv4.1-mini: a small, faithful DeepSeek-V4.1-style "causal encoder-decoder".

``forward(input_ids, positions)`` returns the final-normed hidden state of every row;
``compute_logits`` runs the head on the rows the caller selects (each request's last
row). Everything after the last KV source is the replay region, delimited with the
markers of :mod:`replay_backend.tracing.boundary`.
"""
from __future__ import annotations

import torch
from torch import nn

from ..tracing.boundary import replay_begin, replay_end
from . import attention_ops  # noqa: F401  (registers the dsv41:: ops)
from .config import ModelConfig
from .parallel import tp_all_reduce
from .layers import HyperConnection, RMSNorm, apply_rope, branch_std, hc_collapse, hc_merge, init_param, rope_angles
from .moe import MoE


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, gen: torch.Generator) -> None:
        super().__init__()
        h, nh, hd = cfg.hidden_size, cfg.num_heads, cfg.head_dim
        self.cfg, self.layer = cfg, layer
        self.kind = cfg.layer_kind(layer)
        self.norm = RMSNorm(h, cfg.rms_eps)
        self.wq_a = init_param(gen, cfg.q_lora_rank, h, std=h ** -0.5)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_eps)
        self.wq_b = init_param(gen, nh * hd, cfg.q_lora_rank, std=cfg.q_lora_rank ** -0.5)
        self.wkv = init_param(gen, hd, h, std=h ** -0.5)
        self.kv_norm = RMSNorm(hd, cfg.rms_eps)
        self.sink = init_param(gen, nh, std=1.0)
        per_group = nh // cfg.o_groups * hd
        self.heads, self.groups = nh, cfg.o_groups  # this rank's (parallel.py)
        self.parallel = None
        self.wo_a = init_param(gen, cfg.o_groups, per_group, cfg.o_lora_rank, std=per_group ** -0.5)
        self.wo_b = init_param(gen, h, cfg.o_groups * cfg.o_lora_rank,
                           std=branch_std(cfg.num_layers) * (cfg.o_groups * cfg.o_lora_rank) ** -0.5)
        if self.kind == "source":
            self.ratio = cfg.compress_ratio(layer)
            self.wc_kv = init_param(gen, hd, h, std=h ** -0.5)
            self.wc_gate = init_param(gen, hd, h, std=h ** -0.5) if self.ratio == 2 else None
            self.comp_norm = RMSNorm(hd, cfg.rms_eps)

    def shard(self, p) -> None:
        """Keep this rank's heads and their output groups (parallel.py)."""
        self.parallel = p
        if p.tp_size == 1:
            return
        hd, r = self.cfg.head_dim, p.tp_rank
        self.heads, self.groups = self.heads // p.tp_size, self.groups // p.tp_size
        h, g, rank = self.heads, self.groups, self.wo_a.shape[2]
        self.wq_b = nn.Parameter(self.wq_b[r * h * hd:(r + 1) * h * hd].clone())
        self.sink = nn.Parameter(self.sink[r * h:(r + 1) * h].clone())
        self.wo_a = nn.Parameter(self.wo_a[r * g:(r + 1) * g].clone())
        self.wo_b = nn.Parameter(self.wo_b[:, r * g * rank:(r + 1) * g * rank].clone())

    def forward(self, u: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        t, cfg = u.shape[0], self.cfg
        x = self.norm(u)
        q = (self.q_norm(x @ self.wq_a.t()) @ self.wq_b.t()).view(t, self.heads, cfg.head_dim)
        kv = self.kv_norm(x @ self.wkv.t())
        q, kv = apply_rope(q, cos, sin), apply_rope(kv, cos, sin)
        out = torch.empty_like(q)  # allocated here so the next graph piece reads a stable address
        if self.kind == "source":
            gate = x @ self.wc_gate.t() if self.wc_gate is not None else None
            torch.ops.dsv41.source_attention(q, kv, x @ self.wc_kv.t(), gate, self.comp_norm.weight,
                                             self.sink, out, self.layer)
        elif self.kind == "global":
            torch.ops.dsv41.global_attention(q, kv, self.sink, out, self.layer)
        else:
            torch.ops.dsv41.swa_attention(q, kv, self.sink, out, self.layer)
        o = apply_rope(out, cos, sin, inverse=True).view(t, self.groups, -1)
        # Grouped low-rank projection as one batched matmul over groups. Its product is
        # copied to token rows explicitly: a reshape would choose between a view and a
        # copy from the strides, which at one token compare equal, so a trace made on
        # one token would hold at one token only.
        o = torch.bmm(o.transpose(0, 1), self.wo_a).transpose(0, 1)
        o = o.clone(memory_format=torch.contiguous_format).view(t, -1)
        o = o @ self.wo_b.t()
        return tp_all_reduce(o, self.parallel)  # row-parallel: the sum over the TP ranks


class FFN(nn.Module):
    def __init__(self, cfg: ModelConfig, gen: torch.Generator) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.moe = MoE(cfg.hidden_size, cfg.num_experts, cfg.top_k, cfg.moe_intermediate_size,
                       cfg.shared_intermediate_size, gen, cfg.moe_impl, cfg.moe_permute_impl,
                       out_std=branch_std(cfg.num_layers))

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return self.moe(self.norm(u))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, gen: torch.Generator) -> None:
        super().__init__()
        args = (cfg.hc_mult, cfg.hidden_size, cfg.rms_eps, cfg.hc_eps, cfg.sinkhorn_iters, gen,
                cfg.sinkhorn_impl)
        self.attn_hc = HyperConnection(*args)
        self.attn = Attention(cfg, layer, gen)
        self.ffn_hc = HyperConnection(*args)
        self.ffn = FFN(cfg, gen)


class DSv41Mini(nn.Module):
    """The reference model. State between sublayers, which also crosses the replay boundary:
    ``hidden`` (last sublayer output), ``residual`` (stream before merging it),
    ``pre`` / ``post`` / ``comb`` (that sublayer's fp32 mixes)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        gen = torch.Generator().manual_seed(cfg.seed)
        self.embed = init_param(gen, cfg.vocab_size, cfg.hidden_size, std=1.0)
        self.layers = nn.ModuleList(Block(cfg, i, gen) for i in range(cfg.num_layers))
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.head = init_param(gen, cfg.vocab_size, cfg.hidden_size, std=cfg.hidden_size ** -0.5)

    def _sublayer(self, hc: HyperConnection, fn, state, prev_pre):
        hidden, residual, post, comb = state
        stream = residual if hidden is None else hc_merge(hidden, residual, post, comb)
        pre, post, comb = hc(stream)
        # Delayed pre-mix: the sublayer reads the stream collapsed with the *previous*
        # sublayer's pre (the first sublayer reads the embedding itself).
        u = stream[:, 0] if prev_pre is None else hc_collapse(stream, prev_pre)
        return (fn(u), stream, post, comb), pre

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        h = self.embed[input_ids]
        cos, sin = rope_angles(positions, cfg.rope_dim, cfg.rope_theta)
        state = (None, h[:, None, :].expand(-1, cfg.hc_mult, -1).contiguous(), None, None)
        pre = None
        for i, blk in enumerate(self.layers):
            if i == cfg.cut + 1:  # decoder-replay boundary: after the last KV source
                hidden, residual, post, comb = state
                hidden, residual, pre, post, comb, positions = replay_begin(
                    hidden, residual, pre, post, comb, positions, window=cfg.window)
                cos, sin = rope_angles(positions, cfg.rope_dim, cfg.rope_theta)
                state = (hidden, residual, post, comb)
            state, pre = self._sublayer(blk.attn_hc, lambda u: blk.attn(u, cos, sin), state, pre)
            state, pre = self._sublayer(blk.ffn_hc, blk.ffn, state, pre)
        hidden, residual, post, comb = state
        out = self.final_norm(hc_collapse(hc_merge(hidden, residual, post, comb), pre))
        if cfg.cut + 1 < cfg.num_layers:
            (out,) = replay_end(out)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.float() @ self.head.float().t()
