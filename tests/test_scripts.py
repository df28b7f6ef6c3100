"""The measuring scripts' own logic, on the CPU (their GPU runs are in docs)."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parents[1] / "scripts"


class CountingPhases:
    """step_phases.Phases' timed variants, counting the steps each one runs."""

    def __init__(self) -> None:
        self.isl = self.conc = None
        self.steps: list[tuple] = []

    def full(self, tag: str) -> dict:
        self.steps.append(("full", self.isl, self.conc))
        return {"full": 0.002, "to_launch": 0.0}

    def prebuilt(self, tag: str, planned: bool) -> dict:
        self.steps.append(("prebuilt", self.isl, self.conc))
        return {"prebuilt": 0.002, "ret": 0.001}


def test_a_floor_profiles_one_step(monkeypatch):
    """A floor is the kernel time of every step its callable runs: the callable of
    step_phases.py and step_ab.py runs exactly one step of its point, timed as the
    bench times it."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    monkeypatch.delitem(sys.modules, "step_ab", raising=False)
    import step_ab
    import step_phases

    assert step_ab.floor_step is step_phases.floor_step
    phases = CountingPhases()
    assert step_phases.floor_step(phases, 1024, 8) == 2.0
    assert phases.steps == [("full", 1024, 8)]


class Owner:
    def work(self, x):
        time.sleep(0.01)
        return x + 1


def test_host_profile_components_time_each_call_and_undo(monkeypatch):
    """host_profile.py's per-component times: the wall time and calls inside each listed
    function since the last take (also those made through an instance, as methods),
    and every function as it was once the timing ends."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import host_profile

    monkeypatch.setattr(host_profile, "COMPONENTS", ((Owner, "work", "work"),))
    original = Owner.__dict__["work"]
    with host_profile.Components() as components:
        assert Owner().work(1) == 2 and Owner().work(2) == 3
        seconds, calls = components.take()["work"]
        assert calls == 2 and seconds >= 0.02
        assert components.take() == {}
        Owner().work(3)
        assert components.take()["work"][1] == 1
    assert Owner.__dict__["work"] is original


def test_step_phases_times_a_served_step_of_a_real_runner(monkeypatch):
    """Phases hooks the served steps' direct entry (its first call of the graph is the
    step's first launch) and times a full step of a captured runner, on the CPU."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import torch

    import step_phases
    from replay_backend import ReplayBackend, StepRunner, build_model, preset

    torch._dynamo.reset()
    model = build_model(preset("tiny").with_layers(4, (1, 2)).replace(window=16))
    runner = StepRunner(model, backend=ReplayBackend(compiler="eager", max_cudagraph_capture_size=64,
                                                     decoder_replay_trim_threshold=48, max_num_seqs=4),
                        max_num_seqs=4, max_model_len=128, max_num_batched_tokens=256)
    runner.capture()
    phases = step_phases.Phases(runner, 40, 1)
    times = phases.full("a")
    assert phases.launch is not None and times["full"] > 0
    torch._dynamo.reset()


def _launch_probe(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import graph_launch_probe

    return graph_launch_probe


def test_graph_launch_probe_refuses_a_graph_without_kernels(monkeypatch, capsys):
    import pytest

    probe = _launch_probe(monkeypatch)
    with pytest.raises(SystemExit):
        probe.parse_args(["--nodes", "4,64", "--chunks", "1,8"])
    assert "--chunks 8 exceeds --nodes 4" in capsys.readouterr().err
    assert probe.parse_args(["--nodes", "64", "--chunks", "1,8"]).chunks == [1, 8]


def test_graph_launch_probe_splits_its_kernels_over_the_graphs(monkeypatch):
    """Every split runs the same kernels: one replay of the K graphs adds N, whatever K
    (with N not a multiple of K too)."""
    import pytest
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    probe = _launch_probe(monkeypatch)
    for n, k in ((10, 1), (10, 3), (7, 7)):
        x = torch.zeros(8, device="cuda")
        graphs = probe.capture(n, k, x)
        assert len(graphs) == k
        before = x[0].item()
        for g in graphs:
            g.replay()
        assert x[0].item() - before == n


def _tracing_probe(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import tracing_probe

    return tracing_probe


def test_tracing_probe_times_a_graph_launch_before_and_after_a_session():
    """Each phase of a scenario: the host's time launching the graph and one eager kernel.
    In a process of its own, as the probe runs each: the session would slow this one's
    later launches."""
    import json
    import subprocess
    import sys

    import pytest
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    child = subprocess.run([sys.executable, str(SCRIPTS / "tracing_probe.py"), "--one", "attached", "--nodes", "10",
                            "--reps", "2"], capture_output=True, text=True)
    assert child.returncode == 0, child.stderr
    phases = json.loads(child.stdout.strip().splitlines()[-1])
    assert [p["phase"] for p in phases] == ["before any session", "after a CudaTracing session"]
    assert all(p["graph_launch_us"] > 0 and p["eager_launch_us"] > 0 for p in phases)


@pytest.mark.parametrize("argv, match", [
    (["--scenarios", "attached,detached"], "argument --scenarios: unknown 'detached' (the scenarios: attached, plain)"),
    (["--scenarios", " , "], "argument --scenarios: no scenario named"),
    (["--nodes", "0"], "argument --nodes: expected a positive integer, got '0'"),
    (["--reps", "x"], "argument --reps: expected a positive integer, got 'x'"),
])
def test_tracing_probe_refuses_bad_arguments_before_anything_else(monkeypatch, capsys, argv, match):
    probe = _tracing_probe(monkeypatch)
    with pytest.raises(SystemExit):
        probe.main(argv)
    assert match in capsys.readouterr().err
