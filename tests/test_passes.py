"""Graph-shape tests of the FX passes on a toy model.

The toy model has the shape the passes care about and nothing else: a few layers, each
with a row-local "attention" custom op that follows the out-argument protocol, and the
replay boundary markers around the last layers. Its attention reads the row count of
the view it is pointed at, like the real ops, so running the replay region on the
replay batch is observable.
"""
from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from replay_backend.backend import ReplayBackend
from replay_backend.batch import RequestChunk as R
from replay_backend.batch import build_step_batch
from replay_backend.tracing.boundary import replay_begin, replay_end
from replay_backend.counters import counters
from replay_backend.forward_context import ForwardContext, get_forward_context, set_forward_context
from replay_backend.kv_cache import CacheLayout
from replay_backend.passes.roles import declare_row_local
from replay_backend.passes.region import (ReplayRegionError, extract_replay_region,
                                          find_markers)

TOY_ATTN = "toytest::attn"
TOY_SRC = "toytest::src"
W = 4  # the toy's window
H = 8


@torch.library.custom_op(TOY_ATTN, mutates_args=("out",))
def toy_attn(q: torch.Tensor, out: torch.Tensor, layer: int) -> None:
    n = get_forward_context().active.num_tokens
    out[:n].copy_(q[:n] * 2 + layer)
    out[n:].zero_()


@toy_attn.register_fake
def _(q, out, layer):
    return None


