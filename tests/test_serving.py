"""The serving API a user's loop calls: StepSetup, capture from a setup, the step
record, the one-trace check, and the errors that name a misuse."""
from __future__ import annotations

import re
import traceback
from types import SimpleNamespace
import pytest
import torch
import torch.distributed as dist
from torch import nn

import replay_backend
from replay_backend import CacheLayout, ReplayBackend, RequestChunk, StepSetup, ViewField, counters
from replay_backend.fallbacks import StrictFallbackError
from replay_backend.reference.compare import max_abs_err
from replay_backend.reference.runner import StepRunner
from replay_backend.compat.dynamo import user_error
from replay_backend.tracing.generic import TokenCountError
import llama_swa
from llama_swa import LlamaServer, LlamaSWA
from ranks import run_ranks

from conftest import MAX_MODEL_LEN

pytestmark = pytest.mark.usefixtures("fresh_dynamo")
W = 8
OPTIONS = {"compiler": "eager", "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64],
           "decoder_replay_trim_threshold": 32, "max_num_seqs": 4, "max_num_batched_tokens": 256}


@pytest.mark.parametrize("field, value, message", [
    ("layout", (256, 8), "StepSetup.layout must be a CacheLayout"),
    ("window", 0, r"StepSetup.window must be an integer >= 1, got 0"),
    ("device", "bogus", "StepSetup.device"),
    ("view_fields", {"x": 1}, "StepSetup.view_fields must map names to ViewField"),
    ("prepare_view", 3, "StepSetup.prepare_view must be callable"),
])
def test_a_step_setup_names_the_field_it_refuses(field, value, message):
    kw = dict(layout=CacheLayout(256, 8), window=W, kv=object())
    with pytest.raises(ValueError, match=message):
        StepSetup(**{**kw, field: value})


def test_a_setup_must_agree_with_the_traced_window_and_with_the_one_already_given():
    model = LlamaSWA(window=W).eval()
    compiled = replay_backend.compile(model, ("input_ids", "positions"), options=OPTIONS)
    server = LlamaServer(model, compiled)
    with pytest.raises(RuntimeError, match=r"build_batch\(\) needs the model's StepSetup"):
        compiled.build_batch([RequestChunk("a", 3, 3)], [[1, 2, 3]], [0])
    server.warm_up()
    wrong = StepSetup(server.layout, W * 2, server.cache)
    with pytest.raises(ValueError, match=r"StepSetup.window=16 differs from the window W=8"):
        compiled.capture(wrong)
    compiled.capture(server.setup)
    other = StepSetup(server.layout, W, LlamaServer(model).cache)  # another cache
    with pytest.raises(ValueError, match="a different StepSetup"):
        compiled.start_serving(other)
    compiled.start_serving(StepSetup(server.layout, W, server.cache))  # equal: accepted


def test_capture_needs_a_step_first_and_says_so():
    model = LlamaSWA(window=W).eval()
    compiled = replay_backend.compile(model, ("input_ids", "positions"), options=OPTIONS)
    server = LlamaServer(model, compiled)
    with pytest.raises(RuntimeError, match=r"capture\(\) while tracing: run one step"):
        compiled.capture(server.setup)


