"""``replay-backend verify`` and its JSON contract (SPEC §8)."""
from __future__ import annotations

import json

import pytest

from replay_backend import cli
from replay_backend.verify import VerifyResult

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_dynamo")

FIELDS = {"ok", "num_tokens", "padded_tokens", "step_kind", "trimmed", "replay_rows", "replay_padded",
          "replay_graph", "max_abs_err_logits", "max_abs_err_kv", "tolerance"}


def test_verify_json_on_the_default_model(capsys):
    # W = 128: 1 + 150 + 30 = 181 tokens pad to the 256 graph (>= threshold 200), so the
    # step trims: kept rows 1 + 128 + 30 = 159, padded to the 256 replay graph.
    code = cli.main(["verify", "--batch", "d:1/20,p:150,k:30", "--json",
                     "--option", "compiler=eager", "--option", "cudagraph_capture_sizes=64,256",
                     "--option", "decoder_replay_trim_threshold=200"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0
    assert FIELDS <= set(out)
    assert out["ok"] is True and out["step_kind"] == "piecewise" and out["trimmed"] is True
    assert (out["num_tokens"], out["padded_tokens"]) == (181, 256)
    assert (out["replay_rows"], out["replay_padded"], out["replay_graph"]) == (159, 256, True)
    assert out["max_abs_err_logits"] <= out["tolerance"] and out["max_abs_err_kv"] <= out["tolerance"]


def test_verify_exit_code_follows_the_comparison(monkeypatch, capsys):
    bad = VerifyResult(False, 3, 4, "piecewise", False, 3, 4, True, 0.5, 0.0, 1e-3)
    monkeypatch.setattr(cli, "verify_step", lambda *a, **k: bad)
    monkeypatch.setattr(cli, "build_model", lambda *a, **k: None)
    assert cli.main(["verify", "--batch", "p:3"]) == 1
    assert "MISMATCH" in capsys.readouterr().out


def test_verify_bad_option_names_the_key(capsys):
    assert cli.main(["verify", "--batch", "p:3", "--option", "no_such_key=1"]) == 2
    assert "no_such_key" in capsys.readouterr().err