@torch.library.custom_op(TOY_SRC, mutates_args=("out",))
def toy_src(q: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(q)


@toy_src.register_fake
def _(q, out):
    return None


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield


# --------------------------------------------------------------------------------------
# The toy model
# --------------------------------------------------------------------------------------
class ToyLayer(nn.Module):
    def __init__(self, i: int) -> None:
        super().__init__()
        self.w = nn.Linear(H, H)
        self.i = i

    def forward(self, h, pos):
        q = self.w(h) + pos[:, None].float() * 0.01
        out = torch.empty_like(q)  # allocated by the preceding piece: the out-argument protocol
        torch.ops.toytest.attn(q, out, self.i)
        return h + torch.tanh(out)


class Toy(nn.Module):
    """``num_layers`` layers; the replay region holds layers ``cut + 1 ..``; with
    ``tail`` a row-local op follows ``replay_end``; ``region_body`` is extra work
    inside the region (to make it invalid)."""

    def __init__(self, num_layers=4, cut=1, tail=False, region_body=None, markers=True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(ToyLayer(i) for i in range(num_layers))
        self.cut, self.tail, self.region_body, self.markers = cut, tail, region_body, markers

    def forward(self, x, pos):
        h = x + pos[:, None].float() * 0.1
        for i, layer in enumerate(self.layers):
            if self.markers and i == self.cut + 1:
                h, pos = replay_begin(h, pos, window=W)
                if self.region_body is not None:
                    h = self.region_body(h)
            h = layer(h, pos)
        if self.markers:
            (h,) = replay_end(h)
        return h * 2 + 1 if self.tail else h


LAYOUT = CacheLayout(128, 8)


def toy_batch(reqs):
    return build_step_batch(reqs, [[0] * r.query_len for r in reqs], list(range(len(reqs))),
                            LAYOUT, W, "cpu")


def toy_backend(**kw):
    opts = dict(compiler="eager", splitting_ops=[TOY_ATTN], max_cudagraph_capture_size=16,
                decoder_replay_trim_threshold=8, max_num_seqs=4)
    opts.update(kw)
    return ReplayBackend(**opts)


def run_step(compiled, model, reqs, seed=0):
    """One step through the compiled toy and the eager toy: (ctx, compiled out, eager out, batch)."""
    b = toy_batch(reqs)
    x = torch.randn(b.num_tokens, H, generator=torch.Generator().manual_seed(seed))
    pos = b.positions.clone()
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.mark_dynamic(pos, 0)
    ctx = ForwardContext(b, None)
    with torch.inference_mode():
        with set_forward_context(ctx):
            y = compiled(x, pos)
        with set_forward_context(ForwardContext(b, None)):
            ref = model(x, pos)
    return ctx, y, ref, b


def kinds(pieces):
    return [p.kind for p in pieces]


# (requests, step kind, padded tokens, trimmed, replay rows, replay padded size):
# a trimmed PIECEWISE step (11 tokens -> 16 >= threshold 8, 5 replay rows -> 8), an
# untrimmed one (3 -> 4), an eager trimmed one (20 > 16 tokens) and an eager step with
# nothing to trim (five 4-token requests).
STEPS = [
    ([R("a", 10, 10), R("b", 1, 5)], "piecewise", 16, True, 5, 8),
    ([R("a", 3, 3)], "piecewise", 4, False, None, 4),
    ([R("a", 20, 20)], "eager", 20, True, 4, 4),
    ([R(c, 4, 4) for c in "abcde"], "eager", 20, False, None, None),
]


@pytest.mark.parametrize("cut", [-1, 1, 2])
@pytest.mark.parametrize("tail", [False, True])
def test_toy_split_plan_and_trim_op_position(cut, tail):
    model = Toy(4, cut, tail).eval()
    be = toy_backend()
    compiled = torch.compile(model, backend=be, fullgraph=True)
    with counters.expect(strict=False, graphs_seen=1, recompiles=0, pieces={
            "graph": (cut + 2) + (4 - cut - 1 + 1) + int(tail), "attention": 4, "replay": 1}):
        run_step(compiled, model, STEPS[0][0])
    plan = be.model.plan

    n_main_attn = cut + 1
    want_main = ["graph", "attention"] * n_main_attn + ["graph", "replay"] + (["graph"] if tail else [])
    want_replay = ["graph", "attention"] * (4 - n_main_attn) + ["graph"]
    assert kinds(plan.main_pieces) == want_main
    assert kinds(plan.replay_pieces) == want_replay
    want_counts = {"graph": n_main_attn + 1 + int(tail), "attention": n_main_attn, "replay": 1}
    assert plan.pieces_by_kind("main") == {k: v for k, v in want_counts.items() if v}
    assert plan.pieces_by_kind("replay") == {"graph": 4 - n_main_attn + 1, "attention": 4 - n_main_attn}
    assert plan.replay_layers == [cut + 1, 3]
    assert plan.window == W and plan.replay_off_reason is None
    assert plan.capture_sizes == [1, 2, 4, 8, 16]
    assert plan.replay_capture_sizes == [4, 8, 12, 16]  # W .. min(16, 4 * W)

    # The trim op sits where the region was: after the last main attention layer,
    # covering exactly the replay layers, and the attention pieces on each side of it
    # cover the layers before / after the cut, in order.
    replay = [p for p in plan.main_pieces if p.kind == "replay"]
    assert len(replay) == 1
    assert replay[0].op == "dsv41_replay::trim_and_redispatch"
    assert replay[0].layers == list(range(cut + 1, 4))
    assert [p.layers for p in plan.main_pieces if p.kind == "attention"] == [[i] for i in range(cut + 1)]
    assert [p.layers for p in plan.replay_pieces if p.kind == "attention"] == [[i] for i in range(cut + 1, 4)]
    assert all(p.op == TOY_ATTN for p in plan.main_pieces + plan.replay_pieces if p.kind == "attention")
    # the region's ops left the main graph: no piece there touches a replay layer
    assert all(max(p.layers, default=-1) <= cut for p in plan.main_pieces if p.kind != "replay")
    # and the markers are gone from the main graph
    code = be.model.split_gm.print_readable(print_output=False)
    assert "replay_begin" not in code and "replay_end" not in code
    assert code.count("trim_and_redispatch") >= 1

    for i, (reqs, kind, padded, trimmed, rows, rsize) in enumerate(STEPS):
        ctx, y, ref, b = run_step(compiled, model, reqs, seed=i)
        res = ctx.result
        assert (res.kind, res.padded_tokens) == (kind, padded)
        assert (res.trimmed, res.replay_padded, res.replay_graph) == (trimmed, rsize, rsize is not None)
        if trimmed:
            assert res.replay_rows == rows == b.replay.num_rows
        keep = b.replay.rows_t if trimmed else torch.arange(b.num_tokens)
        torch.testing.assert_close(y[keep], ref[keep], atol=1e-5, rtol=1e-5)
        if trimmed and b.has_trimmable_rows:
            dead = sorted(set(range(b.num_tokens)) - set(b.replay.rows))
            # trimmed rows are zeros after replay_end, never stale data
            assert (y[dead] == (1.0 if tail else 0.0)).all()
    assert len(be.compiled) == 1  # one trace for every step size


def test_decoder_replay_false_leaves_no_replay_piece():
    model = Toy(4, 1).eval()
    be = toy_backend(decoder_replay=False)
    compiled = torch.compile(model, backend=be, fullgraph=True)
    with counters.expect(strict=False, fallbacks={}, trims=0, untrimmed=0):
        ctx, y, ref, b = run_step(compiled, model, STEPS[0][0])
    plan = be.model.plan
    assert "replay" not in plan.pieces_by_kind("main")
    assert plan.pieces_by_kind("main") == {"graph": 5, "attention": 4}
    assert plan.replay_pieces == [] and plan.replay_layers is None
    assert plan.replay_capture_sizes == []
    assert plan.replay_off_reason == "decoder_replay=false"
    assert not ctx.result.has_region and not ctx.result.trimmed
    # the replay layers ran on the whole batch inside the main graph
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)


def test_graph_without_markers_has_no_region():
    model = Toy(3, markers=False).eval()
    be = toy_backend()
    compiled = torch.compile(model, backend=be, fullgraph=True)
    with counters.expect(strict=False, fallbacks={}):
        ctx, y, ref, b = run_step(compiled, model, STEPS[0][0])
    plan = be.model.plan
    assert plan.pieces_by_kind("main") == {"graph": 4, "attention": 3}
    assert plan.replay_layers is None and plan.window is None
    assert "no replay boundary markers" in plan.replay_off_reason
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)