@pytest.mark.parametrize("strict", [False, True])
def test_a_view_field_without_a_bound_is_a_counted_fallback_for_the_metadata_buffer(strict):
    """Served batches go to one fixed buffer sized from every field's bound: a field
    without one means fresh memory per step (counted), or an error under strict."""
    model = LlamaSWA(window=W).eval()
    compiled = replay_backend.compile(model, ("input_ids", "positions"), options={**OPTIONS, "strict": strict})
    server = LlamaServer(model, compiled)
    fields = {"row_ids": ViewField(lambda q, s, k, b, w: torch.arange(q[-1]))}  # no max_rows
    server.setup = StepSetup(server.layout, W, server.cache, view_fields=fields)
    server.warm_up()
    if strict:
        with pytest.raises(StrictFallbackError, match="metadata_in_place: .*ViewField 'row_ids' has no max_rows"):
            compiled.capture(server.setup)
        return
    with counters.expect(strict=False, fallbacks={"metadata_in_place": 1}):
        compiled.capture(server.setup)
    compiled.start_serving()
    assert compiled.backend.metadata is None
    got, result = server.step([RequestChunk("a", 40, 40)])
    want, _ = LlamaServer(model).step([RequestChunk("a", 40, 40)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert result.trimmed


class EvenOnly(nn.Module):
    """Pairs the token rows up: the traced graph holds only for even token counts."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pairs = x.reshape(x.shape[0] // 2, 2, 8)
        return self.w(pairs.flip(1).reshape(x.shape[0], 8))


def test_a_trace_that_holds_only_for_some_token_counts_is_refused_naming_its_guard():
    compiled = replay_backend.compile(EvenOnly(), ("x",), options={"compiler": "eager"})
    with pytest.raises(Exception) as info, torch.no_grad():
        compiled(torch.randn(6, 8))
    err = info.value
    assert isinstance(user_error(err), TokenCountError), err
    assert "holds only for some token counts" in str(err) and "fails at 3 tokens" in str(err)
    assert "test_serving.py" in str(err)  # the line that made the guard


class GroupedProjection(nn.Module):
    """A grouped projection as one batched matmul over groups, its product reshaped from
    the transposed rows: traced on one token, the reshape's choice of a view leaves a
    guard that holds at one token only."""

    def __init__(self, copy_rows: bool) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, 4, 3))
        self.copy_rows = copy_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        o = torch.bmm(x.view(x.shape[0], 2, 4).transpose(0, 1), self.w).transpose(0, 1)
        if self.copy_rows:
            o = o.clone(memory_format=torch.contiguous_format)
        return o.reshape(x.shape[0], -1)


def test_a_trace_on_one_token_that_holds_there_only_names_the_copy_that_fixes_it():
    with pytest.raises(Exception) as info, torch.no_grad():
        replay_backend.compile(GroupedProjection(False), ("x",), options={"compiler": "eager"})(torch.randn(1, 8))
    assert isinstance(user_error(info.value), TokenCountError), info.value
    assert "fails at 2 tokens" in str(info.value) and "holds at one token only" in str(info.value)
    assert "clone(memory_format=torch.contiguous_format)" in str(info.value)
    model = GroupedProjection(True)
    compiled = replay_backend.compile(model, ("x",), options={"compiler": "eager"})
    with torch.no_grad():
        for t in (1, 2, 5):
            x = torch.randn(t, 8)
            torch.testing.assert_close(compiled(x), model(x))


class MarkedProjection(GroupedProjection):
    """The grouped projection feeding replay layers: traced on one token, the token
    dimension is fixed to 1 before the passes read the graph."""

    def __init__(self) -> None:
        super().__init__(False)
        self.v = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (o,) = replay_backend.replay_begin(super().forward(x), window=4)
        (o,) = replay_backend.replay_end(self.v(o))
        return o


def test_a_trace_that_holds_for_one_token_only_is_refused_before_the_passes_count_fallbacks():
    """The passes would read a token dimension fixed to 1 as no token dimension, and
    count fallbacks (region unsupported, padding unsafe) for a build that then fails:
    the check comes first, and only its error is raised."""
    with counters.expect(strict=False, fallbacks={}), pytest.raises(Exception) as info, torch.no_grad():
        replay_backend.compile(MarkedProjection(), ("x",), options={"compiler": "eager"})(torch.randn(1, 8))
    assert isinstance(user_error(info.value), TokenCountError), info.value


def test_bare_torch_compile_with_a_one_token_first_step_names_the_fix():
    model = LlamaSWA(window=W).eval()
    compiled = torch.compile(model, backend="dsv41_replay", dynamic=True, options=OPTIONS)
    server = LlamaServer(model)
    batch = server.setup.dummy_batch(1)
    with pytest.raises(Exception, match="first step of at least 2 tokens"):
        with replay_backend.set_forward_context(server.setup.context(batch)), torch.no_grad():
            compiled(batch.input_ids, batch.positions)


def _served_bare(model, capture: bool = True):
    """``model`` compiled with bare torch.compile, traced on one step of W tokens, and
    serving (its graphs captured first, or not); returns the compiled model, its server
    and the traced step's batch."""
    compiled = torch.compile(model, backend="dsv41_replay", dynamic=True, options=OPTIONS)
    server = LlamaServer(model)
    batch = server.setup.dummy_batch(W)
    _step(compiled, server, batch)
    be = replay_backend.backend_of(compiled)
    if capture:
        be.capture(server.setup)
    be.start_serving(server.setup)
    return compiled, server, batch


def _step(compiled, server, batch, positions=None):
    with replay_backend.set_forward_context(server.setup.context(batch)), torch.no_grad():
        return compiled(batch.input_ids, batch.positions if positions is None else positions)


def test_a_served_call_out_of_context_or_grad_mode_names_the_cause():
    """Bare torch.compile serves through Dynamo's guards: a call outside the forward
    context is named as such, and one with grad mode on would trace anew: the error
    says why."""
    compiled, server, batch = _served_bare(LlamaSWA(window=W).eval())
    with pytest.raises(RuntimeError, match="no forward context is set"):
        with torch.no_grad():
            compiled(batch.input_ids, batch.positions)
    with pytest.raises(Exception, match="traced with grad mode off and is now called with it on"):
        with replay_backend.set_forward_context(server.setup.context(batch)):
            compiled(batch.input_ids, batch.positions)


def test_a_served_model_traced_again_after_dynamo_reset_names_the_reset():
    """Whatever else the process compiles after the reset, before the model's call:
    Dynamo numbers the frames it compiles in one count, restarted by the reset."""
    compiled, server, batch = _served_bare(LlamaSWA(window=W).eval())
    torch._dynamo.reset()
    torch.compile(lambda x: x + 1, backend="eager")(torch.ones(2))
    torch.compile(lambda x: x - 1, backend="eager")(torch.ones(2))
    with pytest.raises(Exception, match=r"recompile after warm-up \(while serving\): .*torch._dynamo.reset\(\)"):
        _step(compiled, server, batch)


class Branchy(LlamaSWA):
    """Branches on a buffer's value: a graph break, each branch's code its own frame."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.register_buffer("switch", torch.tensor(1.0))

    def forward(self, input_ids, positions):
        if self.switch > 0:
            return super().forward(input_ids, positions)
        return super().forward(input_ids, positions)


@pytest.mark.parametrize("how, cause", [
    ("branch", r"Dynamo reached code it had not compiled before: another path after a graph break"),
    ("dtype", r"one of Dynamo's guards failed"),
])
def test_a_served_model_traced_again_names_a_graph_break_or_a_failed_guard(how, cause):
    """Neither is taken for a reset: the other branch is a frame Dynamo never compiled,
    an int32 position tensor a guard of the traced frame."""
    model = Branchy(window=W).eval()
    with counters.expect(strict=False, recompiles=0):  # the code after the break is no recompile
        compiled, server, batch = _served_bare(model, capture=False)
    positions = batch.positions
    if how == "branch":
        model.switch.fill_(-1.0)
    else:
        positions = positions.to(torch.int32)
    with pytest.raises(Exception, match=r"recompile after warm-up \(while serving\): " + cause):
        _step(compiled, server, batch, positions)


def test_prompt_logprobs_of_a_keep_all_request_in_a_trimming_step_match_the_oracle(model):
    """A request asking for prompt logprobs keeps all its rows and is never trimmed: in
    a step that trims its neighbour, each of its rows' log-probability of the next
    prompt token equals the eager model's."""
    be = ReplayBackend(compiler="eager", max_num_seqs=4, max_cudagraph_capture_size=64,
                       decoder_replay_trim_threshold=48)
    rc = StepRunner(model, max_model_len=MAX_MODEL_LEN, max_num_seqs=4, backend=be)
    ro = StepRunner(model, max_model_len=MAX_MODEL_LEN, max_num_seqs=4)
    rc.capture()
    for step in ([RequestChunk("k", 30, 30, keep_all=True), RequestChunk("p", 30, 30)],  # graphed, trims
                 [RequestChunk("k", 20, 50, keep_all=True), RequestChunk("q", 60, 60)]):  # eager, trims
        got, want = rc.step(step), ro.step(step)
        assert got.result.trimmed and got.batch.replay.num_rows < got.batch.num_tokens
        assert set(got.prompt_logprobs) == {"k"} and got.prompt_logprobs["k"].shape == (step[0].query_len,)
        assert max_abs_err(got.prompt_logprobs["k"], want.prompt_logprobs["k"]) < 1e-4
        assert (got.prompt_logprobs["k"] <= 0).all() and torch.isfinite(got.prompt_logprobs["k"]).all()


def test_the_step_result_is_public_and_reachable_after_each_step(model):
    be = ReplayBackend(compiler="eager", max_num_seqs=4, max_cudagraph_capture_size=64,
                       decoder_replay_trim_threshold=48)
    rc = StepRunner(model, max_model_len=MAX_MODEL_LEN, max_num_seqs=4, backend=be)
    rc.capture()
    out = rc.step([RequestChunk("a", 1, 1)])
    result = out.result
    assert result == rc.compiled.last_step == be.last_step
    assert (result.kind, result.num_tokens, result.padded_tokens) == (replay_backend.StepKind.PIECEWISE, 1, 1)
    assert result.as_dict()["kind"] == "piecewise" and result.as_dict()["replay_graph"] is True


def _served_llama(**options):
    model = LlamaSWA(window=W).eval()
    compiled = replay_backend.compile(model, ("input_ids", "positions"), options={**OPTIONS, **options})
    server = LlamaServer(model, compiled)
    server.serve()
    return model, server, compiled


def test_a_stale_batch_is_refused_by_the_compiled_model_itself():
    """A batch whose metadata a later build overwrote: any serving loop, not only the
    reference runner's, gets the error instead of another request's step."""
    model, server, compiled = _served_llama()
    first = compiled.build_batch([RequestChunk("a", 3, 3)], [[1, 2, 3]], [0])
    compiled.build_batch([RequestChunk("b", 3, 3)], [[7, 8, 9]], [1])
    with pytest.raises(RuntimeError, match="stale StepBatch"), torch.no_grad():
        with replay_backend.set_forward_context(server.setup.context(first)):
            compiled(first.input_ids, first.positions)


@pytest.mark.parametrize("mode", ["piecewise", "none"])
def test_token_inputs_of_another_batch_than_the_contexts_are_refused_naming_both(mode):
    """Inputs of 6 rows under the context of a 1-token batch: attention would write
    that batch's one slot while the step reports 6 tokens."""
    model, server, compiled = _served_llama(cudagraph_mode=mode)
    server.step([RequestChunk("a", 10, 10), RequestChunk("b", 5, 5)])
    big = compiled.build_batch([RequestChunk("a", 3, 13), RequestChunk("b", 3, 8)], [[1, 2, 3], [4, 5, 6]], [0, 1])
    ids, pos = big.input_ids.clone(), big.positions.clone()
    small = compiled.build_batch([RequestChunk("a", 1, 11)], [[5]], [0])
    before = compiled.last_step
    with pytest.raises(ValueError, match="the token inputs have 6 rows, the forward context's batch 1 tokens"):
        with torch.no_grad(), replay_backend.set_forward_context(server.setup.context(small)):
            compiled(ids, pos)
    assert compiled.last_step == before  # no step ran


class CountingLlama(LlamaSWA):
    """A model with a 0-dim buffer it updates in place every step, which its output
    reads: a step counter."""

    def __init__(self) -> None:
        super().__init__(window=W)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, input_ids, positions):
        self.steps.add_(1)
        (x,) = super().forward(input_ids, positions)
        return (x + 0.01 * self.steps,)


def test_a_zero_dim_buffer_updated_in_place_is_updated_by_every_graphed_step():
    """A 0-dim buffer is not a Python number Dynamo passes afresh: a graphed step must
    update the buffer itself, not a per-step copy of it."""
    model = CountingLlama().eval()
    compiled = replay_backend.compile(model, ("input_ids", "positions"), options=OPTIONS)
    server = LlamaServer(model, compiled)
    server.serve()
    oracle = LlamaServer(CountingLlama().eval())
    oracle.model.load_state_dict(model.state_dict())
    kinds = set()
    for step in ([RequestChunk("a", 20, 20)], [RequestChunk("a", 1, 21)], [RequestChunk("b", 100, 100)],
                 [RequestChunk("a", 3, 24), RequestChunk("b", 1, 101)]):
        got, result = server.step(step)
        want, _ = oracle.step(step)
        kinds.add(result.kind)
        assert model.steps.item() == oracle.model.steps.item()
        assert max_abs_err(got, want) <= 1e-5, (step, result)
    assert kinds == {replay_backend.StepKind.PIECEWISE, replay_backend.StepKind.EAGER}


class ScaledLlama(CountingLlama):
    """A step counter, and a Python number argument the output reads."""

    def forward(self, input_ids, positions, scale: float):
        (x,) = super().forward(input_ids, positions)
        return (x * scale,)


class NumberLlama(LlamaSWA):
    """The Llama model with one Python number more in its call, which ``front(x, a)``
    applies to the embeddings and ``replay(x, a)`` to each replay layer's output (each
    subclass's forward names the argument, as Dynamo names its graph input)."""

    def __init__(self) -> None:
        super().__init__(window=W)

    @staticmethod
    def front(x, a):
        return x

    @staticmethod
    def replay(x, a):
        return x

    def _forward(self, input_ids, positions, a):
        x = self.front(self.embed(input_ids) + self.pos(positions), a)
        for layer in self.layers[:self.replay_from]:
            x = layer(x)
        (x,) = replay_backend.replay_begin(x, window=self.window)
        for layer in self.layers[self.replay_from:]:
            x = self.replay(layer(x), a)
        (x,) = replay_backend.replay_end(x)
        return (self.norm(x),)


class RegionScaledLlama(NumberLlama):
    """A Python number argument read inside the replay layers: the replay region's
    graphs take it as an input of their own."""

    @staticmethod
    def replay(x, scale):
        return x * scale

    def forward(self, input_ids, positions, scale: float):
        return self._forward(input_ids, positions, scale)


class UnpaddedRegionScaledLlama(RegionScaledLlama):
    """The same, with the token count read as a value: its main graphs are refused
    (padding would change it), so every warm-up step runs eagerly while the region is
    still captured, on what the trim op kept of the last of them."""

    @staticmethod
    def front(x, scale):
        return x + x.shape[0] * 1e-3


# (requests, scale, kind, whether the replay region ran graphs, whether a number_changed
# fallback is counted: another scale than the trace's 1.0 where a graph would have run)
NUMBER_STEPS = [
    (ScaledLlama, [([RequestChunk("a", 20, 20)], 1.0, "piecewise", True, False),
                   ([RequestChunk("a", 1, 21)], 0.5, "eager", False, True),
                   ([RequestChunk("a", 1, 22)], 1.0, "piecewise", True, False),
                   # above every graph and nothing to trim: no graph would run, nothing lost
                   ([RequestChunk("k", 100, 100, keep_all=True)], 0.5, "eager", False, False)]),
    # 100 tokens: above every main graph, so the main layers run eagerly while the
    # region runs its replay graph on the kept rows, reading the number too.
    (RegionScaledLlama, [([RequestChunk("b", 100, 100)], 1.0, "eager", True, False),
                         ([RequestChunk("a", 20, 20)], 1.0, "piecewise", True, False),
                         ([RequestChunk("c", 100, 100)], 2.0, "eager", False, True),
                         ([RequestChunk("a", 1, 21)], 3.0, "eager", False, True),
                         ([RequestChunk("a", 1, 22)], 1.0, "piecewise", True, False)]),
    (UnpaddedRegionScaledLlama, [([RequestChunk("a", 20, 20)], 1.0, "eager", True, False),
                                 ([RequestChunk("b", 20, 20)], 2.0, "eager", False, True),
                                 ([RequestChunk("c", 20, 20)], 1.0, "eager", True, False)]),
    # an int argument: Dynamo passes it as a symbolic int, not the token count
    (ScaledLlama, [([RequestChunk("a", 20, 20)], 1, "piecewise", True, False),
                   ([RequestChunk("a", 1, 21)], 3, "eager", False, True),
                   ([RequestChunk("b", 9, 9)], 1, "piecewise", True, False)]),
]


def serve_numbers(cls, steps, device: str = "cpu", compiler: str = "eager", tol: float = 1e-5,
                  dp_group=None, fallbacks: dict | None = None) -> None:
    """``steps`` of ``cls`` under plain ``torch.compile(dynamic=True)`` on ``device``,
    each against the eager model: its kind, whether its region ran graphs, its logits,
    and the fallbacks counted (``fallbacks``; by default the ``number_changed`` ones the
    steps say). ``dp_group``: served as one data-parallel rank of it."""
    model, oracle = cls().to(device).eval(), cls().to(device).eval()
    compiled = torch.compile(model, backend=ReplayBackend(**{**OPTIONS, "compiler": compiler}, dp_group=dp_group),
                             dynamic=True)
    server, eager = LlamaServer(model), LlamaServer(oracle)
    serving = []

    def step(fn, requests, scale, use_graphs=True):
        blocks = [server.block(r.req_id) for r in requests]
        tokens = [server.tokens(r) for r in requests]
        on = server if fn is compiled else eager
        be = replay_backend.backend_of(compiled) if fn is compiled and serving else None
        batch = (be.build_batch(requests, tokens, blocks) if be is not None else
                 replay_backend.build_step_batch(requests, tokens, blocks, server.layout, W, device))
        with torch.no_grad(), replay_backend.set_forward_context(on.setup.context(batch, use_graphs=use_graphs)):
            (hidden,) = fn(batch.input_ids, batch.positions, scale)
        return hidden[batch.logits_indices], (be.last_step if be is not None else None)

    # The trace, at 1 (or 1.0), without graphs as a server's warm-up runs it: what the
    # trim op keeps of it is what capture's replay graphs are captured on.
    step(compiled, [RequestChunk("w", 9, 9)], type(steps[0][1])(1), use_graphs=False)
    be = replay_backend.backend_of(compiled)
    be.capture(server.setup)
    be.start_serving()
    serving.append(True)
    oracle.load_state_dict(model.state_dict())
    if fallbacks is None:
        fallbacks = {"number_changed": sum(counted for *_, counted in steps)}
    with counters.expect(strict=False, fallbacks=fallbacks):
        for k, (requests, scale, kind, region_graphs, _) in enumerate(steps):
            got, result = step(compiled, requests, scale)
            want, _ = step(oracle, requests, scale)
            assert (result.kind.value, result.replay_padded is not None) == (kind, region_graphs), (k, result)
            assert max_abs_err(got, want) <= tol, (k, result)
            if cls is ScaledLlama:
                assert model.steps.item() == oracle.steps.item()


@pytest.mark.parametrize("cls, steps", NUMBER_STEPS)
def test_a_python_number_runs_in_graphs_only_at_the_value_they_hold(cls, steps, caplog):
    """Under plain ``torch.compile(dynamic=True)`` a float argument reaches the graph
    as a fresh host tensor per call, which a captured graph holds by value (a kernel
    argument, or ``.item()``). Graphs run at the first call's value only, pinned in one
    tensor that every graph reads (an eager step's replay graph too); a step with
    another value runs without graphs, a counted fallback. Every step matches the
    eager model, and a 0-dim buffer is still updated in place. The fallback names the
    input as traced, and both values."""
    with caplog.at_level("WARNING", logger="replay_backend"):
        serve_numbers(cls, steps)
    assert re.search(r"\[number_changed\].*\(input \d+ \(\w*scale\w*\): 1(\.0)? -> ", caplog.text), caplog.text


@pytest.mark.parametrize("cls, steps", NUMBER_STEPS)
def test_a_python_number_stays_an_input_of_inductor_pieces(cls, steps):
    """The same steps with Inductor pieces. Inductor turns a float's arithmetic into
    tensor ops where it sees the float read from its 0-dim tensor; compiling one piece at
    a time it once took the float for one it could not and restarted Dynamo with the
    value baked in, so another value was a recompile, refused while serving. The float
    stays an input of the graphs, and another value is a step without graphs."""
    serve_numbers(cls, steps, compiler="inductor", tol=1e-4)


def _numbers_over_ranks(rank: int, world: int) -> None:
    """Rank 1 calls its second and fourth steps with another number; rank 0 does not.
    The fourth step is above every graph, so rank 0 loses no graph there."""
    scale = 0.5 if rank == 1 else 1.0
    steps = [([RequestChunk("a", 20, 20)], 1.0, "piecewise", True, False),
             ([RequestChunk("a", 1, 21)], scale, "eager", False, rank == 1),
             ([RequestChunk("a", 1, 22)], 1.0, "piecewise", True, False),
             ([RequestChunk("k", 100, 100, keep_all=True)], scale, "eager", False, rank == 1)]
    fallbacks = {"number_changed": 2} if rank == 1 else {"peer_fallback": 1}
    serve_numbers(ScaledLlama, steps, dp_group=dist.new_group([0, 1], backend="gloo"), fallbacks=fallbacks)


def test_a_rank_that_falls_back_makes_every_rank_fall_back_counted_on_each():
    """Data-parallel ranks run one step kind: the rank whose number changed runs its
    step without graphs, so every rank does, and each counts it where a graph would
    have run, the others as a ``peer_fallback``; every step matches the eager model."""
    run_ranks(_numbers_over_ranks, 2, timeout=240)


@torch.library.custom_op("test_serving::scaled_window_attention", mutates_args=("out",))
def scaled_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer: int,
                            window: int, scale: float) -> None:
    llama_swa._attention(q, k, v, out, layer, window)
    out.mul_(scale)


