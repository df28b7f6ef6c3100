"""Inspection: plan_of and its JSON, the dump directory, TORCH_TRACE
artifacts, graph-code logging, logging, and the depyf shim / fallback.

One compiled, captured runner (8-layer DSv4.1-mini, W=16, plain FX pieces) is shared by
the module; it is built with ``debug_dump_path`` and with the trace and graph-code hooks
recorded, so one compile feeds every check.
"""
from __future__ import annotations

import ast
import inspect
import json
import logging
import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch

from replay_backend import RequestChunk, StepRunner, depyf_debug, plan_of
from replay_backend.compat import dumps as compat_dumps
from replay_backend.backend import ReplayBackend
from replay_backend.config import DUMP_ENV_VAR, ReplayConfig
from replay_backend.counters import counters
from replay_backend.dump import dump_compiled
from replay_backend.plan import SplitPlan
from replay_backend.capture.graphs import GraphResources
from replay_backend.fallbacks import StrictFallbackError

from conftest import MAX_MODEL_LEN

OPTIONS = dict(compiler="eager", max_num_seqs=4, cudagraph_capture_sizes=[8, 32, 64],
               decoder_replay_trim_threshold=48, decoder_replay_cudagraph_capture_sizes=[16, 32])
MAIN_PIECES = [f"pieces/main/submod_{i}.py" for i in range(10)]
REPLAY_PIECES = [f"pieces/replay/submod_{i}.py" for i in range(9)]
DUMP_FILES = {"index.md", "config.json", "plan.txt", "plan.json", "graph_before_split.py",
              "graph_after_split.py", "replay_region.py", "replay_region_split.py", "capture.json",
              *MAIN_PIECES, *REPLAY_PIECES}


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record) -> None:
        self.records.append(record)

    def messages(self, name: str | None = None) -> list[str]:
        return [r.getMessage() for r in self.records if name is None or r.name == name]


@pytest.fixture(scope="module", autouse=True)
def _threads(one_thread):
    yield


@pytest.fixture(scope="module")
def env(model, tmp_path_factory):
    dump_dir = str(tmp_path_factory.mktemp("dump"))
    traced: list[tuple[str, str, str]] = []
    logs = _Records()
    pkg = logging.getLogger("replay_backend")
    glog = torch._logging.getArtifactLogger("replay_backend", "graph_code")
    levels = pkg.level, glog.level, glog.propagate
    torch._dynamo.reset()
    with pytest.MonkeyPatch.context() as mp:
        # Record the structured trace through our adapter (a real TORCH_TRACE run is
        # test_torch_trace_files_name_our_artifacts) and turn graph_code logging on.
        mp.setattr(compat_dumps, "trace_enabled", lambda: True)
        mp.setattr(compat_dumps, "trace_structured",
                   lambda name, payload, encoding="string": traced.append((name, encoding, payload())))
        pkg.setLevel(logging.DEBUG)
        glog.setLevel(logging.DEBUG)
        glog.propagate = True
        pkg.addHandler(logs)
        try:
            be = ReplayBackend(**OPTIONS, debug_dump_path=dump_dir)
            runner = StepRunner(model, max_model_len=MAX_MODEL_LEN, backend=be)
            summary = runner.capture()
            with counters.expect(strict=False, trims=2, untrimmed=1, replay_dispatch={16: 2, 32: 1}):
                steps = [runner.step([RequestChunk(f"s{i}", q, q)]) for i, q in enumerate((40, 20, 100))]
            for i in range(3):
                runner.free(f"s{i}")
        finally:
            pkg.removeHandler(logs)
            pkg.setLevel(levels[0])
            glog.setLevel(levels[1])
            glog.propagate = levels[2]
    yield types.SimpleNamespace(be=be, runner=runner, summary=summary, steps=steps, dump=dump_dir,
                                traced=traced, logs=logs)
    torch._dynamo.reset()


# ---- plan_of and the JSON plan --------------------------------------------------------
def test_steps_took_the_expected_paths(env):
    # 40 tokens: graph 64 >= threshold 48, trims 16 rows -> replay graph 16; 20 tokens:
    # graph 32, no trim, region graphs at 32; 100 tokens: eager step, trims -> replay 16
    kinds = [(s.step.kind, s.step.padded_tokens, s.trim.trimmed, s.trim.padded) for s in env.steps]
    assert kinds == [("piecewise", 64, True, 16), ("piecewise", 32, False, 32), ("eager", 100, True, 16)]