def test_threshold_not_above_window_is_a_clear_error():
    model = Toy(4, 1).eval()
    compiled = torch.compile(model, backend=toy_backend(decoder_replay_trim_threshold=W), fullgraph=True)
    with pytest.raises(Exception, match="smaller graphs have nothing to trim"):
        run_step(compiled, model, STEPS[0][0])


# --------------------------------------------------------------------------------------
# Region extraction, called directly on a Dynamo-traced graph
# --------------------------------------------------------------------------------------
def trace(fn, reqs=(R("a", 12, 12),)) -> torch.fx.GraphModule:
    gms = []

    def capture(gm, example_inputs):
        gms.append(gm)
        return gm.forward

    compiled = torch.compile(fn, backend=capture, fullgraph=True)
    b = toy_batch(list(reqs))
    x = torch.randn(b.num_tokens, H)
    pos = b.positions.clone()
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.mark_dynamic(pos, 0)
    with torch.inference_mode(), set_forward_context(ForwardContext(b, None)):
        compiled(x, pos)
    assert len(gms) == 1
    return gms[0]


def region_fn(body):
    """x, pos -> a region that runs ``body(h, p)`` between the markers."""

    def f(x, pos):
        x = x + pos[:, None]  # one token-count symbol for both inputs
        h, p = replay_begin(x, pos, window=W)
        h = body(h, p)
        (h,) = replay_end(h)
        return h

    return f


def extract(gm):
    return extract_replay_region(gm, [TOY_ATTN], [TOY_SRC])


def test_no_markers_gives_none():
    gm = trace(lambda x, pos: (x + pos[:, None]).relu())
    assert find_markers(gm) is None
    assert extract(gm) is None


def test_a_valid_region_is_extracted():
    def body(h, p):
        out = torch.empty_like(h)
        torch.ops.toytest.attn(h * 3, out, 0)
        return out.relu() + p[:, None]

    gm = trace(region_fn(body))
    begin, end = find_markers(gm)
    assert begin.name != end.name
    region = extract(gm)
    assert region.num_row_inputs == 2 and region.num_outputs == 1 and region.window == W
    ops = [n for n in region.graph.graph.nodes if n.op == "call_function"]
    assert any("toytest" in str(n.target) for n in ops)
    # the main graph now holds one trim op and no markers
    main = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert sum("trim_and_redispatch" in t for t in main) == 1
    assert not any("replay_begin" in t or "replay_end" in t for t in main)


def test_markers_twice():
    def f(x, pos):
        x = x + pos[:, None]
        h, p = replay_begin(x, pos, window=W)
        (h,) = replay_end(h * 2)
        h, p = replay_begin(h, p, window=W)
        (h,) = replay_end(h + 1)
        return h

    with pytest.raises(ReplayRegionError, match="once"):
        extract(trace(f))


def test_begin_without_end():
    def f(x, pos):
        h, p = replay_begin(x + pos[:, None], pos, window=W)
        return h * 2

    with pytest.raises(ReplayRegionError, match="once"):
        find_markers(trace(f))