@scaled_window_attention.register_fake
def _(q, k, v, out, layer, window, scale):
    return None


replay_backend.declare_attention(scaled_window_attention)


class AttentionScaleLlama(NumberLlama):
    """A constant float attribute of each replay layer passed to its attention op (a
    softmax scale, say): the trace fixes it, as any float an op's float argument takes."""

    def __init__(self) -> None:
        super().__init__()
        for layer in self.layers:
            layer.scale = 0.75

    def replay_layer(self, layer, x):
        q, k, v = layer.qkv(layer.attn_norm(x)).view(x.shape[0], 3, layer.heads, -1).unbind(1)
        out = torch.empty_like(q)
        scaled_window_attention(q, k, v, out, layer.layer, layer.window, layer.scale)
        x = x + layer.o(out.flatten(1))
        gate, up = layer.up(layer.mlp_norm(x)).chunk(2, dim=-1)
        return x + layer.down(nn.functional.silu(gate) * up)

    def forward(self, input_ids, positions, scale: float):
        x = self.embed(input_ids) + self.pos(positions)
        for layer in self.layers[:self.replay_from]:
            x = layer(x)
        (x,) = replay_backend.replay_begin(x, window=self.window)
        for layer in self.layers[self.replay_from:]:
            x = self.replay_layer(layer, x)
        (x,) = replay_backend.replay_end(x)
        return (self.norm(x),)