def test_plan_of_every_holder_without_retracing(env):
    graphs_seen = counters.graphs_seen
    want = env.be.model.plan_snapshot().as_dict()
    for holder in (env.be, env.runner, env.be.model, env.runner.forward):
        assert plan_of(holder).as_dict() == want, type(holder).__name__
    plan = plan_of(env.be)
    assert plan_of(plan) is plan
    assert counters.graphs_seen == graphs_seen  # nothing was traced again
    with pytest.raises(TypeError, match="no dsv41_replay compiled model found in object"):
        plan_of(object())


def test_plan_runner_stats(env):
    plan = plan_of(env.runner)
    main, replay = plan.runners["main"], plan.runners["replay"]
    assert (main.pieces, main.captured_sizes, main.graphs) == (5, [8, 32, 64], 15)
    # replay graphs: the replay sizes plus the main sizes below the threshold (untrimmed steps)
    assert (replay.pieces, replay.captured_sizes, replay.graphs) == (5, [8, 16, 32], 15)
    # served steps only: warm-up and capture steps are not counted
    assert main.dispatch == {64: 1, 32: 1, "eager": 1}
    assert replay.dispatch == {16: 2, 32: 1}
    assert main.capture_seconds == env.summary["main"]["seconds"]
    assert "runner main: 5 graph pieces, captured sizes [8, 32, 64] (15 graphs" in plan.render()
    assert "steps dispatched by size: 16: 2, 32: 1" in plan.render()


def test_plan_json_has_the_documented_fields_and_round_trips(env):
    d = json.loads(plan_of(env.be).to_json())
    assert d["window"] == 16 and d["trim_threshold"] == 48 and d["replay_layers"] == [4, 7]
    assert d["capture_sizes"] == [8, 32, 64] and d["replay_capture_sizes"] == [16, 32]
    assert [p["kind"] for p in d["main_pieces"]] == ["graph", "attention"] * 4 + ["graph", "replay"]
    assert [p["layers"] for p in d["main_pieces"]][-1] == [4, 5, 6, 7]
    assert all(p["num_ops"] > 0 for p in d["main_pieces"] if p["kind"] == "graph")
    assert {p["kind"] for p in d["replay_pieces"]} == {"graph", "attention"}
    assert d["runners"]["main"]["dispatch"] == {"32": 1, "64": 1, "eager": 1}
    assert d["config"]["debug_dump_path"] == env.dump
    assert SplitPlan.from_dict(d).as_dict() == d


# ---- the dump directory ---------------------------------------------------------------
def _files(root: str) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs}


def _read(env, rel: str) -> str:
    with open(os.path.join(env.dump, rel)) as f:
        return f.read()


def test_dump_directory_holds_everything(env):
    assert _files(env.dump) == DUMP_FILES
    index = _read(env, "index.md")
    listed = [line.split("](")[0][3:] for line in index.splitlines() if line.startswith("- [")]
    assert sorted(listed) == sorted(DUMP_FILES - {"index.md"})  # one line per file
    assert "main attention piece, layer 0, dsv41::swa_attention" in index
    for rel in DUMP_FILES:
        if rel.endswith(".py"):
            ast.parse(_read(env, rel), rel)  # readable and valid Python


def _calls(code: str, op: str) -> int:
    """Calls of ``op`` in readable code, not counting the source comments next to them."""
    return sum(f"{op}(" in line for line in code.splitlines() if not line.lstrip().startswith("#"))


