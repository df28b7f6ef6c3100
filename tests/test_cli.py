"""The ``replay-backend`` console script (SPEC §8): ``demo``."""
from __future__ import annotations

import re

import pytest

from replay_backend.reference.cli import DEFAULT_BATCH, build_parser, main


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