def test_end_before_begin():
    def f(x, pos):
        (x,) = replay_end(x + pos[:, None])
        h, p = replay_begin(x, pos, window=W)
        return h * 2

    with pytest.raises(ReplayRegionError, match="before"):
        find_markers(trace(f))


def test_region_reading_token_indexed_value_from_outside():
    def f(x, pos):
        x = x + pos[:, None]
        y = x * 3  # token-indexed, not passed through replay_begin
        h, p = replay_begin(x, pos, window=W)
        (h,) = replay_end(h + y)
        return h

    with pytest.raises(ReplayRegionError, match="replay_begin"):
        extract(trace(f))


def test_region_reading_weights_from_outside_is_fine():
    w = torch.randn(H, H)

    def f(x, pos):
        x = x + pos[:, None]
        h, p = replay_begin(x, pos, window=W)
        (h,) = replay_end(h @ w)
        return h

    region = extract(trace(f))
    # the weight became a region input after the row inputs
    phs = [n.name for n in region.graph.graph.nodes if n.op == "placeholder"]
    assert phs[:3] == ["num_rows", "row_0", "row_1"] and len(phs) == 4


def test_region_not_single_exit():
    def f(x, pos):
        x = x + pos[:, None]
        h, p = replay_begin(x, pos, window=W)
        z = h * 2
        (o,) = replay_end(z + 1)
        return o + z  # z escapes the region without passing replay_end

    with pytest.raises(ReplayRegionError, match="single-exit"):
        extract(trace(f))


@pytest.mark.parametrize("which", ["row", "position"])
def test_region_input_used_after_the_region_is_not_single_exit(which):
    """replay_begin's own outputs used after replay_end escape the region as much as a
    value computed in it: the step's rows are no longer there after a trim."""
    def f(x, pos):
        x = x + pos[:, None]
        h, p = replay_begin(x, pos, window=W)
        (o,) = replay_end(h * 2)
        return o + (h if which == "row" else p[:, None])

    gm = trace(f)
    before = str(gm.graph)
    with pytest.raises(ReplayRegionError, match=r"an output of replay_begin in the replay region, is used by .* single-exit"):
        extract(gm)
    assert str(gm.graph) == before  # refused before the rewrite: nothing half-applied


@pytest.mark.parametrize("out", [lambda h: torch.ones(3), lambda h: torch.zeros(()), lambda h: h.T * 1],
                         ids=["constant", "0-dim", "transposed"])
def test_region_result_not_indexed_by_token_is_refused(out):
    """What leaves replay_end is one row per token; anything else reached the trim op's
    copies (or pinned the token count in the rewrite) instead of a fallback."""
    def f(x, pos):
        x = x + pos[:, None]
        h, p = replay_begin(x, pos, window=W)
        (o,) = replay_end(out(h))
        return o

    gm = trace(f)
    before = str(gm.graph)
    with pytest.raises(ReplayRegionError, match="is not indexed by token"):
        extract(gm)
    assert str(gm.graph) == before


ROW_MIXING = {
    "sum over tokens": lambda h, p: h - h.sum(0),
    "mean over tokens, keepdim": lambda h, p: h - h.mean(0, keepdim=True),
    "max over tokens": lambda h, p: h - h.amax(0),
    "cumsum over tokens": lambda h, p: h.cumsum(0),
    "cumsum, negative dim": lambda h, p: h.cumsum(-2),
    "flip tokens": lambda h, p: torch.flip(h, [0]),
    "sort tokens": lambda h, p: torch.sort(h, dim=0).values,
    "roll tokens (keyword dims)": lambda h, p: torch.roll(h, shifts=1, dims=0),
}


@pytest.mark.parametrize("name", list(ROW_MIXING))
def test_region_not_row_local(name):
    with pytest.raises(ReplayRegionError, match="not row-local"):
        extract(trace(region_fn(ROW_MIXING[name])))


@pytest.mark.parametrize("body", [lambda h, p: h - h.sum(1, keepdim=True), lambda h, p: h.cumsum(1),
                                  lambda h, p: torch.softmax(h, -1) * p[:, None]],
                         ids=["sum over features", "cumsum over features", "softmax over features"])
def test_row_local_ops_along_features_are_fine(body):
    assert extract(trace(region_fn(body))) is not None