def test_dump_file_contents(env):
    assert json.loads(_read(env, "config.json")) == env.be.config.as_dict()
    assert json.loads(_read(env, "plan.json"))["replay_layers"] == [4, 7]
    before = _read(env, "graph_before_split.py")
    assert _calls(before, "replay_begin") == 1
    assert _calls(before, "torch.ops.dsv41.global_attention") == 5  # layers 2, 4..7
    after = _read(env, "graph_after_split.py")
    assert "submod_9     replay piece, layers 4..7, dsv41_replay::trim_and_redispatch" in after
    assert "replay_begin" not in after
    assert "dsv41.swa_attention" in _read(env, "pieces/main/submod_1.py")
    region = _read(env, "replay_region.py")
    assert _calls(region, "torch.ops.dsv41.global_attention") == 4  # layers 4..7
    assert "source_attention" not in region
    assert "graph piece, layer 7" in _read(env, "pieces/replay/submod_8.py")
    cap = json.loads(_read(env, "capture.json"))
    assert cap["summary"]["main"]["graphs"] == 15
    assert cap["runners"]["replay"]["captured_sizes"] == [8, 16, 32]


def test_dump_after_the_fact_says_what_it_lacks(tmp_path):
    torch._dynamo.reset()
    be = ReplayBackend(compiler="eager")
    fn = torch.compile(lambda x: torch.sin(x) + 1, backend=be)
    fn(torch.randn(4))
    written = dump_compiled(be.model, str(tmp_path))
    assert set(written) == _files(str(tmp_path))
    assert "graph_before_split.py" not in written and "replay_region.py" not in written
    index = (tmp_path / "index.md").read_text()
    assert "graph_before_split.py — not kept" in index and "capture.json — not written here" in index
    assert "off: no replay boundary markers" in index
    torch._dynamo.reset()


def test_dump_and_backend_of_take_what_a_user_holds(tmp_path):
    """dump_compiled and backend_of on replay_backend.compile's result, a backend and a
    StepRunner, as plan_of takes them."""
    from llama_swa import LlamaServer, LlamaSWA
    import replay_backend
    from replay_backend import StepRunner, backend_of, build_model, preset

    torch._dynamo.reset()
    model = LlamaSWA(window=8).eval()
    compiled = replay_backend.compile(model, ("input_ids", "positions"), options={"compiler": "eager"})
    LlamaServer(model, compiled).warm_up()
    runner = StepRunner(build_model(preset("tiny").with_layers(4, (1, 2)).replace(window=16)), max_model_len=64,
                        backend=ReplayBackend(compiler="eager"))
    runner.step([replay_backend.RequestChunk("a", 3, 3)])
    for k, obj in enumerate((compiled, compiled.backend, runner)):
        written = dump_compiled(obj, str(tmp_path / str(k)))
        assert "index.md" in written and "graph_after_split.py" in written, (k, written)
    assert backend_of(compiled) is compiled.backend and backend_of(runner) is runner.backend
    torch._dynamo.reset()


def test_dump_path_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(DUMP_ENV_VAR, str(tmp_path / "env"))
    assert ReplayConfig.from_options({}).debug_dump_path == str(tmp_path / "env")
    assert ReplayConfig.from_options({"debug_dump_path": "x"}).debug_dump_path == "x"  # the option wins
    monkeypatch.delenv(DUMP_ENV_VAR)
    assert ReplayConfig.from_options({}).debug_dump_path is None
    assert ReplayConfig(debug_dump_path=tmp_path).debug_dump_path == str(tmp_path)  # PathLike
    for bad in (3, ""):
        with pytest.raises(ValueError, match="option debug_dump_path"):
            ReplayConfig(debug_dump_path=bad)


# ---- structured trace and graph-code logging ------------------------------------------
def test_trace_artifacts(env):
    names = [n for n, _, _ in env.traced]
    stems = {os.path.splitext(r)[0].replace("/", "_") for r in DUMP_FILES - {"index.md", "plan.txt"}}
    assert sorted(names) == sorted(f"dsv41_replay_{s}" for s in stems)  # each once
    enc = {n: e for n, e, _ in env.traced}
    assert enc["dsv41_replay_plan"] == enc["dsv41_replay_capture"] == enc["dsv41_replay_config"] == "json"
    payload = dict((n, p) for n, _, p in env.traced)
    assert json.loads(payload["dsv41_replay_plan"])["replay_layers"] == [4, 7]
    assert payload["dsv41_replay_graph_before_split"] == _read(env, "graph_before_split.py")


def test_graph_code_logged_for_every_graph(env):
    text = "\n".join(env.logs.messages("replay_backend.__graph_code"))
    for name in ("graph_before_split", "graph_after_split", "replay_region", "replay_region_split",
                 "pieces_main_submod_0", "pieces_replay_submod_8"):
        assert f"===== dsv41_replay_{name} =====" in text


