"""The attention kernel's global-key split on mini-2k shapes (GPU).

For each shape (rows of one request at the end of a sequence, the global cache at
ratio 1 or 2) it times ``attend`` whole (``splits=1``) and split (as planned, or in
16 chunks where the plan does not split): the wall time of one call by CUDA events
(median of 50 after warm-up; the host's launches included, as in a step that waits
for them) and the kernels' GPU time by the profiler (mean of 20 calls; what a step
whose host runs ahead pays), with the plan and the largest difference between the
two outputs. The replay
layers' shape is 128 rows over the ratio-1 cache of layer 20; the main layers' is a
whole prompt.

usage: python3 scripts/attention_split_probe.py
"""
from __future__ import annotations

import argparse
import statistics

import torch

from replay_backend.bench.profile import kernels
from replay_backend.reference import attention_triton as at

HEADS, D, WINDOW = 16, 128, 128
SHAPES = [  # (rows, seq_len, ratio): replay rows of one prompt, then whole prompts
    (128, 1024, 1), (128, 2048, 1), (128, 4096, 1), (128, 8192, 1), (128, 16384, 1), (128, 32768, 1),
    (1024, 8192, 1), (1024, 1024, 1), (1024, 1024, 2), (4096, 4096, 1), (4096, 4096, 2),
]


def _time(fn, reps: int = 50) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def _gpu_us(fn, reps: int = 20) -> float:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in kernels(prof.key_averages())) / reps


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"{torch.cuda.get_device_name(dev)}, {sms} SMs; heads {HEADS}, head dim {D}, bf16")
    print("rows  seq_len ratio  blocks  plan (splits)  wall us whole / split  GPU us whole / split  "
          "max|diff|")
    for rows, seq_len, ratio in SHAPES:
        q = torch.randn(rows, HEADS, D, device=dev, generator=gen, dtype=torch.bfloat16)
        swa = torch.randn(seq_len + 1, D, device=dev, generator=gen, dtype=torch.bfloat16)
        glob = torch.randn(seq_len // ratio + 1, D, device=dev, generator=gen, dtype=torch.bfloat16)
        sink = torch.randn(HEADS, device=dev, generator=gen, dtype=torch.bfloat16)
        blocks = torch.tensor(at.row_blocks([0, rows], [seq_len], [seq_len - WINDOW], [0], WINDOW),
                              dtype=torch.int64, device=dev).view(-1, at.NUM_FIELDS)
        plan = at.split_plan(blocks.shape[0], HEADS, seq_len // ratio, sms)
        outs, wall, gpu = {}, {}, {}
        for name, splits in (("whole", 1), ("split", plan if plan > 1 else 16)):
            out = outs[name] = torch.empty_like(q)

            def call(out=out, splits=splits):
                at.attend(q, out, swa, glob, ratio, blocks, WINDOW, True, sink, D ** -0.5, seq_len,
                          splits=splits)
            wall[name], gpu[name] = _time(call), _gpu_us(call)
        diff = (outs["whole"].float() - outs["split"].float()).abs().max().item()
        print(f"{rows:5d} {seq_len:8d} {ratio:5d} {blocks.shape[0]:7d}  {plan:13d} "
              f"{wall['whole']:9.1f} / {wall['split']:7.1f}  {gpu['whole']:9.1f} / {gpu['split']:7.1f}  "
              f"{diff:.3g}")


if __name__ == "__main__":
    main()