def test_a_float_an_attention_op_takes_is_baked_in_with_inductor_pieces():
    """A float that an op's float argument takes is fixed by the trace. Inductor's
    pieces, each compiled on its own, once took it for a float every piece had settled,
    and the first call failed inside Inductor; it is now baked in as the trace fixed it."""
    steps = [([RequestChunk("a", 20, 20)], 1.0, "piecewise", True, False),
             ([RequestChunk("a", 1, 21)], 1.0, "piecewise", True, False),
             ([RequestChunk("c", 100, 100)], 1.0, "eager", True, False)]
    serve_numbers(AttentionScaleLlama, steps, compiler="inductor", tol=1e-4)


class IntRegionLlama(NumberLlama):
    """A Python int argument read inside the replay layers."""

    @staticmethod
    def replay(x, n):
        return x + n * 1e-3

    def forward(self, input_ids, positions, n: int):
        return self._forward(input_ids, positions, n)


def test_an_int_argument_read_in_the_replay_layers_is_a_fallback_that_says_what_to_do(caplog):
    """Under dynamic=True the int is symbolic, and the trim op hands the region tensors
    only: no region (a counted fallback) whose reason names the int and the way out,
    rather than calling it a token-indexed value; the steps are still right."""
    model = IntRegionLlama().eval()
    compiled = torch.compile(model, backend="dsv41_replay", dynamic=True, options=OPTIONS)
    server = LlamaServer(model)
    step = [RequestChunk("a", 20, 20)]
    batch = replay_backend.build_step_batch(step, [server.tokens(r) for r in step], [0], server.layout, W, "cpu")
    with counters.expect(strict=False, fallbacks={"replay_region_unsupported": 1}), \
            caplog.at_level("WARNING", logger="replay_backend"), torch.no_grad(), \
            replay_backend.set_forward_context(server.setup.context(batch)):
        (got,) = compiled(batch.input_ids, batch.positions, 3)
        (want,) = model(batch.input_ids, batch.positions, 3)
    assert "reads l_n_, a Python number the model is called with" in caplog.text, caplog.text
    assert max_abs_err(got, want) <= 1e-5