TRACE_SCRIPT = textwrap.dedent("""
    import torch
    from replay_backend.backend import ReplayBackend
    fn = torch.compile(lambda x: torch.sin(x) + 1, backend=ReplayBackend(compiler="eager"))
    fn(torch.randn(8))
""")


def test_torch_trace_files_name_our_artifacts(tmp_path):
    env = {**os.environ, "TORCH_TRACE": str(tmp_path)}
    subprocess.run([sys.executable, "-c", TRACE_SCRIPT], env=env, check=True, timeout=300)
    (log_file,) = tmp_path.iterdir()
    # each record: a glog-style prefix, "] ", the JSON metadata; payload lines follow
    records = [json.loads(line.split("] ", 1)[1]) for line in log_file.read_text().splitlines()
               if '] {"artifact"' in line]
    names = {r["artifact"]["name"] for r in records}
    assert {"dsv41_replay_graph_before_split", "dsv41_replay_graph_after_split", "dsv41_replay_plan",
            "dsv41_replay_config", "dsv41_replay_pieces_main_submod_0"} <= names


# ---- logging --------------------------------------------------------------------------
def test_logging_under_the_package_logger(env):
    msgs = env.logs.messages()
    assert sum(m.startswith("dsv41_replay config: ") for m in msgs) == 1
    assert any(m.startswith("captured main graphs: 3 sizes, 15 graphs") for m in msgs)
    assert any(m.startswith("captured replay graphs: 3 sizes, 15 graphs") for m in msgs)
    assert any(m.startswith(f"dsv41_replay: graphs dumped to {env.dump}") for m in msgs)
    assert {r.name for r in env.logs.records} <= {"replay_backend", "replay_backend.__graph_code"}


def test_config_logged_once_per_backend_not_per_graph(caplog):
    torch._dynamo.reset()
    be = ReplayBackend(compiler="eager")
    fn = torch.compile(lambda x: torch.sin(x) + 1, backend=be)
    with caplog.at_level(logging.INFO, logger="replay_backend"):
        fn(torch.randn(4))
        fn(torch.randn(4, dtype=torch.float64))  # a second graph (a recompile)
    assert len(be.compiled) == 2
    config_lines = [r for r in caplog.records if r.getMessage().startswith("dsv41_replay config:")]
    assert len(config_lines) == 1 and config_lines[0].levelno == logging.INFO
    torch._dynamo.reset()


def test_fallbacks_logged_once_per_reason_or_raised_when_strict(caplog):
    res = GraphResources(use_cuda=False)
    with caplog.at_level(logging.WARNING, logger="replay_backend"), \
            counters.expect(fallbacks={"some_reason": 2, "other": 1}):
        res.fallback("some_reason", "first")
        res.fallback("some_reason", "second")
        res.fallback("other", "third")
    msgs = [r.getMessage() for r in caplog.records if r.name == "replay_backend"]
    assert msgs == ["dsv41_replay fallback [some_reason]: first", "dsv41_replay fallback [other]: third"]
    with pytest.raises(StrictFallbackError, match="some_reason: detail .strict=True"):
        GraphResources(use_cuda=False, strict=True).fallback("some_reason", "detail")


# ---- depyf ----------------------------------------------------------------------------
def test_depyf_missing_falls_back_with_a_clear_message(monkeypatch, caplog, tmp_path):
    monkeypatch.setitem(sys.modules, "depyf", None)  # import depyf -> ImportError
    ran = False
    with caplog.at_level(logging.WARNING, logger="replay_backend"), depyf_debug(str(tmp_path)) as on:
        ran = True
    assert ran and on is False
    (msg,) = [r.getMessage() for r in caplog.records]
    assert "depyf is not installed" in msg and "dsv41-replay[inspect]" in msg and DUMP_ENV_VAR in msg


@pytest.fixture
def loader_slot():
    """Save and restore PyCodeCache.load_by_key_path exactly (a classmethod)."""
    from torch._inductor.codecache import PyCodeCache

    saved = PyCodeCache.__dict__["load_by_key_path"]
    yield PyCodeCache
    PyCodeCache.load_by_key_path = saved


