"""``replay-backend verify`` and its JSON contract."""
from __future__ import annotations

import json
import re

import pytest

from replay_backend import RequestChunk
from replay_backend.config import ReplayConfig
from replay_backend.reference import cli
from replay_backend.reference.verify import VerifyResult, check_tolerance, verify_step

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_dynamo")

FIELDS = {"ok", "num_tokens", "padded_tokens", "step_kind", "trimmed", "replay_rows", "replay_padded",
          "replay_graph", "io_graphs", "max_abs_err_logits", "max_abs_err_kv", "tolerance"}


@pytest.mark.parametrize("capture_all", [False, True])
def test_verify_json_on_the_default_model(capture_all, capsys):
    # W = 128: 1 + 150 + 30 = 181 tokens pad to the 256 graph (>= threshold 200), so the
    # step trims: kept rows 1 + 128 + 30 = 159, padded to the 256 replay graph.
    code = cli.main(["verify", "--batch", "d:1/20,p:150,k:30", "--json",
                     "--option", "compiler=eager", "--option", "cudagraph_capture_sizes=64,256",
                     "--option", "decoder_replay_trim_threshold=200", *(["--capture-all"] if capture_all else [])])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0
    assert FIELDS <= set(out)
    assert out["ok"] is True and out["step_kind"] == "piecewise" and out["trimmed"] is True
    assert (out["num_tokens"], out["padded_tokens"]) == (181, 256)
    assert (out["replay_rows"], out["replay_padded"], out["replay_graph"]) == (159, 256, True)
    # Its gathers and scatter are graphs too (trim_io_graphs, on by default) where
    # capture() ran first: capture on first use makes the region's graphs only.
    assert out["io_graphs"] is capture_all
    assert out["max_abs_err_logits"] <= out["tolerance"] and out["max_abs_err_kv"] <= out["tolerance"]


@pytest.mark.parametrize("batch", ["d:1/20", "p:1"])
def test_verify_a_lone_one_token_step(batch, capsys):
    """A runner's first step of one token: the runner traces the compiled model on a
    dummy step of W tokens first, so the one graph holds for every count."""
    code = cli.main(["verify", "--batch", batch, "--json", "--option", "compiler=eager",
                     "--option", "cudagraph_capture_sizes=8,64"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and out["ok"] is True and (out["num_tokens"], out["step_kind"]) == (1, "piecewise"), out


def test_verify_exit_code_follows_the_comparison(monkeypatch, capsys):
    bad = VerifyResult(False, 3, 4, "piecewise", False, 3, 4, True, 0.5, 0.0, 1e-3)
    monkeypatch.setattr(cli, "verify_step", lambda *a, **k: bad)
    monkeypatch.setattr(cli, "build_model", lambda *a, **k: None)
    assert cli.main(["verify", "--batch", "p:3"]) == 1
    assert "MISMATCH" in capsys.readouterr().out


def test_verify_bad_option_names_the_key(capsys):
    assert cli.main(["verify", "--batch", "p:3", "--option", "no_such_key=1"]) == 2
    assert "no_such_key" in capsys.readouterr().err


@pytest.mark.parametrize("argv, match", [
    (["verify", "--batch", "p:20", "--option", "decoder_replay_trim_threshold=100"],
     r"option decoder_replay_trim_threshold: 100 must exceed the sliding window W=128"),
    (["demo", "--option", "decoder_replay_trim_threshold=64"], r"decoder_replay_trim_threshold: 64"),
    (["verify", "--batch", "d:1/1000000000"], r"sequence length 1000000000 exceeds --max-model-len=131072"),
    (["verify", "--batch", "p:99999999999999999999"], r"query_len=99999999999999999999 is beyond the limit"),
    (["verify", "--batch", "p:9000,p:9000"], r"18000 tokens, more than max_num_batched_tokens=16384"),
])
def test_bad_options_and_specs_are_one_line_and_exit_2_before_any_model_is_built(argv, match, capsys, monkeypatch):
    monkeypatch.setattr(cli, "build_model", lambda *a, **k: pytest.fail("a model was built"))
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("replay-backend: error: "), err
    assert re.search(match, err[0]), err[0]


def test_inspect_refuses_a_threshold_within_the_window_before_tracing(capsys, monkeypatch):
    monkeypatch.setattr(cli, "ReplayBackend", lambda *a, **k: pytest.fail("a backend was built"))
    assert cli.main(["inspect", "--option", "decoder_replay_trim_threshold=128"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["replay-backend: error: option decoder_replay_trim_threshold: 128 must exceed the sliding "
                   "window W=128 (smaller graphs have nothing to trim)"], err



@pytest.mark.parametrize("tolerance, match", [
    ("-1", r"argument --tolerance: must be a finite number >= 0, got '-1'"),
    ("nan", r"argument --tolerance: must be a finite number >= 0, got 'nan'"),
    ("inf", r"argument --tolerance: must be a finite number >= 0, got 'inf'"),
    ("-inf", r"argument --tolerance: must be a finite number >= 0"),
    ("tight", r"argument --tolerance: expected a number, got 'tight'"),
])
def test_a_tolerance_that_cannot_agree_is_refused(tolerance, match, capsys, monkeypatch):
    """A negative or nan tolerance would report MISMATCH at a max |d| of 0."""
    monkeypatch.setattr(cli, "build_model", lambda *a, **k: pytest.fail("a model was built"))
    assert cli.main(["verify", "--batch", "p:3", f"--tolerance={tolerance}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("replay-backend: error: "), err
    assert re.search(match, err[0]), err[0]


def test_a_tolerance_of_zero_is_a_tolerance(monkeypatch, capsys):
    good = VerifyResult(True, 3, 4, "piecewise", False, 3, 4, True, 0.0, 0.0, 0.0)
    seen = {}
    monkeypatch.setattr(cli, "verify_step", lambda *a, **k: seen.update(k) or good)
    monkeypatch.setattr(cli, "build_model", lambda *a, **k: None)
    assert cli.main(["verify", "--batch", "p:3", "--tolerance", "0"]) == 0
    assert seen["tolerance"] == 0.0 and "OK" in capsys.readouterr().out


@pytest.mark.parametrize("tolerance", [float("nan"), -1e-3, float("inf"), "1e-3", True])
def test_verify_step_refuses_a_bad_tolerance_before_running(tolerance):
    with pytest.raises(ValueError, match=r"tolerance must be a finite number >= 0"):
        verify_step(None, [RequestChunk("a", 3, 3)], ReplayConfig(), tolerance=tolerance)
    assert check_tolerance(0) == 0.0 and check_tolerance(None) is None and check_tolerance(2e-3) == 2e-3


def test_verify_refuses_a_step_whose_caches_overflow_before_building_a_model(capsys, monkeypatch):
    monkeypatch.setattr(cli, "build_model", lambda *a, **k: pytest.fail("a model was built"))
    spec = ",".join(["d:1/1000000"] * 2200)
    assert cli.main(["verify", "--batch", spec, "--max-model-len", "1000000"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("replay-backend: error: --batch: 2200 requests of up to 1000000 positions each: "
                           "CacheLayout: max_model_len=1000000 x num_blocks=2200"), line