class SlicedLlama(NumberLlama):
    """A Python int argument that slices the hidden dimension: Dynamo's guards on the
    slice relate the token count to the int."""

    @staticmethod
    def front(x, n):
        return torch.cat([x[:, :n] * 1.5, x[:, n:]], dim=1)

    def forward(self, input_ids, positions, n: int):
        return self._forward(input_ids, positions, n)


def test_a_guard_relating_the_token_count_to_an_int_argument_is_checked_at_its_value():
    """The int is pinned at its traced value, so a guard on the token count times it is
    checked for every token count at that value, not refused as unknowable; every
    step matches the eager model."""
    model = SlicedLlama().eval()
    compiled = torch.compile(model, backend="dsv41_replay", dynamic=True, options=OPTIONS)
    server = LlamaServer(model)
    for k, step in enumerate(([RequestChunk("a", 20, 20)], [RequestChunk("a", 1, 21)], [RequestChunk("b", 100, 100)])):
        blocks = [server.block(r.req_id) for r in step]
        batch = replay_backend.build_step_batch(step, [server.tokens(r) for r in step], blocks, server.layout, W,
                                                "cpu")
        with torch.no_grad(), replay_backend.set_forward_context(server.setup.context(batch)):
            (got,) = compiled(batch.input_ids, batch.positions, 3)
            (want,) = model(batch.input_ids, batch.positions, 3)
        rows = batch.logits_indices  # the rows a trimmed step computes for its caller
        assert max_abs_err(got[rows], want[rows]) <= 1e-5, k