def test_depyf_loader_hook_adapted_to_this_torch(loader_slot, monkeypatch):
    PyCodeCache = loader_slot
    original = PyCodeCache.load_by_key_path
    seen = []

    def unpatched(*args, **kwargs):
        seen.append(kwargs)
        return original(*args, **kwargs)

    # What depyf 0.20 installs: a 4-argument hook that calls the loader it saved.
    data = {"unpatched_load_by_key_path": unpatched}
    monkeypatch.setitem(sys.modules, "depyf.explain.global_variables", types.SimpleNamespace(data=data))

    def depyf_hook(key, path, linemap=None, attrs=None):
        return data["unpatched_load_by_key_path"](key, path, linemap, attrs)

    PyCodeCache.load_by_key_path = depyf_hook
    new_torch = "set_sys_modules" in inspect.signature(original).parameters  # torch >= 2.13
    if new_torch:
        with pytest.raises(TypeError, match="set_sys_modules"):  # the break
            PyCodeCache.load("x = 1\n")
    assert compat_dumps.adapt_depyf() is True
    assert compat_dumps.adapt_depyf() is False  # idempotent
    assert PyCodeCache.load("x = 2\n").x == 2
    if new_torch:
        PyCodeCache.load_by_key_path("k", PyCodeCache.write("y = 3\n")[1], set_sys_modules=False)
        assert {"set_sys_modules": False} in seen  # the extra keyword reached the real loader
    assert data["unpatched_load_by_key_path"] is unpatched


def test_depyf_bytecode_hook_failure_does_not_fail_the_compile(caplog):
    class Hook:
        def __call__(self, code, new_code):
            raise RecursionError("maximum recursion depth exceeded")

    Hook.__module__ = "depyf.explain.enable_debugging"  # looks like depyf's DebuggableHook
    handle = torch._dynamo.convert_frame.register_bytecode_hook(Hook())
    try:
        torch._dynamo.reset()
        assert compat_dumps.adapt_depyf() is True
        fn = torch.compile(lambda x: torch.cos(x) * 2, backend=ReplayBackend(compiler="eager"))
        with caplog.at_level(logging.WARNING, logger="replay_backend"):
            assert torch.allclose(fn(torch.ones(3)), torch.cos(torch.ones(3)) * 2)
        assert any("depyf could not decompile" in r.getMessage() for r in caplog.records)
    finally:
        handle.remove()
        torch._dynamo.reset()


def test_depyf_dumps_our_pieces(tmp_path):
    pytest.importorskip("depyf")
    torch._dynamo.reset()
    fn = torch.compile(lambda x: torch.sin(x) + 1, backend=ReplayBackend(compiler="eager"))
    with depyf_debug(str(tmp_path)) as on:
        fn(torch.randn(8))
    assert on is True
    names = os.listdir(tmp_path)
    assert any("dsv41_replay_graph_after_split" in n for n in names)
    assert any("dsv41_replay_pieces_main_submod_0" in n for n in names)
    torch._dynamo.reset()


# ---- the CLI and the package ----------------------------------------------------------
def test_cli_inspect_json_and_dump(model, monkeypatch, tmp_path, capsys):
    from replay_backend.reference import cli

    torch._dynamo.reset()
    monkeypatch.setattr(cli, "_model_for", lambda args: (model, "cpu", "small"))
    dump_dir = tmp_path / "d"
    assert cli.main(["inspect", "--json", "--dump", str(dump_dir), "--option",
                     "decoder_replay_trim_threshold=48", "--option", "max_cudagraph_capture_size=64"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["replay_layers"] == [4, 7] and d["trim_threshold"] == 48
    assert d["replay_capture_sizes"] == [16, 32, 48, 64]
    assert {p["kind"] for p in d["main_pieces"]} == {"graph", "attention", "replay"}
    assert "runners" in d and d["runners"]["main"]["captured_sizes"] == [16]  # the one trace step
    files = _files(str(dump_dir))
    assert {"index.md", "graph_before_split.py", "graph_after_split.py", "replay_region.py"} <= files
    assert "capture.json" not in files  # inspect does not capture
    torch._dynamo.reset()


def test_package_import_does_not_import_pytest():
    code = "import sys, replay_backend, replay_backend.testing; sys.exit('pytest' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
