"""Models that bend the replay boundary's rules, served against their own eager run.

Each either trims and matches the eager model, runs with the region off (a counted
fallback) and matches it, or is refused with an error naming the problem: never a
crash inside the passes, and never other numbers than the eager model's.
"""
from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import replay_backend
from gqa_rope import GQABlock
from own_server import OwnServer, gqa_cache
from replay_backend import RequestChunk as R
from replay_backend import counters, plan_of, replay_begin, replay_end

W = 12
OPTS = {"compiler": "eager", "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64],
        "decoder_replay_trim_threshold": 32, "max_num_seqs": 4, "max_num_batched_tokens": 256}
# A prefill that trims in graphs, a lone decode, a short prefill, an eager step that trims.
STEPS = [[R("a", 20, 20)], [R("a", 1, 21)], [R("b", 3, 3), R("a", 1, 22)], [R("c", 100, 100)]]


class Model(nn.Module):
    """Window layers, one full-attention layer (a KV source), then the replay layers of
    ``tail``, which each case marks its own way."""

    def __init__(self, kinds: str = "wfww") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.window, self.replay_from, self.kv_heads, self.head_dim = W, kinds.rfind("f") + 1, 1, 8
        self.embed = nn.Embedding(32, 16)
        self.layers = nn.ModuleList(GQABlock(16, 2, 1, 8, 16, i, None if c == "f" else W, i >= self.replay_from)
                                    for i, c in enumerate(kinds))
        self.norm, self.head = nn.RMSNorm(16, eps=1e-6), nn.Linear(16, 32, bias=False)
        self.register_buffer("inv_freq", 1000.0 ** -(torch.arange(0, 8, 2).float() / 8), persistent=False)

    def angles(self, pos):
        f = pos.float()[:, None] * self.inv_freq[None, :]
        f = torch.cat((f, f), -1)[:, None, :]
        return f.cos(), f.sin()

    def forward(self, input_ids, positions):
        x = self.embed(input_ids)
        cos, sin = self.angles(positions)
        for layer in self.layers[:self.replay_from]:
            x = layer(x, cos, sin)
        return (self.norm(self.tail(x, positions)),)

    def replay_layers(self, x, p):
        for layer in self.layers[self.replay_from:]:
            x = layer(x, *self.angles(p))
        return x


class OnePair(Model):
    def tail(self, x, positions):
        x, p = replay_begin(x, positions, window=W)
        (x,) = replay_end(self.replay_layers(x, p))
        return x


class TwoPairs(Model):  # the markers inside the loop over the replay layers
    def tail(self, x, positions):
        for layer in self.layers[self.replay_from:]:
            x, p = replay_begin(x, positions, window=W)
            (x,) = replay_end(layer(x, *self.angles(p)))
        return x


class MeanAfter(Model):  # mixes the rows the region returns, which a trim leaves unwritten
    def tail(self, x, positions):
        x = OnePair.tail(self, x, positions)
        return x - x.mean(0)


class AttentionAfter(Model):  # window layers after replay_end read every row of the region's output
    def __init__(self) -> None:
        super().__init__("wfwww")

    def tail(self, x, positions):
        first, *rest = self.layers[self.replay_from:]
        x, p = replay_begin(x, positions, window=W)
        (x,) = replay_end(first(x, *self.angles(p)))
        for layer in rest:
            x = layer(x, *self.angles(positions))
        return x


