"""Building blocks of DSv4.1-mini against straightforward references."""
from __future__ import annotations

import math

import pytest
import torch

from replay_backend.batch import RequestChunk
from replay_backend.batch import build_step_batch
from replay_backend.forward_context import ForwardContext, set_forward_context
from replay_backend.kv_cache import CacheLayout
from replay_backend.reference.kv_caches import KVCaches
from replay_backend.reference import PRESETS, build_model, preset
from replay_backend.reference import attention_ops, attention_reference
from replay_backend.reference.layers import (
    HyperConnection,
    apply_rope,
    hc_collapse,
    hc_merge,
    mm_fp32,
    rms_norm,
    rope_angles,
    sinkhorn,
)
from replay_backend.reference.moe import MoE, route

from conftest import small_config


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------------------
# mHC
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("std, iters", [(0.5, 20), (1.0, 20), (3.0, 200)])
def test_sinkhorn_doubly_stochastic(std, iters):
    # std ~1 is the scale of the model's mixes (bias std 0.5 + RMS-scaled projection);
    # sharper logits need more than the model's 20 iterations to converge
    logits = torch.randn(64, 4, 4, generator=_gen(1)) * std
    m = sinkhorn(logits, iters)
    assert m.shape == logits.shape
    assert (m >= 0).all()
    torch.testing.assert_close(m.sum(-1), torch.ones(64, 4), atol=1e-3, rtol=0)
    torch.testing.assert_close(m.sum(-2), torch.ones(64, 4), atol=1e-3, rtol=0)


def test_sinkhorn_zero_iters_is_row_softmax_and_shift_invariant():
    logits = torch.randn(8, 4, 4, generator=_gen(2))
    torch.testing.assert_close(sinkhorn(logits, 0), torch.softmax(logits, -1))
    # the doubly stochastic limit diag(a) exp(L) diag(b) does not see per-column shifts
    shift = torch.randn(8, 1, 4, generator=_gen(3))
    torch.testing.assert_close(sinkhorn(logits + shift, 300), sinkhorn(logits, 300), atol=1e-4, rtol=1e-4)
    # a per-row shift is removed exactly by the first softmax
    rshift = torch.randn(8, 4, 1, generator=_gen(4)) * 3
    torch.testing.assert_close(sinkhorn(logits + rshift, 5), sinkhorn(logits, 5), atol=1e-5, rtol=1e-5)