@pytest.mark.parametrize("body", [lambda h, p: torch.roll(h, 1, 0), lambda h, p: torch.softmax(h, 0),
                                  lambda h, p: (h @ h.t()) @ h, lambda h, p: h.t().softmax(-1).t()],
                         ids=["roll positional dims", "softmax over tokens", "rows paired with rows",
                              "softmax over tokens after transpose"])
def test_region_ops_along_tokens_are_not_row_local(body):
    with pytest.raises(ReplayRegionError, match="not row-local"):
        extract(trace(region_fn(body)))


@torch.library.custom_op("toytest::rowmix", mutates_args=())
def toy_rowmix(h: torch.Tensor) -> torch.Tensor:
    return h + h.mean(0)


@toy_rowmix.register_fake
def _(h):
    return torch.empty_like(h)


@torch.library.custom_op("toytest::rowscale", mutates_args=())
def toy_rowscale(h: torch.Tensor) -> torch.Tensor:
    return h * 2


@toy_rowscale.register_fake
def _(h):
    return torch.empty_like(h)


declare_row_local("toytest::rowscale")
CONV = torch.randn(H, H, 3)
HOLES = {
    "shift by one row": (lambda h, p: torch.nn.functional.pad(h[:-1], (0, 0, 1, 0)), "changes the number of rows"),
    "conv1d over tokens": (lambda h, p: torch.nn.functional.conv1d(h.t()[None], CONV, padding=1)[0].t(),
                           "conv1d (conv1d) convolves or mixes channels along the token dimension"),
    "an undeclared custom op": (lambda h, p: torch.ops.toytest.rowmix(h),
                                "toytest::rowmix) is not known to be row-local: declare it"),
    "one row picked": (lambda h, p: h * h[0], "(getitem) selects rows"),
    "rows reshaped into features": (lambda h, p: h.reshape(-1, 2 * H).reshape(-1, H), "reshape (reshape)"),
    "every other row": (lambda h, p: torch.cat([h[::2], h[1::2]]), "changes the number of rows"),
}


