"""The ``replay-backend`` console script: ``demo``, and its usage errors."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from replay_backend.reference import cli
from replay_backend.reference.cli import DEFAULT_BATCH, build_parser, main
from replay_backend.reference.cli_options import backend_options


def test_demo_runs_and_reports(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    model = [l for l in lines if l.startswith("model")]
    batch = [l for l in lines if l.startswith("batch")]
    modes = [l for l in lines if l.startswith("mode ")]
    agree = [l for l in lines if l.startswith("agree")]
    assert len(model) == 1 and len(batch) == 1 and len(agree) == 2
    # the CPU default is the 40-layer tiny preset
    assert "preset 'tiny'" in model[0] and "40 layers" in model[0]
    assert "KV sources [2, 8, 14, 20]" in model[0] and "replay layers 21..39" in model[0]
    assert "cpu" in model[0] and "float32" in model[0]
    # default batch d:1/300, p:250, p:60/260, k:140 with W = 128, worked by hand:
    # 1 + 250 + 60 + 140 = 451 tokens; kept 1 + 128 + 60 + 140 = 329; floor 250 - 128 = 122
    assert DEFAULT_BATCH in batch[0]
    assert "451 tokens" in batch[0] and "4 requests" in batch[0]
    assert "329 replay rows" in batch[0] and "floors [0, 122, 0, 0]" in batch[0]
    assert [m.split()[2:4] for m in modes] == [["eager", "off"], ["eager", "parent"], ["compiled", "replay"]]
    # 451 tokens pad to the 512 graph (>= the CPU demo's threshold 256): a trimming
    # PIECEWISE step whose 329 replay rows pad to the 384 replay graph.
    assert "piecewise step, 512 padded tokens, trimmed=True, replay rows 329 -> graph size 384" in modes[2]
    for line in agree:
        assert line.endswith("-> OK")
        errs = [float(x) for x in re.findall(r"max\|d\| ([0-9.e+-]+)", line)]
        assert len(errs) == 2 and all(e <= 1e-3 for e in errs)


def test_demo_bad_batch_exit_code_2(capsys):
    assert main(["demo", "--batch", "p:10,x:5"]) == 2
    err = capsys.readouterr().err
    assert "error" in err and "item 1 'x:5'" in err


def test_parser_rejects_unknown_preset(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["demo", "--preset", "huge"])
    assert e.value.code == 2
    assert "huge" in capsys.readouterr().err


def test_parser_needs_a_subcommand(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([])
    assert e.value.code == 2


# --------------------------------------------------------------------------------------
# Usage errors: one line ``replay-backend: error: ...`` on stderr, exit status 2, and
# nothing built
# --------------------------------------------------------------------------------------
class _Built(Exception):
    """Raised where a command would start its real work: every check passed."""


@pytest.fixture
def nothing_built(monkeypatch):
    def built(*a, **k):
        raise _Built()

    monkeypatch.setattr(cli, "build_model", built)
    monkeypatch.setattr(cli.bench, "run_bench", built)
    monkeypatch.setattr(cli.bench, "compile_only", built)


def _one_line_error(argv, capsys) -> str:
    code = main(argv)
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert code == 2, (code, captured)
    assert len(err) == 1 and err[0].startswith("replay-backend: error: "), err
    return err[0]


USAGE_ERRORS = [
    # numbers: not numbers, zero, negative, past the limits
    (["demo", "--max-model-len", "abc"], r"argument --max-model-len: expected an integer, got 'abc'"),
    (["demo", "--max-model-len", "0"], r"argument --max-model-len: must be >= 2, got 0"),
    (["demo", "--max-model-len", "-4"], r"argument --max-model-len: must be >= 2, got -4"),
    (["demo", "--max-model-len", "1025"], r"argument --max-model-len: must be even"),
    (["demo", "--max-model-len", str(2 ** 40)], r"argument --max-model-len: 1099511627776 is above the limit of 16777216"),
    (["verify", "--batch", "p:3", "--max-model-len", "0"], r"argument --max-model-len: must be >= 1, got 0"),
    (["verify", "--batch", "p:3", "--max-model-len", "1.5"], r"argument --max-model-len: expected an integer"),
    (["verify", "--batch", "p:3", "--max-model-len", str(2 ** 40)], r"--max-model-len: 1099511627776 is above"),
    (["bench", "--runs", "0"], r"argument --runs: must be >= 1, got 0"),
    (["bench", "--runs", "x"], r"argument --runs: expected an integer, got 'x'"),
    (["bench", "--warmup", "-1"], r"argument --warmup: must be >= 0, got -1"),
    (["bench", "--isl", "a,b"], r"argument --isl: expected an integer, got 'a'"),
    (["bench", "--isl", "0"], r"argument --isl: must be >= 1, got 0"),
    (["bench", "--isl", ","], r"argument --isl: expected comma-separated integers"),
    (["bench", "--isl", str(2 ** 40)], r"argument --isl: 1099511627776 is above the limit"),
    (["bench", "--conc", "-1"], r"argument --conc: must be >= 1, got -1"),
    (["bench", "--conc", "0,8"], r"argument --conc: must be >= 1, got 0"),
    (["bench", "--max-num-batched-tokens", "0"], r"argument --max-num-batched-tokens: must be >= 1, got 0"),
    (["bench", "--max-num-batched-tokens", str(2 ** 40)], r"--max-num-batched-tokens: 1099511627776 is above the "
                                                          r"limit of 1048576"),
    (["bench", "--max-tokens-per-point", "0"], r"argument --max-tokens-per-point: must be >= 1, got 0"),
    (["bench", "--max-seconds", "nan"], r"argument --max-seconds: must be a finite number > 0, got 'nan'"),
    (["bench", "--max-seconds", "0"], r"argument --max-seconds: must be a finite number > 0, got '0'"),
    (["bench", "--max-seconds", "-5"], r"argument --max-seconds: must be a finite number > 0"),
    (["bench", "--isl", "8000000", "--conc", "1000"], r"--isl 8000000 --conc 1000 .*CacheLayout: .*above the limit "
                                                      r"of 2147483647"),
    # names: presets, modes, settings, points
    (["demo", "--preset", "huge"], r"argument --preset: invalid choice: 'huge'"),
    (["verify", "--batch", "p:3", "--preset", "huge"], r"argument --preset: invalid choice: 'huge'"),
    (["inspect", "--preset", "huge"], r"argument --preset: invalid choice: 'huge'"),
    (["bench", "--preset", "huge"], r"unknown preset 'huge'"),
    (["bench", "--modes", "replay,fast"], r"argument --modes: unknown fast; choose from eager, off"),
    (["bench", "--settings", "narrow"], r"argument --settings: unknown narrow; choose from default, wide"),
    (["bench", "--profile-points", "1024"], r"argument --profile-points: '1024': expected ISL/CONC"),
    (["bench", "--attention", "warp"], r"attention_impl must be auto, reference, triton or flashinfer, got 'warp'"),
    (["bench", "--model-option", "window=x"], r"--model-option: invalid ModelConfig: window must be an integer"),
    # devices
    (["demo", "--device", "bogus"], r"argument --device: 'bogus' is not a device; use cpu, cuda or cuda:N"),
    (["verify", "--batch", "p:3", "--device", "bogus"], r"argument --device: 'bogus' is not a device"),
    (["inspect", "--device", "cuda:x"], r"argument --device: 'cuda:x' is not a device"),
    (["verify", "--batch", "p:3", "--device", "meta"], r"argument --device: 'meta': the reference model runs on cpu "
                                                      r"or cuda"),
    # backend options
    (["demo", "--option", "compiler"], r"--option 'compiler': expected KEY=VALUE"),
    (["demo", "--option", "=eager"], r"--option '=eager': expected KEY=VALUE, the KEY is empty"),
    (["demo", "--option", "max_num_batched_tokens=1099511627776"], r"option max_num_batched_tokens: 1099511627776 is "
                                                                   r"above the limit of 1048576"),
    (["verify", "--batch", "p:3", "--option", "cudagraph_capture_sizes={\"8\": 1}"],
     r"option cudagraph_capture_sizes must be a list .*got dict"),
    (["verify", "--batch", "p:3", "--option", "cudagraph_capture_sizes=8.0,16"],
     r"option cudagraph_capture_sizes: size must be an integer, got float 8.0"),
    (["verify", "--batch", "p:3", "--option", "max_num_seqs=NaN"], r"option max_num_seqs: must be an integer"),
    (["bench", "--preset", "tiny", "--option", "decoder_replay_trim_threshold=64"],
     r"option decoder_replay_trim_threshold: 64 must exceed the sliding window W=128"),
    (["inspect", "--option", "compiler=fast"], r"option compiler: must be one of"),
    (["bench", "--option", "cudagraph_mode=none"], r"--option cudagraph_mode: set by the bench's modes"),
    (["bench", "--option", "no_such_key=1"], r"unknown dsv41_replay option\(s\) \['no_such_key'\]"),
    # batches
    (["demo", "--batch", "p:3,q:4"], r"--batch item 1 'q:4': expected KIND:Q\[/S\]\[@F\]"),
    (["demo", "--batch", ","], r"--batch ',': no requests"),
    (["demo", "--batch", "p:10/20@25"], r"--batch item 0 'p:10/20@25': the floor F must lie below S"),
    (["demo", "--batch", "d:1/2000"], r"sequence length 2000 exceeds --max-model-len=1024"),
    (["verify", "--batch", ",".join(["d:1/1000000"] * 2200), "--max-model-len", "1000000"],
     r"--batch: 2200 requests of up to 1000000 positions each: CacheLayout: .*above the limit of 2147483647"),
    # no subcommand, no --batch
    ([], r"the following arguments are required: cmd"),
    (["verify"], r"the following arguments are required: --batch"),
    (["verify", "--batch", "p:3", "--no-such-flag"], r"unrecognized arguments: --no-such-flag"),
]


@pytest.mark.parametrize("argv, match", USAGE_ERRORS, ids=[" ".join(a)[:60] for a, _ in USAGE_ERRORS])
def test_usage_errors_are_one_line_exit_2_before_anything_is_built(argv, match, capsys, nothing_built):
    line = _one_line_error(argv, capsys)
    assert re.search(match, line), line


def test_cuda_devices_this_machine_lacks_are_usage_errors(capsys, nothing_built, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for cmd in (["demo"], ["verify", "--batch", "p:3"], ["inspect"]):
        line = _one_line_error([*cmd, "--device", "cuda"], capsys)
        assert "argument --device: 'cuda': CUDA is not available here" in line and "--device cpu" in line, line
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    line = _one_line_error(["verify", "--batch", "p:3", "--device", "cuda:2"], capsys)
    assert "'cuda:2': this machine has 2 CUDA device(s), cuda:0 to cuda:1" in line, line
    assert build_parser().parse_args(["verify", "--batch", "p:3", "--device", "cuda:1"]).device == "cuda:1"


def test_an_unwritable_dump_or_report_is_refused_before_anything_runs(tmp_path, capsys, nothing_built):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    line = _one_line_error(["inspect", "--dump", str(blocker / "dump")], capsys)
    assert line.startswith(f"replay-backend: error: --dump {blocker / 'dump'}: cannot write there"), line
    for flag in ("--json", "--out", "--profile-out"):
        line = _one_line_error(["bench", flag, str(blocker / "report")], capsys)
        assert f"{flag} {blocker / 'report'}: its directory {blocker} does not exist" in line, line
    line = _one_line_error(["bench", "--json", str(tmp_path)], capsys)
    assert "is a directory, not a file" in line
    line = _one_line_error(["bench", "--trace-dir", str(blocker / "traces"), "--profile-out",
                            str(tmp_path / "prof.txt")], capsys)
    assert "--trace-dir" in line and "cannot write there" in line
    line = _one_line_error(["bench", "--trace-dir", str(tmp_path / "traces")], capsys)
    assert "--trace-dir keeps the traces of the profiled points: give --profile-out" in line, line
    line = _one_line_error(["bench", "--json", str(tmp_path / "r.txt"), "--profile-out", str(tmp_path / "r.txt")],
                           capsys)
    assert f"--json and --profile-out name the same file '{tmp_path / 'r.txt'}'" in line, line


def test_a_dump_that_fails_while_compiling_fails_the_command(model, monkeypatch, tmp_path, capsys, fresh_dynamo):
    from replay_backend import dump

    def disk_full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dump, "dump_compiled", disk_full)
    monkeypatch.setattr(cli, "_model_for", lambda args: (model, "cpu", "small"))
    line = _one_line_error(["inspect", "--json", "--dump", str(tmp_path / "d"), "--option",
                            "decoder_replay_trim_threshold=48", "--option", "max_cudagraph_capture_size=64"], capsys)
    assert line == f"replay-backend: error: --dump {tmp_path / 'd'}: the dump could not be written (the warning " \
                   f"above says why)", line


def test_an_unexpected_error_keeps_its_traceback(monkeypatch, nothing_built):
    def bug(*a, **k):
        raise KeyError("a bug")

    monkeypatch.setattr(cli, "parse_batch_spec", bug)
    with pytest.raises(KeyError, match="a bug"):
        main(["verify", "--batch", "p:3"])


def test_the_console_script_prints_one_line_and_exits_2():
    """As a process: no traceback, whatever the machine (a bogus device)."""
    proc = subprocess.run([sys.executable, "-m", "replay_backend.reference.cli", "verify", "--batch", "p:3",
                           "--device", "bogus"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 2, proc
    assert proc.stderr.strip().splitlines() == [
        "replay-backend: error: argument --device: 'bogus' is not a device; use cpu, cuda or cuda:N "
        "(see 'replay-backend verify --help')"], proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize("cmd", ["verify", "demo"])
def test_help_explains_the_batch_grammar(cmd, capsys):
    assert main([cmd, "--help"]) == 0
    out = capsys.readouterr().out
    for part in ("p:Q/S", "p:Q is p:Q/Q", "d:Q/S", "k:Q/S", "@F", "kv_start", "comma-separated",
                 "example: --batch 'd:1/700,p:250,p:60/260@100,k:140'"):
        assert part in out, part
    example = out.split("example: --batch ")[1].split()[0].strip("'")
    assert len(cli.parse_batch_spec(example)) == 4  # the example parses


def test_a_list_option_given_one_value_is_a_list_of_it():
    assert backend_options(["cudagraph_capture_sizes=256", "splitting_ops=a::b,c::d",
                            "decoder_replay_cudagraph_capture_sizes=[16, 32]", "compiler=eager"]) == {
        "cudagraph_capture_sizes": [256], "splitting_ops": ["a::b", "c::d"],
        "decoder_replay_cudagraph_capture_sizes": [16, 32], "compiler": "eager"}


def test_bench_takes_backend_options():
    args = build_parser().parse_args(["bench", "--option", "compiler=eager", "--option", "strict=true",
                                      "--profile-points", "01024/1,8192/8"])
    assert args.option == ["compiler=eager", "strict=true"] and args.profile_points == ["1024/1", "8192/8"]


@pytest.mark.parametrize("option, absent", [
    ("cudagraph_mode=none", ("cudagraph_capture_sizes", "decoder_replay_trim_threshold")),
    ("max_cudagraph_capture_size=64", ("cudagraph_capture_sizes",)),
    ("decoder_replay=false", ("decoder_replay_trim_threshold",)),
])
def test_the_cpu_demo_defaults_yield_to_the_options_given(option, absent, capsys, nothing_built, caplog):
    """The CPU demo's own capture sizes and threshold are left out where an option
    makes them moot or contradicts them: no error and no note."""
    with caplog.at_level("WARNING", logger="replay_backend"), pytest.raises(_Built):
        main(["demo", "--device", "cpu", "--option", option])
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    opts = cli._demo_options(backend_options([option]), "cpu")
    assert not set(absent) & set(opts), opts