def test_hyper_connection_ranges_and_formula():
    hc, hidden, eps, hc_eps = 4, 32, 1e-6, 1e-6
    mod = HyperConnection(hc, hidden, eps, hc_eps, 20, _gen(5))
    stream = torch.randn(50, hc, hidden, generator=_gen(6)) * 3
    pre, post, comb = mod(stream)
    assert pre.shape == (50, hc) and post.shape == (50, hc) and comb.shape == (50, hc, hc)
    assert pre.dtype == post.dtype == comb.dtype == torch.float32
    assert (pre > hc_eps).all() and (pre < 1 + hc_eps).all()
    assert (post > 0).all() and (post < 2).all()
    torch.testing.assert_close(comb.sum(-1), torch.ones(50, hc), atol=1e-3, rtol=0)
    torch.testing.assert_close(comb.sum(-2), torch.ones(50, hc), atol=1e-3, rtol=0)

    # independent recomputation, one row at a time, in float64
    w, b = mod.weight.double(), mod.bias.double()
    for t in range(0, 50, 7):
        flat = stream[t].reshape(-1).double()
        flat = flat / torch.sqrt((flat ** 2).mean() + eps)
        mix = w @ flat + b
        exp_pre = 1 / (1 + torch.exp(-mix[:hc])) + hc_eps
        exp_post = 2 / (1 + torch.exp(-mix[hc:2 * hc]))
        c = torch.softmax(mix[2 * hc:].view(hc, hc), -1)
        for _ in range(20):
            c = c / c.sum(0, keepdim=True)
            c = c / c.sum(1, keepdim=True)
        torch.testing.assert_close(pre[t].double(), exp_pre, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(post[t].double(), exp_post, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(comb[t].double(), c, atol=1e-5, rtol=1e-5)


def test_hc_merge_matches_double_loop():
    T, hc, H = 5, 4, 8
    g = _gen(7)
    hidden, residual = torch.randn(T, H, generator=g), torch.randn(T, hc, H, generator=g)
    post, comb = torch.rand(T, hc, generator=g) * 2, torch.rand(T, hc, hc, generator=g)
    out = hc_merge(hidden, residual, post, comb)
    ref = torch.zeros(T, hc, H, dtype=torch.float64)
    for t in range(T):
        for j in range(hc):
            acc = post[t, j].double() * hidden[t].double()
            for i in range(hc):
                acc = acc + comb[t, i, j].double() * residual[t, i].double()
            ref[t, j] = acc
    assert out.dtype == residual.dtype
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_hc_merge_is_not_transposed():
    # comb[i, j] moves stream i into stream j: a permutation matrix must permute
    T, hc, H = 1, 3, 2
    residual = torch.arange(T * hc * H, dtype=torch.float32).view(T, hc, H)
    comb = torch.zeros(T, hc, hc)
    comb[0, 0, 1] = comb[0, 1, 2] = comb[0, 2, 0] = 1.0  # 0->1, 1->2, 2->0
    out = hc_merge(torch.zeros(T, H), residual, torch.zeros(T, hc), comb)
    torch.testing.assert_close(out[0], residual[0][[2, 0, 1]])


def test_hc_collapse():
    T, hc, H = 6, 4, 8
    g = _gen(8)
    stream, pre = torch.randn(T, hc, H, generator=g), torch.rand(T, hc, generator=g)
    out = hc_collapse(stream, pre)
    ref = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for i in range(hc):
            ref[t] += pre[t, i].double() * stream[t, i].double()
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------
# RoPE, RMSNorm
# --------------------------------------------------------------------------------------
def test_apply_rope_matches_explicit_rotation_and_inverse_undoes_it():
    T, nh, D, r, theta = 7, 3, 16, 8, 10000.0
    x = torch.randn(T, nh, D, generator=_gen(9))
    pos = torch.tensor([0, 1, 2, 5, 17, 100, 511])
    cos, sin = rope_angles(pos, r, theta)
    y = apply_rope(x, cos, sin)
    assert torch.equal(y[..., : D - r], x[..., : D - r])  # non-rope dims untouched
    # explicit rotation of each (x1[j], x2[j]) pair by pos * theta^(-2j/r)
    half = r // 2
    for t in range(T):
        for j in range(half):
            a = pos[t].item() * theta ** (-2 * j / r)
            x1, x2 = x[t, :, D - r + j].double(), x[t, :, D - r + half + j].double()
            torch.testing.assert_close(y[t, :, D - r + j].double(), x1 * math.cos(a) - x2 * math.sin(a),
                                       atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(y[t, :, D - r + half + j].double(), x1 * math.sin(a) + x2 * math.cos(a),
                                       atol=1e-4, rtol=1e-4)
    assert torch.allclose(y[0], x[0])  # position 0 is the identity
    back = apply_rope(y, cos, sin, inverse=True)
    assert torch.equal(back[..., : D - r], x[..., : D - r])
    torch.testing.assert_close(back, x, atol=1e-5, rtol=1e-5)
    # also for a rank-2 input (the shared KV latent)
    kv = torch.randn(T, D, generator=_gen(10))
    torch.testing.assert_close(apply_rope(apply_rope(kv, cos, sin), cos, sin, inverse=True), kv,
                               atol=1e-5, rtol=1e-5)


def test_rope_scores_depend_on_relative_position_only():
    D, r = 16, 16
    g = _gen(11)
    q, k = torch.randn(1, D, generator=g), torch.randn(1, D, generator=g)

    def score(pq, pk):
        cq, sq = rope_angles(torch.tensor([pq]), r, 10000.0)
        ck, sk = rope_angles(torch.tensor([pk]), r, 10000.0)
        return (apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum().item()

    assert score(10, 3) == pytest.approx(score(57, 50), abs=1e-4)
    assert score(10, 3) != pytest.approx(score(10, 4), abs=1e-4)


def test_rms_norm_formula():
    g = _gen(12)
    x, w = torch.randn(9, 32, generator=g) * 5, torch.randn(32, generator=g)
    ref = x.double() / torch.sqrt((x.double() ** 2).mean(-1, keepdim=True) + 1e-6) * w.double()
    torch.testing.assert_close(rms_norm(x, w, 1e-6).double(), ref, atol=1e-5, rtol=1e-5)
    xb = x.to(torch.bfloat16)
    assert rms_norm(xb, w, 1e-6).dtype == torch.bfloat16


# --------------------------------------------------------------------------------------
# MoE
# --------------------------------------------------------------------------------------
def _naive_moe(moe, x):
    out = torch.zeros(x.shape, dtype=torch.float64)
    silu = torch.nn.functional.silu

    def swiglu(v, gate_up, down):
        h = gate_up.double() @ v
        n = h.shape[0] // 2
        return down.double() @ (silu(h[:n]) * h[n:])

    for t in range(x.shape[0]):
        v = x[t].double()
        scores = torch.softmax(moe.router.double() @ v, -1)
        ranked = sorted(range(scores.numel()), key=lambda e: -scores[e].item())
        order, first_out = ranked[: moe.top_k], scores[ranked[moe.top_k]]
        # each chosen expert weighs by its lead over the best expert left out
        total = sum(scores[e] - first_out for e in order)
        acc = swiglu(v, moe.s_gate_up, moe.s_down)
        for e in order:
            acc = acc + (scores[e] - first_out) / total * swiglu(v, moe.w_gate_up[e], moe.w_down[e])
        out[t] = acc
    return out


def test_moe_matches_naive_per_token_loop(model):
    for layer in (0, 5):
        moe = model.layers[layer].ffn.moe
        x = torch.randn(24, model.cfg.hidden_size, generator=_gen(13 + layer))
        with torch.no_grad():
            got = moe(x)
        torch.testing.assert_close(got.double(), _naive_moe(moe, x), atol=1e-4, rtol=1e-4)


def _routing_boundary(moe: MoE, seed: int) -> torch.Tensor:
    """Two fp32 rows a rounding step apart that the router sends to different experts."""
    gen = _gen(seed)
    width = moe.router.shape[1]

    def chosen(x):
        return frozenset(torch.softmax(mm_fp32(x[None], moe.router), -1).topk(moe.top_k)[1][0].tolist())

    a, b = torch.randn(width, generator=gen), torch.randn(width, generator=gen)
    while chosen(a) == chosen(b):
        b = torch.randn(width, generator=gen)
    lo, hi = 0.0, 1.0
    for _ in range(60):  # bisect the segment a..b down to the switch
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chosen(a + mid * (b - a)) == chosen(a) else (lo, mid)
    x = torch.stack([a + lo * (b - a), a + hi * (b - a)])
    assert chosen(x[0]) != chosen(x[1])
    return x[:, None]  # one row per call: a GEMM's rounding depends on its rows


def test_moe_is_continuous_where_the_routing_changes():
    """Rows on the boundary where the k-th and the next expert trade places: a rounding
    step apart, their outputs must be about that close, not an expert's share apart
    (the eager oracle and a compiled step round differently)."""
    moe = MoE(32, 4, 2, 16, 16, _gen(23), impl="dense")
    for seed in (24, 25, 26):
        x = _routing_boundary(moe, seed)
        with torch.no_grad():
            out = torch.cat([moe(x[0]), moe(x[1])])
        assert (out[0] - out[1]).abs().max() < 1e-4 * out.abs().max()


def test_routing_weights_are_each_experts_lead_over_the_first_left_out():
    scores = torch.tensor([[0.1, 0.5, 0.15, 0.25], [0.25, 0.25, 0.25, 0.25]])
    w, i = route(scores, 2)
    assert i[0].tolist() == [1, 3]
    torch.testing.assert_close(w[0], torch.tensor([0.35, 0.10]) / 0.45)
    assert w[1].tolist() == [0.0, 0.0]  # a four-way tie: no expert leads
    w, i = route(scores, 4)
    torch.testing.assert_close(w.sum(-1), torch.ones(2))
    w, i = route(scores[:1], 1)  # top-1: the lead relative to its own score
    assert i.tolist() == [[1]]
    torch.testing.assert_close(w, torch.tensor([[0.25 / 0.5]]))


def test_top_1_moe_is_continuous_where_the_routing_changes():
    moe = MoE(32, 4, 1, 16, 16, _gen(27), impl="dense")
    x = _routing_boundary(moe, 28)
    with torch.no_grad():
        out = torch.cat([moe(x[0]), moe(x[1])])
    assert (out[0] - out[1]).abs().max() < 1e-4 * out.abs().max()


def test_grouped_moe_op_matches_the_naive_loop():
    """``dsv41::moe_grouped`` (sort by expert, grouped GEMMs, unsort) on CPU bf16, where
    this torch's ``_grouped_mm`` runs; the model uses it on CUDA only."""
    moe = MoE(64, 4, 2, 32, 32, _gen(21), impl="dense").to(torch.bfloat16)
    x = torch.randn(50, 64, generator=_gen(22)).to(torch.bfloat16)
    top_w, top_i = route(torch.softmax(x.float() @ moe.router.float().t(), dim=-1), 2)
    try:
        routed = torch.ops.dsv41.moe_grouped(x, top_w, top_i, moe.w_gate_up, moe.w_down, moe.expert_ids, False)
    except (RuntimeError, NotImplementedError) as e:  # a torch without CPU grouped GEMMs
        pytest.skip(f"torch._grouped_mm on CPU: {e}")
    got = routed.double() + MoE._swiglu(x, moe.s_gate_up, moe.s_down).double()
    want = _naive_moe(moe, x)
    assert (got - want).abs().max() < 0.02 * want.abs().max()


# --------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------
def naive_attention(q, swa, glob, ratio, seq_len, floor, window, sink, scale):
    """One request; row i is position seq_len - n + i. Explicit loops over keys."""
    n, nh, D = q.shape
    out = torch.zeros(n, nh, D, dtype=torch.float64)
    for i in range(n):
        p = seq_len - n + i
        keys = []
        if glob is not None:
            for m in range(glob.shape[0]):
                # a ratio-r global entry m is complete once position r*m + r - 1 exists
                if ratio * m + ratio - 1 <= p:
                    keys.append(glob[m])
        for kp in range(max(p - window + 1, floor, 0), p + 1):
            keys.append(swa[kp])
        for h in range(nh):
            sink_h = sink[h].double()
            if keys:
                K = torch.stack(keys).double()
                s = (K @ q[i, h].double()) * scale
                mx = torch.maximum(s.max(), sink_h)
                e = torch.exp(s - mx)
                out[i, h] = (e[:, None] * K).sum(0) / (e.sum() + torch.exp(sink_h - mx))
    return out


def _rand_attn_inputs(n, seq_len, ratio, with_glob, seed, nh=3, D=8):
    g = _gen(seed)
    q = torch.randn(n, nh, D, generator=g)
    swa = torch.randn(seq_len, D, generator=g)
    glob = torch.randn(seq_len // ratio, D, generator=g) if with_glob else None
    sink = torch.randn(nh, generator=g)
    return q, swa, glob, sink


ATTN_CASES = [
    # n, seq_len, ratio, with_glob, floor, window
    (40, 40, 1, True, 0, 16),  # first prefill, longer than W
    (30, 41, 2, True, 0, 16),  # chunk after 11 cached tokens, odd seq_len
    (40, 60, 1, True, 44, 16),  # trimmed-prefill floor seq_len - W: rows below it read no SWA
    (40, 60, 2, True, 50, 16),  # prefix-cache later floor
    (5, 30, 1, False, 0, 16),  # SWA-only layer
    (1, 33, 2, True, 0, 16),  # decode
    (12, 12, 2, True, 0, 32),  # window larger than the sequence
]


@pytest.mark.parametrize("n, seq_len, ratio, with_glob, floor, window", ATTN_CASES)
def test_attend_request_matches_naive(n, seq_len, ratio, with_glob, floor, window):
    q, swa, glob, sink = _rand_attn_inputs(n, seq_len, ratio, with_glob, seed=n + seq_len)
    scale = q.shape[-1] ** -0.5
    got = attention_reference.attend_request(q, swa, glob, ratio, seq_len, floor, window, sink, scale)
    ref = naive_attention(q, swa, glob, ratio, seq_len, floor, window, sink, scale)
    assert got.shape == q.shape
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)


def test_floor_changes_rows_it_binds():
    q, swa, glob, sink = _rand_attn_inputs(40, 60, 1, True, seed=21)
    s = 8 ** -0.5
    a = attention_reference.attend_request(q, swa, glob, 1, 60, 0, 16, sink, s)
    b = attention_reference.attend_request(q, swa, glob, 1, 60, 44, 16, sink, s)
    # the last row reads [44, 59] either way; the row at position 50 loses keys 35..43
    torch.testing.assert_close(a[-1], b[-1])
    assert (a[50 - 20] - b[50 - 20]).abs().max() > 1e-3


# Row blocks wholly below the replay floor read no SWA keys (regression: they once crashed).


@pytest.mark.parametrize("n, seq_len, ratio, floor", [
    (70, 70, 1, 0),
    (37, 90, 2, 0),
    (20, 40, 2, 24),  # floor inside the first block
    (40, 40, 1, 16),  # floor right after the first block
    (50, 70, 2, 54),
    (40, 40, 1, 24),
])
def test_attend_request_row_blocks(monkeypatch, n, seq_len, ratio, floor):
    q, swa, glob, sink = _rand_attn_inputs(n, seq_len, ratio, True, seed=31 + n)
    s = q.shape[-1] ** -0.5
    whole = attention_reference.attend_request(q, swa, glob, ratio, seq_len, floor, 16, sink, s)
    monkeypatch.setattr(attention_reference, "_SCORE_BUDGET", 1)  # -> blocks of 16 rows
    calls = []
    real_einsum = torch.einsum

    def counting_einsum(eq, *args):
        if eq == "qhd,kd->hqk":
            calls.append(args[0].shape[0])
        return real_einsum(eq, *args)

    monkeypatch.setattr(attention_reference.torch, "einsum", counting_einsum)
    split = attention_reference.attend_request(q, swa, glob, ratio, seq_len, floor, 16, sink, s)
    monkeypatch.undo()
    assert len(calls) == math.ceil(n / 16) and sum(calls) == n
    ref = naive_attention(q, swa, glob, ratio, seq_len, floor, 16, sink, s)
    torch.testing.assert_close(split.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(split, whole, atol=1e-6, rtol=1e-6)


def test_attend_request_long_prefill_default_budget():
    """Realistic sizes with the default score budget: a 4K-token first prefill of the
    tiny preset (4 heads, W=128, ratio-1 global) is split into blocks of ~1008 rows,
    all of the first ones below the floor 3968."""
    n, W, nh = 4096, 128, 4
    g = _gen(71)
    q = torch.randn(n, nh, 8, generator=g)
    swa, glob = torch.randn(n, 8, generator=g), torch.randn(n, 8, generator=g)
    out = attention_reference.attend_request(q, swa, glob, 1, n, n - W, W, torch.zeros(nh), 8 ** -0.5)
    assert out.shape == q.shape and torch.isfinite(out).all()
    # spot-check the last rows against the naive reference
    ref = naive_attention(q[-3:], swa, glob, 1, n, n - W, W, torch.zeros(nh), 8 ** -0.5)
    torch.testing.assert_close(out[-3:].double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("prompt", [
    30,  # one 16-row block straddles the floor 14
    80,
])
def test_model_step_with_row_blocks(monkeypatch, make_runner, prompt):
    """A whole model step gives the same logits with the attention split in row blocks."""
    whole = make_runner().step([RequestChunk("a", prompt, prompt), RequestChunk("b", 5, 5)]).logits
    monkeypatch.setattr(attention_reference, "_SCORE_BUDGET", 1)
    split = make_runner().step([RequestChunk("a", prompt, prompt), RequestChunk("b", 5, 5)]).logits
    torch.testing.assert_close(split, whole, atol=1e-5, rtol=1e-5)


def _ctx(cfg, reqs, blocks, layout):
    toks = [[1] * r.query_len for r in reqs]
    batch = build_step_batch(reqs, toks, blocks, layout, cfg.window, "cpu", view_fields=attention_ops.COMP_FIELD)
    return batch


def test_attention_op_reads_caches_and_floors_only_replay_layers(cfg):
    """The custom op through the forward context: writes its SWA slots, reads the
    request's own cache block and its source's global cache, applies the floor where
    the view it reads is the replay layers' (one op serves both sides of the cut),
    zeroes padded rows."""
    W = cfg.window
    layout = CacheLayout(128, 3)
    caches = KVCaches(cfg, layout, "cpu", torch.float32)
    g = _gen(41)
    D, nh = cfg.head_dim, 2
    # pre-existing (context) content in every cache
    for t in [*caches.swa, *caches.glob.values()]:
        t.copy_(torch.randn(t.shape, generator=g))
    reqs = [RequestChunk("a", 40, 60), RequestChunk("b", 1, 77), RequestChunk("c", 30, 100, kv_start=90)]
    blocks = [2, 0, 1]
    batch = _ctx(cfg, reqs, blocks, layout)
    T = batch.num_tokens
    assert batch.view.kv_start == (44, 0, 90)
    q = torch.randn(T + 3, nh, D, generator=g)
    kv = torch.randn(T + 3, D, generator=g)
    sink = torch.randn(nh, generator=g)
    glob_op = torch.ops.dsv41.global_attention
    for layer, op, view in ((5, glob_op, batch.region_view), (2, glob_op, batch.view), (5, glob_op, batch.view),
                            (0, torch.ops.dsv41.swa_attention, batch.view)):
        out = torch.full_like(q, 7.0)
        with set_forward_context(ForwardContext(batch, caches, active=view)):
            op(q, kv, sink, out, layer)
        swa = caches.swa[layer]
        torch.testing.assert_close(swa[batch.view.slot_mapping], kv[:T])
        assert (out[T:] == 0).all()
        src = cfg.global_source(layer)
        ratio = cfg.compress_ratio(src) if src is not None else 1
        for i, r in enumerate(reqs):
            base = layout.base(blocks[i])
            glob = None if src is None else caches.glob[src][base // ratio: base // ratio + r.seq_len // ratio]
            floor = batch.view.kv_start[i] if view.replay else 0
            r0, r1 = batch.view.query_start_loc[i], batch.view.query_start_loc[i + 1]
            ref = naive_attention(q[r0:r1], swa[base: base + r.seq_len], glob, ratio, r.seq_len, floor,
                                  W, sink, D ** -0.5)
            torch.testing.assert_close(out[r0:r1].double(), ref, atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"layer {layer} request {i}: {m}")


def test_compressors_write_global_entries_across_steps(cfg):
    """Ratio-2 source: entry m = norm(softmax-gated pool of positions 2m, 2m+1), written
    when the odd position arrives, even if its even half came in an earlier step.
    Ratio-1 source: entry p = norm(kv_c[p])."""
    layout = CacheLayout(64, 2)
    caches = KVCaches(cfg, layout, "cpu", torch.float32)
    g = _gen(51)
    D, nh = cfg.head_dim, 2
    norm_w = torch.rand(D, generator=g) + 0.5
    sink = torch.randn(nh, generator=g)
    block, base = 1, 64

    def run(reqs, kv_c, gate, layer):
        batch = _ctx(cfg, reqs, [block], layout)
        T = batch.num_tokens
        q, kv = torch.randn(T, nh, D, generator=g), torch.randn(T, D, generator=g)
        out = torch.empty_like(q)
        with set_forward_context(ForwardContext(batch, caches)):
            torch.ops.dsv41.source_attention(q, kv, kv_c, gate, norm_w, sink, out, layer)
        return q, out

    def pool(k0, k1, g0, g1):
        w = torch.softmax(torch.stack([g0, g1]).double(), 0)
        p = w[0] * k0.double() + w[1] * k1.double()
        return p / torch.sqrt((p ** 2).mean() + cfg.rms_eps) * norm_w.double()

    # ratio 2 (layer 1): 7 tokens, then a decode at position 7
    kv1, g1 = torch.randn(7, D, generator=g), torch.randn(7, D, generator=g)
    run([RequestChunk("a", 7, 7)], kv1, g1, 1)
    glob = caches.glob[1]
    for m in range(3):
        torch.testing.assert_close(glob[base // 2 + m].double(), pool(kv1[2 * m], kv1[2 * m + 1], g1[2 * m], g1[2 * m + 1]),
                                   atol=1e-5, rtol=1e-5)
    assert (glob[base // 2 + 3] == 0).all()  # position 6 alone does not complete entry 3
    assert (glob[: base // 2] == 0).all()  # other blocks untouched
    kv2, g2 = torch.randn(1, D, generator=g), torch.randn(1, D, generator=g)
    q, out = run([RequestChunk("a", 1, 8)], kv2, g2, 1)
    torch.testing.assert_close(glob[base // 2 + 3].double(), pool(kv1[6], kv2[0], g1[6], g2[0]), atol=1e-5, rtol=1e-5)
    # the decode at position 7 sees all 4 complete entries
    ref = naive_attention(q, caches.swa[1][base: base + 8], glob[base // 2: base // 2 + 4], 2, 8, 0,
                          cfg.window, sink, D ** -0.5)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)

    # ratio 1 (layer 3, the cut)
    kv3 = torch.randn(5, D, generator=g)
    run([RequestChunk("a", 5, 5)], kv3, None, 3)
    exp = kv3.double() / torch.sqrt((kv3.double() ** 2).mean(-1, keepdim=True) + cfg.rms_eps) * norm_w.double()
    torch.testing.assert_close(caches.glob[3][base: base + 5].double(), exp, atol=1e-5, rtol=1e-5)


def test_attention_needs_a_forward_context():
    q = torch.zeros(2, 1, 8)
    with pytest.raises(RuntimeError, match="no forward context"):
        torch.ops.dsv41.swa_attention(q, torch.zeros(2, 8), torch.zeros(1), torch.empty_like(q), 0)


# --------------------------------------------------------------------------------------
# Layer roles and presets
# --------------------------------------------------------------------------------------
def test_roles_of_shrunk_config(cfg):
    assert cfg.num_layers == 8 and cfg.kv_source_layer_ids == (1, 3) and cfg.window == 16
    assert [cfg.layer_kind(i) for i in range(8)] == ["swa", "source", "global", "source"] + ["global"] * 4
    assert cfg.compress_ratio(1) == 2 and cfg.compress_ratio(3) == 1
    assert [cfg.global_source(i) for i in range(8)] == [None, 1, 1, 3, 3, 3, 3, 3]
    assert cfg.cut == 3
    assert list(cfg.replay_layers) == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="layer 2 is not a KV source"):
        cfg.compress_ratio(2)


@pytest.mark.parametrize("name", ["tiny", "mini-1k", "mini-2k"])
def test_presets_keep_the_dsv41_layer_roles(name):
    c = preset(name)
    assert c.num_layers == 40 and c.kv_source_layer_ids == (2, 8, 14, 20) and c.window == 128
    assert c.cut == 20 and list(c.replay_layers) == list(range(21, 40))
    kinds = [c.layer_kind(i) for i in range(40)]
    assert kinds[:2] == ["swa", "swa"]
    assert [i for i, k in enumerate(kinds) if k == "source"] == [2, 8, 14, 20]
    assert all(k == "global" for i, k in enumerate(kinds) if i > 2 and i not in (8, 14, 20))
    assert [c.compress_ratio(s) for s in (2, 8, 14, 20)] == [2, 2, 2, 1]
    assert c.global_source(1) is None and c.global_source(2) == 2 and c.global_source(13) == 8
    assert all(c.global_source(i) == 20 for i in range(20, 40))


def test_preset_sizes():
    assert set(PRESETS) >= {"tiny", "mini-1k", "mini-2k"}
    assert preset("tiny").hidden_size == 256
    assert preset("mini-2k").hidden_size == 2048 and preset("mini-2k").head_dim == 128
    assert preset("mini-1k").hidden_size == 1024
    assert preset("tiny", window=16).window == 16


def test_seeded_weights():
    c = small_config().with_layers(5, (1, 3))
    a, b = build_model(c), build_model(c)
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys() and len(pa) > 0
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k
    other = dict(build_model(c.replace(seed=1)).named_parameters())
    assert not torch.equal(pa["embed"], other["embed"])
    assert not torch.equal(pa["layers.4.attn.wq_a"], other["layers.4.attn.wq_a"])


def test_model_structure_follows_roles(model, cfg):
    for i, blk in enumerate(model.layers):
        assert blk.attn.kind == cfg.layer_kind(i)
        has_comp = hasattr(blk.attn, "wc_kv")
        assert has_comp == (i in cfg.kv_source_layer_ids)
    assert model.layers[1].attn.wc_gate is not None  # ratio 2 has a gate
    assert model.layers[3].attn.wc_gate is None  # ratio 1 does not
    h = torch.randn(3, cfg.hidden_size, generator=_gen(61))
    torch.testing.assert_close(model.compute_logits(h), h @ model.head.t())