HOLES.update({
    "roll without dims (flattens first)": (lambda h, p: torch.roll(h, 1), "works over every dimension"),
    "a row's index as a value": (lambda h, p: h * (torch.arange(h.shape[0]) == 0)[:, None],
                                 "makes values that depend on the row's index"),
    "einsum over tokens": (lambda h, p: torch.einsum("th,tk->hk", h, h) @ TABLE[:H], "einsum (einsum) reduces over the token dimension"),
    "scatter into one row": (lambda h, p: h.scatter(1, torch.zeros(1, 2, dtype=torch.int64), 1.0),
                             "whose rows do not line up"),
    "layer norm over the token dimension": (lambda h, p: torch.nn.functional.layer_norm(h.t(), (h.shape[0],)).t(),
                                            "normalises over the token dimension"),
})
TABLE = torch.randn(64, H)
GROUPS = torch.randn(2, H // 2, H // 2)
F = torch.nn.functional
ROW_LOCAL = {
    "layer norm": lambda h, p: F.layer_norm(h, (H,)),
    "rms norm": lambda h, p: F.rms_norm(h, (H,)),
    "embedding": lambda h, p: h + F.embedding(p % 64, TABLE),
    "table rows by position": lambda h, p: h + TABLE.index_select(0, p % 64),
    "elementwise max": lambda h, p: torch.max(h, h * 2) + torch.min(h, 1.0 - h),
    "linear by keyword": lambda h, p: F.linear(h, weight=TABLE[:H]) + torch.matmul(h, other=TABLE[:H]),
    "dropout at inference": lambda h, p: F.dropout(h, 0.1, training=False),
    "einsum over features": lambda h, p: torch.einsum("th,hk->tk", h, TABLE[:H]),
    "normalize": lambda h, p: F.normalize(h, dim=-1),
    "repeat along features": lambda h, p: h.repeat(1, 2)[:, :H],
    "baddbmm over groups": lambda h, p: torch.baddbmm(h.view(-1, 2, H // 2).transpose(0, 1),
                                                     h.view(-1, 2, H // 2).transpose(0, 1),
                                                     GROUPS).transpose(0, 1).reshape(-1, H),
    "stack of rows' vectors": lambda h, p: torch.stack([p.float(), p.float() * 2], dim=-1).sum(-1)[:, None] + h,
    "complex rotation": lambda h, p: torch.view_as_real(torch.view_as_complex(h.view(-1, H // 2, 2)) * torch.polar(
        torch.ones(H // 2), torch.arange(H // 2).float())).reshape(-1, H),
}


@pytest.mark.parametrize("name", list(ROW_LOCAL))
def test_ordinary_row_local_code_is_accepted(name):
    assert extract(trace(region_fn(ROW_LOCAL[name]))) is not None


@pytest.mark.parametrize("name", list(HOLES))
def test_ops_not_known_row_local_are_refused_by_name(name):
    body, match = HOLES[name]
    with pytest.raises(ReplayRegionError, match=re.escape(match)):
        extract(trace(region_fn(body)))


def test_a_custom_op_declared_row_local_is_accepted():
    assert extract(trace(region_fn(lambda h, p: torch.ops.toytest.rowscale(h) + p[:, None]))) is not None


def test_forbidden_op_in_region():
    def body(h, p):
        out = torch.empty_like(h)
        torch.ops.toytest.src(h, out)
        return out

    with pytest.raises(ReplayRegionError, match="after the cut"):
        extract(trace(region_fn(body)))


def test_region_input_not_indexed_by_token():
    w = torch.randn(H, H)

    def f(x, pos):
        x = x + pos[:, None]
        h, ww = replay_begin(x, w, window=W)
        (h,) = replay_end(h @ ww)
        return h

    with pytest.raises(ReplayRegionError, match="not indexed by token"):
        extract(trace(f))


# --------------------------------------------------------------------------------------
# Through the backend: an unsupported region switches the feature off
# --------------------------------------------------------------------------------------
def _mix_tokens(h):
    # Not row-local (row i reads rows 0..i)
    return h.cumsum(0) * 0.1


@pytest.mark.parametrize("body", [_mix_tokens, lambda h: h - h.mean(0) * 0.5],
                         ids=["cumsum over tokens", "mean over tokens (pad rows would move it)"])
def test_unsupported_region_switches_replay_off_and_main_graphs_too(body):
    """A region that mixes rows cannot be trimmed, and in the main graph it cannot be
    padded either: steps run without graphs, on exactly their rows, like the eager model."""
    model = Toy(4, 1, region_body=body).eval()
    be = toy_backend()
    compiled = torch.compile(model, backend=be, fullgraph=True)
    with counters.expect(strict=False, fallbacks={"replay_region_unsupported": 1, "main_graphs_padding_unsafe": 1},
                         trims=0, untrimmed=0):
        ctx, y, ref, b = run_step(compiled, model, STEPS[0][0])
    plan = be.model.plan
    assert ctx.result.kind == "eager" and plan.capture_sizes == []
    assert plan.replay_off_reason is not None and "not row-local" in plan.replay_off_reason
    assert "replay" not in plan.pieces_by_kind("main") and plan.replay_pieces == []
    assert plan.replay_layers is None
    assert not ctx.result.has_region
    # everything ran on the whole batch, like the eager model
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    ctx, y, ref, b = run_step(compiled, model, STEPS[2][0], seed=3)  # an eager step
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    assert not ctx.result.has_region


def test_a_kv_source_the_model_declared_after_the_cut_switches_replay_off():
    """The backend knows KV sources only from the model's declarations (no op names of
    its own): a declared one inside the region is refused with its name."""
    from replay_backend.passes.roles import declare_attention

    declare_attention(TOY_SRC, kv_source=True)

    def write_global_kv(h):
        out = torch.empty_like(h)
        torch.ops.toytest.src(h, out)
        return out

    be = toy_backend(splitting_ops=[TOY_ATTN, TOY_SRC])
    model = Toy(4, 1, region_body=write_global_kv).eval()
    with counters.expect(strict=False, fallbacks={"replay_region_unsupported": 1}):
        run_step(torch.compile(model, backend=be, fullgraph=True), model, STEPS[0][0])
    assert "KV source op toytest::src at src lies after the cut" in be.model.plan.replay_off_reason


def test_unsupported_region_with_strict_raises():
    from replay_backend.fallbacks import StrictFallbackError

    model = Toy(4, 1, region_body=_mix_tokens).eval()
    compiled = torch.compile(model, backend=toy_backend(strict=True), fullgraph=True)
    with pytest.raises(Exception) as e:
        run_step(compiled, model, STEPS[0][0])
    assert isinstance(e.value, StrictFallbackError) or "StrictFallbackError" in str(e.value)
    assert "replay_region_unsupported" in str(e.value)
    assert "not row-local" in str(e.value)


@pytest.mark.parametrize("cudagraph_mode, refused", [("piecewise", True), ("none", False)])
def test_a_step_dependent_op_left_out_of_splitting_ops_is_refused_when_pieces_are_captured(
        model, fresh_dynamo, cudagraph_mode, refused):
    """The KV sources' attention reads the step's metadata: inside a captured piece it
    would replay the first step's. Without graphs the pieces run per step, so it may."""
    from replay_backend import RequestChunk, StepRunner
    from replay_backend.backend import ReplayBackend
    from replay_backend.compat.dynamo import user_error

    be = ReplayBackend(compiler="eager", cudagraph_mode=cudagraph_mode, max_cudagraph_capture_size=64,
                       decoder_replay_trim_threshold=32,
                       splitting_ops=["dsv41::swa_attention", "dsv41::global_attention"])
    runner = StepRunner(model, max_model_len=256, backend=be)
    if not refused:
        runner.step([RequestChunk("a", 20, 20)])
        return
    with pytest.raises(Exception) as info:
        runner.step([RequestChunk("a", 20, 20)])
    err = str(user_error(info.value))
    assert "option splitting_ops: dsv41::source_attention read(s) per-step state" in err, info.value


@pytest.mark.parametrize("options", [dict(cudagraph_mode="none"), dict(cudagraph_mode="piecewise"),
                                     dict(decoder_replay=False)])
def test_attention_in_the_replay_layers_left_out_of_splitting_ops_is_refused(model, fresh_dynamo, options):
    """The replay layers' attention applies the replay floor, which only a splitting op
    learns (the view it is pointed at): left inside a piece, it attends below the floor
    and the step is wrong, with graphs or without, so the build refuses it by name."""
    from replay_backend import RequestChunk, StepRunner
    from replay_backend.backend import ReplayBackend
    from replay_backend.compat.dynamo import user_error

    be = ReplayBackend(compiler="eager", max_cudagraph_capture_size=64, decoder_replay_trim_threshold=32,
                       splitting_ops=["dsv41::source_attention"], **options)
    with pytest.raises(Exception) as info:
        StepRunner(model, max_model_len=256, backend=be).step([RequestChunk("a", 20, 20)])
    err = str(user_error(info.value))
    assert "option splitting_ops leaves out dsv41::global_attention, declared attention in the replay layers" in err, err


def _with_named_dim_twins(original):
    """``get_signature_for_torch_op`` as torch versions that also list each op's
    named-dimension overload (``mean(x, dim: str[])`` beside ``mean(x, dim: int[])``) give it."""
    import inspect
    import typing

    def signatures(op, return_schemas=False):
        sigs = original(op)
        if sigs is None or return_schemas:
            return original(op, return_schemas) if return_schemas else sigs
        twins = []
        for sig in sigs:
            dim = sig.parameters.get("dim")
            if dim is not None:
                name = typing.List[str] if typing.get_origin(dim.annotation) in (list, typing.Union) else str
                twins.append(sig.replace(parameters=[p.replace(annotation=name) if p.name == "dim" else p
                                                     for p in sig.parameters.values()]))
        return sigs + twins
    return signatures


ALONG_FEATURES = {
    "mean over features": lambda h, p: h - h.float().pow(2).mean(-1, keepdim=True),
    "softmax over features": lambda h, p: torch.softmax(h, -1) * p[:, None],
    "max over features": lambda h, p: h - h.max(1).values[:, None],
    "normalize": ROW_LOCAL["normalize"],
}


@pytest.mark.parametrize("name", list(ALONG_FEATURES))
def test_row_locality_does_not_depend_on_the_overloads_torch_lists(monkeypatch, name):
    """torch 2.11 lists named-dimension twins, which made ``x.mean(-1)`` ambiguous by
    argument count: the analysis then took it for a mean over every dimension and
    switched replay off for the reference model on the GPU machine."""
    from torch.fx import operator_schemas

    monkeypatch.setattr(operator_schemas, "get_signature_for_torch_op",
                        _with_named_dim_twins(operator_schemas.get_signature_for_torch_op))
    assert extract(trace(region_fn(ALONG_FEATURES[name]))) is not None
    for mixing in ("mean over tokens, keepdim", "cumsum over tokens", "sort tokens"):
        with pytest.raises(ReplayRegionError, match="not row-local"):
            extract(trace(region_fn(ROW_MIXING[mixing])))