def test_a_first_call_on_views_into_larger_tensors_is_refused_naming_the_input():
    """Token inputs sliced from larger buffers on the tracing call trace their storage
    offset as a symbol of its own, which the split cannot bind: one clear error naming
    the input and the way out, and the same call with tensors of their own serves."""
    model = LlamaSWA(window=W).eval()
    server = LlamaServer(model)
    step = [RequestChunk("a", 20, 20)]
    batch = replay_backend.build_step_batch(step, [server.tokens(r) for r in step], [0], server.layout, W, "cpu")
    pad = torch.zeros(7, dtype=torch.int64)
    ids, pos = (torch.cat([pad, x])[7:] for x in (batch.input_ids, batch.positions))
    compiled = replay_backend.compile(model, ("input_ids", "positions"), options=OPTIONS)
    with pytest.raises(Exception) as info, torch.no_grad(), \
            replay_backend.set_forward_context(server.setup.context(batch)):
        compiled(ids, pos)
    assert re.search(r"graph input \d+ \(\w*input_ids\w*\) was traced as a view into a larger tensor \(storage "
                     r"offset s\d+ symbolic\).*\.clone\(\)", str(user_error(info.value))), info.value
    compiled = replay_backend.compile(model, ("input_ids", "positions"), options=OPTIONS)
    with torch.no_grad(), replay_backend.set_forward_context(server.setup.context(batch)):
        (got,) = compiled(ids.clone(), pos.clone())
        (want,) = model(batch.input_ids, batch.positions)
    rows = batch.logits_indices
    assert max_abs_err(got[rows], want[rows]) <= 1e-5


