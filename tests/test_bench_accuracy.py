"""The bench's accuracy gate (bench_accuracy) on a bf16 model on the CPU."""
import torch

from replay_backend import bench_report
from replay_backend.bench_accuracy import drifted, fp32_reference
from replay_backend.compare import max_abs_err
from replay_backend.models import build_model, preset
from replay_backend.runner import StepRunner

CFG = preset("tiny").with_layers(4, (1,)).replace(window=16)


def test_fp32_reference_is_the_model_upcast_and_the_plain_model_is_within_the_gate():
    model = build_model(CFG, "cpu", torch.bfloat16)
    exact = fp32_reference(model, 40, 64)  # the prompt of request "check"
    assert exact.dtype == torch.float32
    want = StepRunner(build_model(CFG, "cpu", torch.bfloat16).float(), max_model_len=64).prefill({"check": 40})["check"]
    assert torch.equal(exact, want)  # the same weights upcast, the same math
    assert next(model.parameters()).dtype == torch.bfloat16  # the model itself is untouched
    plain = StepRunner(model, max_model_len=64).prefill({"check": 40})["check"].float()
    plain_err = max_abs_err(plain, exact)
    assert plain_err > 0  # bf16 rounding
    scale = exact.abs().max().item()
    assert not drifted(plain_err, plain_err, scale)
    # a mode that reads shuffled inputs somewhere: further off than rounding
    assert drifted(max_abs_err(plain.flip(0), exact), plain_err, scale)


def test_an_fp32_model_is_its_own_yardstick():
    assert fp32_reference(build_model(CFG, "cpu", torch.float32), 40, 64) is None


def test_the_report_warns_about_a_drifting_mode():
    run = dict(mode="replay", setting="default", compile_s=1.0, capture={}, ms={}, error=None,
               max_abs_err_vs_eager=1.1, max_abs_err_vs_fp32=1.2, drifted=True)
    report = dict(preset="mini-2k", dtype="torch.bfloat16", device="H200", torch="2.11", runs=10, warmup=1,
                  max_num_batched_tokens=16384, results=[run], floor_ms={}, plain_err_vs_fp32=0.4,
                  check_tokens=1024, fp32_logit_scale=12.5)
    text = bench_report.render(report)
    assert "WARNING: the logits of default/replay drift" in text
    assert "vs an fp32 copy 1.2" in text
    assert "its fp32 copy on a 1024-token prompt: max|d| 0.4, largest |logit| 12.5" in text
