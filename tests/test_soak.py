"""The serving soak (replay_backend/soak.py) on the CPU: its traffic covers every kind
of step, a compiled runner passes it, and it reports a wrong slot as a mismatch."""
from __future__ import annotations

import pytest
import torch

from replay_backend.backend import ReplayBackend
from replay_backend.batch import RequestChunk
from replay_backend.reference.runner import StepRunner
from replay_backend.reference.soak import Soak, spec_of
from replay_backend.reference.step_compare import written_slots
from replay_backend.reference.traffic import Traffic

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_dynamo")

OPTS = dict(compiler="eager", cudagraph_capture_sizes=[4, 16, 32, 64], decoder_replay_trim_threshold=32,
            max_num_seqs=6, max_num_batched_tokens=128)
KW = dict(max_num_seqs=6, max_model_len=256, max_num_batched_tokens=128)


def make_soak(model, seed: int) -> Soak:
    runner = StepRunner(model, backend=ReplayBackend(**OPTS), **KW)
    runner.capture()
    traffic = Traffic(seed, max_num_seqs=6, max_model_len=256, max_num_batched_tokens=128, window=model.cfg.window,
                      trim_threshold=32, max_capture_size=64)
    return Soak(runner, StepRunner(model, **KW), traffic, seed)


def test_a_compiled_runner_passes_the_soak_and_every_kind_of_step_is_covered(model):
    report = make_soak(model, 5).run(80)
    assert report.mismatches == [], report.render()
    assert report.counters_moved == {}, report.render()
    assert {"piecewise/trimmed/replay-graph/io-graphs", "piecewise/untrimmed/replay-graph",
            "eager/trimmed/replay-graph", "eager/untrimmed/replay-eager"} <= set(report.kinds), report.kinds
    assert report.steps == 80 and "0 mismatches" in report.render()


def test_a_slot_the_compiled_step_got_wrong_is_a_mismatch_of_that_step(model):
    soak = make_soak(model, 6)
    step = soak.runner.step

    def corrupt_step_7(chunks):
        out = step(chunks)
        if soak.report.steps == 7:  # one kept row's KV in the last replay layer
            swa = soak.runner.kv.swa[-1]
            slot = written_slots(soak.runner.kv, chunks, out.batch)["swa-replay"][-1][1][-1]
            swa[slot] += 0.5
        return out

    soak.runner.step = corrupt_step_7
    report = soak.run(12)
    assert [(m.step, m.what, m.layer) for m in report.mismatches] == [(7, "swa-replay", model.cfg.num_layers - 1)], \
        report.render()
    assert report.mismatches[0].err == pytest.approx(0.5, rel=1e-3)
    assert f"swa-replay 0.5 (first at layer {model.cfg.num_layers - 1})" in report.render()


def test_a_mismatch_names_the_first_layer_that_went_wrong(model):
    """Two layers' caches wrong in one step: the mismatch names the lower one, where the
    step first departed from the oracle (every later layer reads its output)."""
    soak = make_soak(model, 6)
    step = soak.runner.step

    def corrupt_step_3(chunks):
        out = step(chunks)
        if soak.report.steps == 3:
            for layer in (3, 1):  # main layers (the cut is 3)
                slot = written_slots(soak.runner.kv, chunks, out.batch)["swa"][layer][1][0]
                soak.runner.kv.swa[layer][slot] += 0.25 * layer
        return out

    soak.runner.step = corrupt_step_3
    report = soak.run(5)
    assert [(m.step, m.what, m.layer) for m in report.mismatches] == [(3, "swa", 1)], report.render()
    assert report.mismatches[0].err == pytest.approx(0.75, rel=1e-3)  # the part's worst: layer 3's