class GatedLlama(LlamaSWA):
    """A tensor argument the output reads: a per-step gate."""

    def __init__(self) -> None:
        super().__init__(window=W)

    def forward(self, input_ids, positions, gate: torch.Tensor):
        (x,) = super().forward(input_ids, positions)
        return (x * gate,)


def test_a_new_tensor_argument_each_step_is_refused_saying_to_update_it_in_place():
    """A graph reads a tensor argument where it was at capture: a fresh tensor each
    step is refused at the first replay, naming the input and what to do (the same
    tensor updated in place), and that works, step by step against the eager model."""
    model = GatedLlama().eval()
    compiled = torch.compile(model, backend="dsv41_replay", dynamic=True, options=OPTIONS)
    server, eager = LlamaServer(model), LlamaServer(GatedLlama().eval())
    gate = torch.ones(())

    def step(requests, value, fresh: bool, fn=compiled, on=server):
        blocks = [server.block(r.req_id) for r in requests]
        tokens = [server.tokens(r) for r in requests]
        be = replay_backend.backend_of(compiled) if fn is compiled and be_serving else None
        batch = (be.build_batch(requests, tokens, blocks) if be is not None else
                 replay_backend.build_step_batch(requests, tokens, blocks, server.layout, W, "cpu"))
        arg = torch.tensor(value) if fresh else gate.copy_(torch.tensor(value))
        with torch.no_grad(), replay_backend.set_forward_context(on.setup.context(batch)):
            (hidden,) = fn(batch.input_ids, batch.positions, arg)
        return hidden[batch.logits_indices]

    be_serving = False
    step([RequestChunk("w", 9, 9)], 1.0, fresh=False)  # the trace
    be = replay_backend.backend_of(compiled)
    be.capture(server.setup)
    be.start_serving()
    be_serving = True
    with pytest.raises(RuntimeError, match=r"\(the graph input \w*gate\w*\) changed since capture .* must be the "
                       r"same tensor in every step: update it in place \(copy_\)"):
        step([RequestChunk("a", 20, 20)], 0.5, fresh=True)
    for requests, value in (([RequestChunk("b", 20, 20)], 0.5), ([RequestChunk("b", 1, 21)], 2.0)):
        got = step(requests, value, fresh=False)
        want = step(requests, value, fresh=False, fn=eager.model, on=eager)
        assert max_abs_err(got, want) <= 1e-5


def test_a_context_reused_after_a_compiled_step_still_floors_the_uncompiled_model():
    """The natural oracle check: the compiled model and the eager one in one context.
    The compiled step leaves nothing behind that turns the eager model's floor off."""
    model, server, compiled = _served_llama()
    step = [RequestChunk("a", 40, 40)]
    eager = LlamaServer(model)
    tokens = [eager.tokens(r) for r in step]
    batch = replay_backend.build_step_batch(step, tokens, [0], eager.layout, W, "cpu")
    with torch.no_grad():
        with replay_backend.set_forward_context(eager.setup.context(batch)):
            (want,) = model(batch.input_ids, batch.positions)
        ctx = eager.setup.context(batch)
        with replay_backend.set_forward_context(ctx):
            compiled(batch.input_ids, batch.positions)
            (again,) = model(batch.input_ids, batch.positions)
    assert ctx.result.trimmed
    torch.testing.assert_close(again, want, rtol=0, atol=0)


def test_a_second_instance_compiled_by_name_is_refused_not_served_the_first_ones_graphs():
    m1, m2 = LlamaSWA(window=W, seed=1).eval(), LlamaSWA(window=W, seed=2).eval()
    c1 = torch.compile(m1, backend="dsv41_replay", dynamic=True, options=OPTIONS)
    c2 = torch.compile(m2, backend="dsv41_replay", dynamic=True, options=OPTIONS)
    server = LlamaServer(m1)
    batch = server.setup.dummy_batch(W)
    with replay_backend.set_forward_context(server.setup.context(batch)), torch.no_grad():
        c1(batch.input_ids, batch.positions)
        with pytest.raises(RuntimeError, match="traced for another instance of the module"):
            c2(batch.input_ids, batch.positions)


def test_a_batch_without_the_setups_view_fields_is_refused_by_its_context():
    model = LlamaSWA(window=W).eval()
    server = LlamaServer(model)
    fields = {"rows": ViewField(lambda q, s, k, b, w: torch.zeros(1, dtype=torch.int64), max_rows=lambda t, r: 1)}
    setup = StepSetup(server.layout, W, server.cache, view_fields=fields)
    batch = replay_backend.build_step_batch([RequestChunk("a", 3, 3)], [[1, 2, 3]], [0], server.layout, W, "cpu")
    with pytest.raises(ValueError, match=r"the batch has no \['rows'\] view fields of this StepSetup"):
        setup.context(batch)


@torch.library.custom_op("serving_test::allocating_attention", mutates_args=())
def allocating_attention(q: torch.Tensor) -> torch.Tensor:
    replay_backend.get_forward_context()
    return q * 2


@allocating_attention.register_fake
def _(q):
    return torch.empty_like(q)


replay_backend.declare_attention(allocating_attention)


