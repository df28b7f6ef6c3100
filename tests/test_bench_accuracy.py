"""The bench's accuracy gate (reference/accuracy.py) on the CPU."""
import torch

from replay_backend.bench import report as bench_report
from replay_backend.reference.accuracy import (CHECK, DRIFT_FACTOR, REL_FLOOR, fp32_copy, last_logits, nudge_size,
                                           yardstick)
from replay_backend.reference.compare import rel_l2
from replay_backend.reference import build_model, preset
from replay_backend.reference.runner import StepRunner

CFG = preset("tiny").with_layers(4, (1,)).replace(window=16)


def plain_logits(model):
    return StepRunner(model, max_model_len=64).prefill({CHECK: 40})[CHECK].float()


def test_the_yardstick_is_the_model_upcast_and_the_band_is_rounding_noise():
    model = build_model(CFG, "cpu", torch.bfloat16)
    plain = plain_logits(model)
    gate = yardstick(model, plain, 40, 64)
    want = plain_logits(build_model(CFG, "cpu", torch.bfloat16).float())
    assert torch.equal(gate.exact, want)  # the same weights upcast, the same math
    assert next(model.parameters()).dtype == torch.bfloat16  # the model itself is untouched
    assert 0 < gate.plain_err < 0.05 and 0 < gate.noise_err < 0.05  # rounding, not a different model
    assert gate.limit == DRIFT_FACTOR * max(gate.plain_err, gate.noise_err) + REL_FLOOR
    assert not gate.drifted(gate.error(plain))
    # a mode that reads shuffled rows somewhere gives unrelated logits
    assert gate.drifted(gate.error(plain.flip(0)))


def test_a_wrong_piece_is_flagged_and_rounding_is_not():
    model = build_model(CFG, "cpu", torch.bfloat16)
    gate = yardstick(model, plain_logits(model), 40, 64)
    # one sublayer's shared expert 30% off (a piece computing something else)
    wrong = build_model(CFG, "cpu", torch.bfloat16)
    with torch.no_grad():
        wrong.layers[1].ffn.moe.s_down.mul_(1.3)
    assert gate.drifted(gate.error(plain_logits(wrong)))
    # one more rounding of every weight to bf16 after an fp32 detour: within the band
    again = fp32_copy(model, nudge_seed=7, nudge=nudge_size(torch.bfloat16)).bfloat16()
    assert not gate.drifted(gate.error(plain_logits(again)))


def test_an_fp32_model_is_its_own_yardstick_with_a_one_ulp_band():
    model = build_model(CFG, "cpu", torch.float32)
    plain = plain_logits(model)
    gate = yardstick(model, plain, 40, 64)
    assert gate.exact is not None and gate.plain_err == 0
    assert 0 < gate.noise_err < 1e-4  # one ulp at the input moves fp32 logits a little
    nudged = last_logits(fp32_copy(model, 0, nudge_size(torch.float32)), 40, 64)
    assert rel_l2(nudged, plain) <= gate.noise_err
    assert gate.drifted(gate.error(plain * 1.01))  # 1% off is far beyond fp32 noise


def test_the_report_warns_about_a_drifting_mode():
    run = dict(mode="replay", setting="default", compile_s=1.0, capture={}, ms={}, error=None,
               max_abs_err_vs_eager=1.1, rel_err_vs_fp32=0.9, drifted=True)
    report = dict(preset="mini-2k", dtype="torch.bfloat16", device="H200", torch="2.11", runs=10, warmup=1,
                  max_num_batched_tokens=16384, results=[run], floor_ms={}, plain_err_vs_fp32=0.04,
                  noise_err_vs_fp32=0.11, drift_limit=0.331, check_tokens=1024)
    text = bench_report.render(report)
    assert "WARNING: the logits of default/replay drift" in text
    assert "rel L2 vs the fp32 copy 0.9; DRIFT" in text
    assert "1024-token prompt, relative L2 to the model's fp32 copy: plain model 0.04, " \
           "fp32 copies nudged by one rounding 0.11; a mode drifts above 0.331" in text


def test_the_reference_model_is_well_conditioned_in_bf16():
    """In bf16 the 40-layer model stays within 0.02 relative L2 of its fp32
    copy, and fp32 copies nudged by half a bf16 step stay as close, so a 16-bit check
    can see a real error (the bench's gate is 1.5 times this band)."""
    torch.set_num_threads(1)
    model = build_model(preset("tiny"), "cpu", torch.bfloat16)
    gate = yardstick(model, last_logits(model, 256, 16384), 256, 16384)
    assert gate.plain_err <= 0.02 and gate.noise_err <= 0.02, gate


def test_the_fp32_copy_of_a_flashinfer_model_attends_through_the_default():
    """FlashInfer has no fp32 kernels: the yardstick of a FlashInfer model (bench
    --attention flashinfer) is its weights upcast under the default attention; the
    soak's noise model keeps the model's own dtype and attention."""
    from replay_backend.reference.accuracy import nudged_copy

    fim = build_model(CFG.replace(attention_impl="flashinfer"), "cpu", torch.bfloat16)
    exact = fp32_copy(fim)
    assert {m.cfg.attention_impl for m in exact.modules() if hasattr(m, "cfg")} == {"auto"}
    assert next(exact.parameters()).dtype == torch.float32
    assert fim.cfg.attention_impl == "flashinfer"  # the model itself is untouched
    want = plain_logits(fp32_copy(build_model(CFG, "cpu", torch.bfloat16)))
    assert torch.equal(plain_logits(exact), want)
    noisy = nudged_copy(fim, 3)
    assert noisy.cfg.attention_impl == "flashinfer" and noisy.embed.dtype == torch.bfloat16
    assert not torch.equal(noisy.embed, fim.embed)
    # the nudge is fp32_copy's, rounded back
    assert torch.equal(noisy.embed, fp32_copy(fim, 3, nudge_size(torch.bfloat16) * 2).embed.bfloat16())


def test_passes_in_another_attention_share_the_fp32_copies(monkeypatch):
    """bench --attention a,b: the second pass's gate reuses the first's fp32 results
    when its fp32 copies would compute the same (a FlashInfer model's run the default
    attention), and runs its own for another model."""
    from replay_backend.reference import accuracy

    made = []
    real = accuracy.fp32_copy
    monkeypatch.setattr(accuracy, "fp32_copy", lambda *a, **k: made.append(a[1:]) or real(*a, **k))
    shared: dict = {}
    model = build_model(CFG.replace(attention_impl="auto"), "cpu", torch.bfloat16)
    first = accuracy.yardstick(model, plain_logits(model), 40, 64, shared)
    assert len(made) == 3  # the exact copy and two nudged ones
    fim = build_model(CFG.replace(attention_impl="flashinfer"), "cpu", torch.bfloat16)
    plain = plain_logits(model) * 1.01  # stands for the FlashInfer model's own logits
    again = accuracy.yardstick(fim, plain, 40, 64, shared)
    assert len(made) == 3 and again.exact is first.exact and again.noise_err == first.noise_err
    assert again.plain_err == rel_l2(plain, first.exact)  # its own
    other = build_model(CFG.replace(window=8), "cpu", torch.bfloat16)
    accuracy.yardstick(other, plain_logits(other), 40, 64, shared)
    assert len(made) == 6