def test_written_slots_follow_the_cache_layout(model):
    runner = StepRunner(model, **KW)
    # block 0: a 20-token prefill after 30 cached positions (W = 16: 16 kept rows)
    chunks = [RequestChunk("a", 20, 50)]
    runner.prefill_context(chunks)
    batch = runner.build_batch(chunks)
    parts = written_slots(runner.kv, chunks, batch)
    swa = parts["swa"][0][1].tolist()
    assert swa == list(range(30, 50))
    assert parts["swa-replay"][0][1].tolist() == list(range(34, 50))
    cfg = model.cfg
    ratios = [cfg.compress_ratio(s) for s in runner.kv.glob]
    by_ratio = dict(zip(ratios, (s.tolist() for _, s, _ in parts["global"])))
    assert by_ratio[1] == swa and by_ratio[2] == [p // 2 for p in range(31, 50, 2)]
    # each entry names its layer, in layer order: the first beyond a limit is the first to go wrong
    assert [layer for _, _, layer in parts["swa"]] == list(range(cfg.cut + 1))
    assert [layer for _, _, layer in parts["swa-replay"]] == list(range(cfg.cut + 1, cfg.num_layers))
    assert [layer for _, _, layer in parts["global"]] == sorted(runner.kv.glob)
    assert [layer for _, _, layer in parts["raw"]] == sorted(runner.kv.raw)
    assert spec_of(chunks + [RequestChunk("b", 1, 9), RequestChunk("c", 40, 40, keep_all=True)]) == \
        "p:20/50,d:1/9,k:40/40"


def test_a_16_bit_soak_measures_its_noise_and_still_sees_one_wrong_row(model):
    """bf16: each part is judged against the run's rounding-noise envelope (the model
    with its embedding one rounding away), by its worst row, so one wrong row stands out."""
    from replay_backend.reference.accuracy import fp32_copy

    m16 = fp32_copy(model).to(torch.bfloat16)
    runner = StepRunner(m16, backend=ReplayBackend(**OPTS), **KW)
    runner.capture()
    traffic = Traffic(8, max_num_seqs=6, max_model_len=256, max_num_batched_tokens=128, window=m16.cfg.window,
                      trim_threshold=32, max_capture_size=64)
    noise = StepRunner(fp32_copy(m16, 8, torch.finfo(torch.bfloat16).eps).to(torch.bfloat16), **KW)
    soak = Soak(runner, StepRunner(m16, **KW), traffic, 8, noise)
    step = soak.runner.step

    def corrupt_step_5(chunks):
        out = step(chunks)
        if soak.report.steps == 5:
            slot = written_slots(soak.runner.kv, chunks, out.batch)["swa-replay"][-1][1][-1]
            soak.runner.kv.swa[-1][slot] *= -1
        return out

    soak.runner.step = corrupt_step_5
    report = soak.run(16)
    assert all(0 < v < 0.2 for v in report.noise.values()), report.noise
    assert [(m.step, m.what) for m in report.mismatches] == [(5, "swa-replay")], report.render()
    assert set(report.limits) == set(report.noise) and "worst row's relative L2" in report.render()
    assert set(soak.seconds) == {"compiled", "oracle", "noise", "checks"}  # the noise runner's step apart


@pytest.mark.parametrize("limits", [dict(max_num_seqs=8, max_num_batched_tokens=4096),  # 8 x W < 1025 tokens
                                    dict(max_num_seqs=16, max_num_batched_tokens=512)])  # below the threshold
def test_traffic_stays_within_the_runner_limits(limits):
    t = Traffic(3, max_model_len=8192, window=128, trim_threshold=768, max_capture_size=1024, **limits)
    for _ in range(300):
        chunks = t.step()
        assert 1 <= len(chunks) <= limits["max_num_seqs"]
        assert sum(c.query_len for c in chunks) <= limits["max_num_batched_tokens"]
        assert all(c.seq_len <= 8192 for c in chunks)
        t.advance(chunks)


def test_the_oracle_can_be_another_model_with_the_same_weights(model):
    """``soak(oracle_model=...)`` (scripts/soak.py --oracle-option) steps that model as the
    oracle: one whose last replay layer differs shows in that layer's cache and the logits
    from the first step; one of another dtype, or another model (not only another
    implementation), is refused before anything is captured."""
    import copy

    from replay_backend.reference.soak import soak

    other = copy.deepcopy(model)
    with torch.no_grad():
        next(other.layers[-1].parameters()).mul_(1.5)
    kw = dict(max_num_seqs=6, max_model_len=256, max_num_batched_tokens=128, options=OPTS)
    report = soak(model, 3, seed=4, oracle_model=other, **kw)
    assert report.mismatches and {m.step for m in report.mismatches} == {0, 1, 2}, report.render()
    assert {m.what for m in report.mismatches} <= {"logits", "swa-replay"}, report.render()
    assert soak(model, 3, seed=4, oracle_model=copy.deepcopy(model), **kw).mismatches == []
    with pytest.raises(ValueError, match="the oracle model is torch.bfloat16 on cpu, the served model torch.float32"):
        soak(model, 3, seed=4, oracle_model=copy.deepcopy(model).to(torch.bfloat16), **kw)
    wider = copy.deepcopy(model)
    wider.cfg = model.cfg.replace(window=2 * model.cfg.window, moe_impl="dense")
    with pytest.raises(ValueError, match="differs from the served model in window: .* only in attention_impl"):
        soak(model, 3, seed=4, oracle_model=wider, **kw)


def test_full_graphs_pass_the_soak_beside_trimming_steps(model):
    """full_and_piecewise (FULL graphs emulated on the CPU, each replay under its
    captured step's context): random decodes, speculative decodes and small mixed steps
    run as FULL graphs, every written slot and logit against the oracle, and the steps
    that trim still run in pieces."""
    from replay_backend.reference.soak import soak

    report = soak(model, 60, seed=7, **KW, options={**OPTS, "cudagraph_mode": "full_and_piecewise"})
    assert report.mismatches == [] and report.counters_moved == {}, report.render()
    assert any(k.startswith("full/untrimmed") for k in report.kinds), report.kinds
    assert "piecewise/trimmed/replay-graph/io-graphs" in report.kinds, report.kinds
