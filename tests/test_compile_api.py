"""torch.compile as users call it: one backend state per torch.compile call,
the token dimension dynamic from the first call, and the lifecycle in order."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import replay_backend
from replay_backend import Phase, backend_of, counters

pytestmark = pytest.mark.usefixtures("fresh_dynamo")
EAGER = {"compiler": "eager", "cudagraph_mode": "none"}


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(8, 8)

    def forward(self, x, positions):
        return (self.proj(x) + positions[:, None].float(),)


def _inputs(n: int):
    return torch.randn(n, 8), torch.arange(n)


@torch.no_grad()
def test_the_helper_traces_once_from_a_one_token_first_call():
    model = Toy().eval()
    compiled = replay_backend.compile(model, ("x", "positions"), options=EAGER)
    with counters.expect(strict=False, graphs_seen=1, recompiles=0):
        for n in (1, 5, 2, 1, 17):
            x, p = _inputs(n)
            torch.testing.assert_close(compiled(x, p)[0], model(x, p)[0])
    assert compiled.phase is Phase.WARMING and len(compiled.backend.compiled) == 1


@torch.no_grad()
def test_torch_compile_by_name_keeps_one_backend_per_call_and_counts_recompiles():
    model = Toy().eval()
    first = torch.compile(model, backend="dsv41_replay", options=EAGER)
    # another class: Dynamo shares one class's compiled code between its instances
    other = torch.compile(nn.Sequential(nn.Linear(8, 8)).eval(), backend="dsv41_replay", options=EAGER)
    with counters.expect(strict=False, graphs_seen=3, recompiles=1):
        first(*_inputs(3))  # static on the first call (Dynamo's default) ...
        first(*_inputs(6))  # ... then dynamic: a second graph of the same call
        other(_inputs(4)[0])  # another torch.compile call: a backend of its own
    be = backend_of(first)
    assert len(be.compiled) == 2 and len(backend_of(other).compiled) == 1 and be is not backend_of(other)
    be.start_serving()
    with pytest.raises(Exception, match="recompile after warm-up"):
        first(torch.randn(3, 8, dtype=torch.float64), torch.arange(3))


@torch.no_grad()
def test_backend_of_finds_the_backend_object_torch_compile_was_given():
    be = replay_backend.ReplayBackend(**EAGER)
    compiled = torch.compile(Toy().eval(), backend=be, dynamic=True)
    assert backend_of(compiled) is be  # before any step too: the object was given
    compiled(*_inputs(4))
    assert backend_of(compiled) is be and len(be.compiled) == 1


def test_backend_of_names_what_is_missing():
    with pytest.raises(ValueError, match="no dsv41_replay backend state"):
        backend_of(torch.compile(Toy(), backend="dsv41_replay"))  # compiled lazily: nothing yet


@torch.no_grad()
def test_lifecycle_steps_out_of_order_are_clear_errors():
    compiled = replay_backend.compile(Toy().eval(), ("x", "positions"), options=EAGER)
    with pytest.raises(RuntimeError, match=r"capture\(\) while tracing: run one step"):
        compiled.capture(lambda n: None, lambda n: None)
    with pytest.raises(RuntimeError, match=r"start_serving\(\) while tracing"):
        compiled.start_serving()
    compiled(*_inputs(4))
    with pytest.raises(RuntimeError, match=r"capture\(\) needs a forward context"):
        compiled.capture(lambda n: None, lambda n: None)
    assert compiled.phase is Phase.WARMING  # nothing half-done
    compiled.start_serving()
    compiled.start_serving()  # again: already serving, nothing to do
    with pytest.raises(RuntimeError, match=r"capture\(\) while serving"):
        compiled.capture(lambda n: None, lambda n: None)
    compiled(*_inputs(9))  # served steps of other sizes: the one dynamic graph


def test_the_helper_checks_its_arguments_before_any_trace():
    with pytest.raises(ValueError, match="unknown dsv41_replay option"):
        replay_backend.compile(Toy(), ("x",), options={"bogus": 1})
    with pytest.raises(ValueError, match="'ids' is not an argument of Toy.forward"):
        replay_backend.compile(Toy(), ("ids",))
    compiled = replay_backend.compile(Toy(), ("x", "positions"), options=EAGER)
    with pytest.raises(ValueError, match="disagree on the token count"):
        compiled(torch.randn(3, 8), torch.arange(4))


def test_the_replay_rows_of_the_documented_example():
    from replay_backend import RequestChunk, replay_rows_for

    step = [RequestChunk("a", 1, 700), RequestChunk("b", 250, 250), RequestChunk("c", 60, 260)]
    rows = replay_rows_for(step, 128)
    assert rows.rows == (0, *range(123, 251), *range(251, 311)) and rows.num_rows == 189
    assert rows.query_start_loc == (0, 1, 129, 189)
    assert rows.kv_start == (0, 122, 0)
    assert rows.positions == (699, *range(122, 250), *range(200, 260))
    per_token = torch.arange(311) * 10
    assert rows.take(per_token).tolist() == [10 * r for r in rows.rows]
    keep = replay_rows_for([RequestChunk("b", 250, 250, keep_all=True)], 128)
    assert keep.rows == tuple(range(250)) and keep.kv_start == (0,)
    later = replay_rows_for([RequestChunk("b", 250, 900, kv_start=800)], 128)
    assert later.kv_start == (800,) and later.positions == tuple(range(772, 900))


def test_the_lifecycle_refuses_every_transition_out_of_order():
    from replay_backend.lifecycle import Lifecycle

    life = Lifecycle()
    with pytest.raises(RuntimeError, match="cannot go from tracing to serving"):
        life.advance(Phase.SERVING)
    for phase in (Phase.WARMING, Phase.CAPTURING_MAIN, Phase.CAPTURING_REPLAY, Phase.SERVING):
        life.advance(phase)
    for phase in Phase:
        with pytest.raises(RuntimeError, match="cannot go from serving"):
            life.advance(phase)
    assert life.serving and not life.may_capture
