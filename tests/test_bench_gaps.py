"""The GPU-idle analysis of profiled steps (bench_gaps) on hand-built traces."""
import json

import pytest
import torch

from replay_backend.bench import gaps as bench_gaps


def _op(name, ts, dur, tid=1, cat="cpu_op"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1}


def _launch(corr, ts, dur=2, tid=1, cat="cuda_runtime"):
    return {"ph": "X", "cat": cat, "name": "cudaLaunchKernel", "ts": ts, "dur": dur, "tid": tid, "pid": 1,
            "args": {"correlation": corr}}


def _kernel(corr, ts, dur):
    return {"ph": "X", "cat": "kernel", "name": f"k{corr}", "ts": ts, "dur": dur, "tid": 7, "pid": 0,
            "args": {"correlation": corr}}


def _trace():
    # Host: a step op [0, 300); inside it an attention op [100, 200) with an aten op
    # [150, 190). Kernel 1 launched at 10 runs [20, 60). Kernel 2 was launched early
    # (at 30) but starts at 80 (a 20 us gap the host did not cause). Kernel 3 is
    # launched at 160, inside aten::index_copy_ inside the attention op, long after
    # the GPU went idle at 100: a 70 us host-bound gap. Kernel 4 overlaps kernel 3.
    return [
        _op("Torch-Compiled Region", 0, 300),
        _op("dsv41::global_attention", 100, 100),
        _op("aten::index_copy_", 150, 40),
        _launch(1, 10), _kernel(1, 20, 40),
        _launch(2, 30), _kernel(2, 80, 20),
        _launch(3, 160, cat="cuda_driver"), _kernel(3, 170, 50),
        _launch(4, 165), _kernel(4, 200, 40),
    ]


def test_gaps_split_by_cause_and_charged_to_the_open_ops():
    rep = bench_gaps.analyse(_trace())
    assert rep.window_us == 300
    assert rep.lead_us == 20
    assert rep.busy_us == 40 + 20 + 70  # [20,60) + [80,100) + [170,240)
    assert rep.other_gaps_us == 20
    assert rep.host_gaps_us == 70
    assert rep.tail_us == 60
    assert rep.short_gaps_us == 0
    assert dict(rep.by_op) == {"dsv41::global_attention > aten::index_copy_": [70, 1]}
    text = rep.render()
    assert "host-bound gaps 0.07" in text and "dsv41::global_attention > aten::index_copy_" in text


def test_gaps_below_the_threshold_are_left_unclassified():
    rep = bench_gaps.analyse(_trace(), min_gap_us=100)
    assert rep.host_gaps_us == rep.other_gaps_us == 0
    assert rep.short_gaps_us == 90


def test_a_cpu_profile_has_no_kernels_and_reads_as_all_lead(tmp_path):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(64, 64) @ torch.ones(64, 64)
    path = tmp_path / "t.json"
    prof.export_chrome_trace(str(path))
    rep = bench_gaps.analyse_file(str(path))
    assert rep.window_us > 0 and rep.busy_us == 0 and rep.lead_us == rep.window_us


def test_gzipped_traces_load(tmp_path):
    import gzip

    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": _trace()}, f)
    assert bench_gaps.analyse_file(str(path)).host_gaps_us == pytest.approx(70)


def test_kernels_launched_inside_the_trim_op_are_the_replay_region():
    # Main kernel 1 [20, 60). The trim op is open on the host over [50, 250): kernel 2
    # (launched at 55, runs [60, 90)) and kernel 3 (launched at 200, long after the GPU
    # went idle at 90: a 115 us host-bound gap, runs [205, 225)) are the region's.
    # Kernel 4, launched at 260 after the op closed, is the main layers' again; so is a
    # launch on another thread inside the op's span.
    events = [
        _op("Torch-Compiled Region", 0, 400),
        _op(bench_gaps.REGION_OP, 50, 200),
        _launch(1, 10), _kernel(1, 20, 40),
        _launch(2, 55), _kernel(2, 60, 30),
        _launch(3, 200), _kernel(3, 205, 20),
        _launch(4, 260), _kernel(4, 265, 10),
        _launch(5, 100, tid=2), _kernel(5, 300, 10),
    ]
    reg = bench_gaps.analyse(events).region
    assert (reg.calls, reg.host_us, reg.kernels) == (1, 200, 2)
    assert reg.busy_us == 30 + 20
    assert reg.span_us == 225 - 60
    assert reg.host_gaps_us == 115
    assert dict(reg.by_kernel) == {"k2": [30, 1], "k3": [20, 1]}
    assert "replay region (1 trim op calls): host 0.20 ms, 2 kernels, GPU busy 0.05 ms" in reg.render()


def test_a_window_without_the_trim_op_says_so():
    rep = bench_gaps.analyse(_trace())
    assert rep.region.calls == 0 and rep.region.kernels == 0
    assert "replay region: no trim op in the window" in rep.render()