class Allocating(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.ops.serving_test.allocating_attention(self.a(x)))


def test_an_attention_op_that_allocates_its_output_is_named_by_the_graph_reading_it():
    model = Allocating().eval()
    compiled = replay_backend.compile(model, ("x",), options={"compiler": "eager", "cudagraph_capture_sizes": [4]})
    layout = CacheLayout(64, 2)
    setup = StepSetup(layout, 4, kv=None)
    batch = setup.dummy_batch(4)
    with torch.no_grad(), replay_backend.set_forward_context(setup.context(batch)):
        compiled(torch.randn(4, 8))  # the trace and the capture of size 4
        with pytest.raises(RuntimeError, match="an output of submod_1, the attention op "
                           "serving_test::allocating_attention, which must write into an out-argument"):
            compiled(torch.randn(4, 8))  # its first replay checks the addresses


def test_steps_after_capture_without_start_serving_are_noted_once(caplog):
    model = LlamaSWA(window=W).eval()
    compiled = replay_backend.compile(model, ("input_ids", "positions"), options=OPTIONS)
    server = LlamaServer(model, compiled)
    server.warm_up()
    compiled.capture(server.setup)
    assert compiled.phase is replay_backend.Phase.CAPTURED
    server.step([RequestChunk("a", 3, 3)])
    server.step([RequestChunk("a", 1, 4)])
    assert caplog.text.count("steps run after capture() without start_serving()") == 1


def test_token_ids_on_a_device_are_refused_naming_them():
    layout = CacheLayout(64, 2)
    with pytest.raises(ValueError, match=r"token_ids\[0\] is on meta: a step's metadata is built on the host"):
        replay_backend.build_step_batch([RequestChunk("a", 3, 3)], [torch.zeros(3, dtype=torch.int64, device="meta")],
                                        [0], layout, W, "cpu")


def test_a_window_other_than_the_markers_is_refused_before_the_compile():
    model = LlamaSWA(window=W).eval()
    server = LlamaServer(model)
    setup = StepSetup(server.layout, W * 2, server.cache)
    compiled = replay_backend.compile(model, ("input_ids", "positions"), options=OPTIONS, setup=setup)
    batch = server.setup.dummy_batch(W)
    with counters.expect(strict=False, compilations=0, pieces={}):
        with pytest.raises(Exception, match=r"StepSetup.window=16 differs from the window W=8"), torch.no_grad():
            with replay_backend.set_forward_context(server.setup.context(batch)):
                compiled(batch.input_ids, batch.positions)


def test_a_device_group_for_the_per_step_agreement_is_refused(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_backend", lambda group: "nccl")
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    with pytest.raises(ValueError, match=r"dp_group=...\): a nccl group.*backend='gloo'"):
        ReplayBackend(compiler="eager", dp_group=object())


def test_capture_tried_again_after_a_failure_captures(monkeypatch):
    """A capture that failed part-way (here in its replay stage) can be tried again."""
    model, server, compiled = None, None, None
    model = LlamaSWA(window=W).eval()
    compiled = replay_backend.compile(model, ("input_ids", "positions"), options=OPTIONS)
    server = LlamaServer(model, compiled)
    server.warm_up()
    runtime = compiled.backend.model.replay
    real = runtime.capture
    calls = []

    def failing(size, view):
        calls.append(size)
        if len(calls) == 3:
            raise RuntimeError("a capture failure")
        return real(size, view)

    monkeypatch.setattr(runtime, "capture", failing)
    with pytest.raises(RuntimeError, match="a capture failure"):
        compiled.capture(server.setup)
    assert compiled.phase is replay_backend.Phase.WARMING
    compiled.capture(server.setup)
    compiled.start_serving()
    got, result = server.step([RequestChunk("a", 40, 40)])
    want, _ = LlamaServer(model).step([RequestChunk("a", 40, 40)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arg, what", [(5, "int"), (torch.tensor(3.0), "a 0-dim tensor")])
def test_mark_token_dims_refuses_what_has_no_token_dimension(arg, what):
    with pytest.raises(ValueError, match=f"mark_token_dims: argument 1 must be a tensor .*got {what}"):
        replay_backend.mark_token_dims(torch.zeros(3, dtype=torch.int64), arg)


def test_a_guard_torch_recorded_without_a_model_line_says_so():
    """A guard Inductor added (its lowering, or its cache replaying an earlier compile's
    guards) has no line of the model: its message says torch made it, instead of naming
    torch's frame as if it were the model's line."""
    import sympy
    from torch.fx.experimental.symbolic_shapes import SLoc

    from replay_backend.compat import shapes

    s0 = sympy.Symbol("s0", integer=True, positive=True)
    frame = traceback.FrameSummary("/site-packages/torch/_inductor/codecache.py", 42, "load")
    env = SimpleNamespace(guards=[SimpleNamespace(expr=sympy.Eq(s0 % 2, 0), sloc=SLoc(frame, None)),
                                  SimpleNamespace(expr=sympy.Eq(s0 % 3, 0), sloc=SLoc(frame, "model.py:7 in forward"))],
                          backed_var_to_val={s0: 6})
    inductor, model = shapes.token_guards(env, {s0})
    assert inductor.where.startswith("by torch itself, at ") and "codecache.py" in inductor.where
    assert "no line of the model" in inductor.where and not inductor.holds(3) and inductor.holds(4)
    assert model.where.startswith("at model.py:7 in forward")