def serve_against_eager(make, steps=STEPS, options=None):
    """Serve ``make()`` compiled and its weights eagerly, step by step; returns the
    compiled model and how many steps trimmed."""
    torch._dynamo.reset()
    model = make().eval()
    oracle = OwnServer(model, gqa_cache)
    compiled = replay_backend.compile(model, ("input_ids", "positions"), options={**OPTS, **(options or {})})
    server = OwnServer(model, gqa_cache, compiled)
    server.serve()
    trims = 0
    for step in steps:
        want, _ = oracle.step(step)
        got, result = server.step(step)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{step}: logits: {m}")
        for (layer, kv, a), (_, _, b) in zip(server.written(step), oracle.written(step)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{step}: {kv} of layer {layer}: {m}")
        trims += bool(result.trimmed)
    return compiled, trims


def test_one_pair_trims_and_matches():
    _, trims = serve_against_eager(OnePair)
    assert trims >= 2


def test_two_marker_pairs_run_as_the_eager_model_marks_them():
    """Each pair's layers read the replay layers' view, as the uncompiled markers point
    them: the region left in the main graph keeps the floor there."""
    before = counters.fallbacks["replay_region_unsupported"]
    compiled, trims = serve_against_eager(TwoPairs)
    assert trims == 0 and "marked once" in plan_of(compiled).replay_off_reason
    assert counters.fallbacks["replay_region_unsupported"] == before + 1


@pytest.mark.parametrize("make, why", [
    (MeanAfter, r"after replay_end.*not row-local"),
    (AttentionAfter, r"window_attention at .* runs after replay_end"),
], ids=["mean", "attention"])
def test_rows_mixed_after_the_region_keep_it_in_the_main_graph(make, why):
    """After a trim the region's output holds the kept rows only: what follows
    replay_end must read each row alone, or no step may trim."""
    compiled, trims = serve_against_eager(make)
    assert trims == 0
    assert plan_of(compiled).replay_off_reason is not None
    assert re.search(why, plan_of(compiled).replay_off_reason), plan_of(compiled).replay_off_reason


# After a graph break inside ``tail`` its rest is a graph of its own: the norm's weight
# fixes its rows' width (a graph input of free width is refused under dynamic=True).
class BreakThenNorm(Model):  # the next graph reads each row alone
    def tail(self, x, positions):
        x = OnePair.tail(self, x, positions)
        torch._dynamo.graph_break()
        return self.norm(x * 2.0)


class BreakThenMean(Model):  # the same row-mixing as MeanAfter, in the next graph
    def tail(self, x, positions):
        x = OnePair.tail(self, x, positions)
        torch._dynamo.graph_break()
        return self.norm(x - x.mean(0))


class BreakThenAttention(AttentionAfter):  # the window layers after replay_end in the next graph
    def tail(self, x, positions):
        first, *rest = self.layers[self.replay_from:]
        x, p = replay_begin(x, positions, window=W)
        (x,) = replay_end(first(x, *self.angles(p)))
        torch._dynamo.graph_break()
        for layer in rest:
            x = layer(x, *self.angles(positions))
        return x


@pytest.mark.parametrize("make", [BreakThenMean, BreakThenAttention], ids=["mean", "attention"])
def test_rows_mixed_in_a_later_graph_of_the_step_turn_trimming_off(make):
    """The region's graph cannot see what a later graph of the same step does with its
    rows: that graph, reading rows together, turns the region's trimming off when it is
    built (a counted fallback), before any step trims, and every step matches."""
    before = counters.fallbacks["replay_region_unsupported"]
    fn, trims = serve_with_graph_breaks(make)
    assert trims == 0
    assert counters.fallbacks["replay_region_unsupported"] == before + 1
    region_graph = next(m for m in replay_backend.backend_of(fn).compiled if m.replay is not None)
    assert "no step trims: a later graph of the step reads the region's rows together" in \
        plan_of(region_graph).replay_off_reason


def test_a_step_that_trimmed_before_the_later_graph_was_built_fails_naming_why():
    """Built in a step whose region already trimmed, the later graph is too late for
    that step: the step fails with the reason, and the steps after it do not trim."""
    torch._dynamo.reset()
    model = BreakThenMean().eval()
    fn = torch.compile(model, backend="dsv41_replay", dynamic=True, options=OPTS)
    oracle, server = OwnServer(model, gqa_cache), OwnServer(model, gqa_cache)
    step = [R("a", 20, 20)]
    batch = replay_backend.build_step_batch(step, [server.default_tokens(r) for r in step], [server.block("a")],
                                            server.layout, W, "cpu")
    with torch.no_grad(), replay_backend.set_forward_context(server.setup.context(batch, use_graphs=False)):
        with pytest.raises(ValueError, match=r"reads rows together \(mean .* after a graph of the same step "
                                             r"trimmed its replay region"):
            fn(batch.input_ids, batch.positions)
    before = counters.trims
    with torch.no_grad(), replay_backend.set_forward_context(server.setup.context(batch, use_graphs=False)):
        (hidden,) = fn(batch.input_ids, batch.positions)
    assert counters.trims == before
    want, _ = oracle.step(step)
    torch.testing.assert_close(model.head(hidden[batch.logits_indices]), want, rtol=1e-5, atol=1e-5)


def test_a_row_local_graph_after_the_region_leaves_trimming_on():
    assert serve_with_graph_breaks(BreakThenNorm)[1] >= 2


class BeginOnly(Model):  # replay_end forgotten
    def tail(self, x, positions):
        x, p = replay_begin(x, positions, window=W)
        return self.replay_layers(x, p)


class EndFirst(Model):
    def tail(self, x, positions):
        (x,) = replay_end(x)
        x, p = replay_begin(x, positions, window=W)
        return self.replay_layers(x, p)


@pytest.mark.parametrize("make, why", [
    (BeginOnly, r"replay_begin at \w+ has no replay_end after it in this graph"),
    (EndFirst, r"replay_end at \w+ has no replay_begin before it in this graph"),
], ids=["begin only", "end first"])
def test_markers_that_do_not_pair_up_are_refused_before_serving(make, why):
    """Which layers read the floor would depend on graphs the backend cannot see (a
    graph break between the markers gives each graph half a pair)."""
    with pytest.raises(Exception, match=why) as info:
        serve_against_eager(make)
    assert "graph_breaks" in str(info.value)


class WithAux(OnePair):
    """A second output: not indexed by token (a matrix, a 0-dim tensor), or indexed by
    token in another dimension than the first (the hidden states transposed)."""

    kind = "matrix"

    def forward(self, input_ids, positions):
        (h,) = super().forward(input_ids, positions)
        aux = {"matrix": lambda: self.head.weight * 2.0, "0-dim": lambda: self.norm.weight.sum(),
               "transposed": lambda: h.t() * 2.0}[self.kind]()
        return h, aux


@pytest.mark.parametrize("kind", ["matrix", "0-dim", "transposed"])
def test_outputs_come_back_cut_to_the_real_tokens_in_each_token_dimension(kind):
    """Only the token-indexed outputs are cut to the step's real rows, in every
    dimension that the token count sizes (a trimming step computes its kept rows only:
    those are compared where an output is indexed by token)."""
    torch._dynamo.reset()
    model = type("Aux", (WithAux,), {"kind": kind})().eval()
    compiled = replay_backend.compile(model, ("input_ids", "positions"), options=OPTS)
    server = OwnServer(model, gqa_cache, compiled)
    server.serve()
    for step in STEPS[:3]:  # graphed steps, a trimming one and a lone decode among them
        batch = compiled.build_batch(step, [server.default_tokens(r) for r in step],
                                     [server.block(r.req_id) for r in step])
        with torch.no_grad(), replay_backend.set_forward_context(server.setup.context(batch)):
            got = compiled(batch.input_ids, batch.positions)[1]
            want = model(batch.input_ids, batch.positions)[1]
        assert got.shape == want.shape
        if kind == "transposed":
            got, want = got[:, batch.logits_indices], want[:, batch.logits_indices]
        torch.testing.assert_close(got, want)


class BreakBefore(OnePair):  # a graph break ahead of the region: two graphs, the first's outputs the second's inputs
    def tail(self, x, positions):
        torch._dynamo.graph_break()
        return super().tail(x, positions)


def serve_with_graph_breaks(make) -> tuple:
    """``make()`` under plain ``torch.compile`` (``replay_backend.compile`` traces one
    graph), served step by step against its eager run; returns the compiled model and
    the trimmed steps."""
    torch._dynamo.reset()
    model = make().eval()
    fn = torch.compile(model, backend="dsv41_replay", dynamic=True, options=OPTS)
    oracle, server = OwnServer(model, gqa_cache), OwnServer(model, gqa_cache)
    batch = server.setup.dummy_batch(W)
    with torch.no_grad(), replay_backend.set_forward_context(server.setup.context(batch, use_graphs=False)):
        fn(batch.input_ids, batch.positions)
    backend = replay_backend.backend_of(fn)
    backend.capture(server.setup)
    backend.start_serving()
    before = counters.trims
    for step in STEPS:
        b = backend.build_batch(step, [server.default_tokens(r) for r in step], [server.block(r.req_id) for r in step])
        with torch.no_grad(), replay_backend.set_forward_context(server.setup.context(b)):
            (hidden,) = fn(b.input_ids, b.positions)
        want, _ = oracle.step(step)
        torch.testing.assert_close(model.head(hidden[b.logits_indices]), want, rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{step}: logits: {m}")
    return fn, counters.trims - before


def test_a_graph_break_serves_without_recompiling():
    """The first graph's outputs reach the second as its inputs: an eager step's and a
    graphed step's must look alike to the second's guards (no view of padded rows)."""
    serve_with_graph_breaks(BreakBefore)


class ScaleOutside(Model):  # the region reads a tensor the main layers compute from a weight
    def tail(self, x, positions):
        scale = self.norm.weight * 2.0
        x, p = replay_begin(x, positions, window=W)
        (x,) = replay_end(self.replay_layers(x * scale, p))
        return x


def test_a_tensor_the_main_layers_compute_for_the_region_is_held_for_its_graphs():
    """Its address changes from step to step (a new allocation, another graph's pool):
    the trim op copies it where the replay graphs read it."""
    _, trims = serve_against_eager(ScaleOutside)
    assert trims >= 2


class BeginShorter(Model):  # the region's rows one fewer than the step's: its shapes guard on the count
    def tail(self, x, positions):
        x2, p = replay_begin(x[1:], positions[1:], window=W)
        (y,) = replay_end(self.replay_layers(x2, p))
        return torch.cat((x[:1], y))


def test_a_guard_failing_at_two_tokens_blames_a_one_token_trace_only_after_one():
    """Traced on W tokens, a guard that holds at one token and fails at two was not
    made by a trace on one token: the error must not send the user there."""
    with pytest.raises(Exception, match="fails at 2 tokens") as info:
        serve_against_eager(BeginShorter)
    assert "traced on a call of one token" not in str(info.value)


class UnbindRows(Model):  # a Python loop over the token rows fixes the count in the trace
    def tail(self, x, positions):
        x, p = replay_begin(x, positions, window=W)
        x = torch.stack([r * 2 for r in x.unbind(0)])
        (x,) = replay_end(self.replay_layers(x, p))
        return x


def test_a_model_that_fixes_the_token_count_is_told_so_under_compile():
    """Traced dynamic by replay_backend.compile, the count was fixed by the model's own
    code: the error must say that, not only how to trace dynamic."""
    with pytest.raises(Exception, match=r"static token count.*the model itself fixed the count.*unbind"):
        serve_against_eager(UnbindRows)


class WeightView(Model):  # a weight's transpose made before the region: the weight's own memory
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Parameter(torch.randn(16, 16) * 0.1)

    def tail(self, x, positions):
        wt = self.proj.t()
        x, p = replay_begin(x, positions, window=W)
        (x,) = replay_end(self.replay_layers(x @ wt, p))
        return x


class GappedComputed(Model):  # computed before the region, then sliced: strides with gaps
    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Parameter(torch.randn(16, 32) * 0.1)

    def tail(self, x, positions):
        w = (self.big * 2.0)[:, :16]
        x, p = replay_begin(x, positions, window=W)
        (x,) = replay_end(self.replay_layers(x @ w, p))
        return x


def test_a_view_of_a_weight_is_read_where_it_is_not_copied():
    compiled, trims = serve_against_eager(WeightView)
    assert trims >= 2 and compiled.backend.model.replay.computed_consts == ()


def test_a_held_constant_keeps_the_strides_the_region_was_compiled_for():
    """Inductor's pieces check their inputs' strides: the held copy has the traced ones."""
    compiled, trims = serve_against_eager(GappedComputed, steps=STEPS[:2], options={"compiler": "inductor"})
    assert trims >= 1 and compiled.backend.model.replay.computed_consts == (0,)


@torch.library.custom_op("contract::rowwise_hook", mutates_args=("out",))
def rowwise_hook(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(x * 2.0)


replay_backend.declare_row_local(rowwise_hook)


class HookAfter(OnePair):  # a row-local custom op after replay_end, kept eager as a splitting op
    def tail(self, x, positions):
        x = super().tail(x, positions)
        out = torch.empty_like(x)
        rowwise_hook(x, out)
        return out


def test_a_row_local_splitting_op_after_the_region_lets_it_trim():
    _, trims = serve_against_eager(HookAfter, options={
        "splitting_ops": ["gqa_rope::window_attention", "gqa_rope::full_attention", "contract::rowwise_hook"]})
    assert trims >= 2
