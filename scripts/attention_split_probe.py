"""The attention kernel's global-key split on mini-2k shapes (GPU).

For each shape (rows of one request at the end of a sequence, the global cache at
ratio 1 or 2) it times ``attend`` whole (``splits=1``) and as planned (the split the
op chooses), GPU time per call by CUDA events (median of 50 after warm-up), and
reports the plan and the largest difference between the two outputs. The replay
layers' shape is 128 rows over the ratio-1 cache of layer 20; the main layers' is a
whole prompt.

usage: python3 scripts/attention_split_probe.py
"""
from __future__ import annotations

import statistics

import torch

from replay_backend.models import attention_triton as at

HEADS, D, WINDOW = 16, 128, 128
SHAPES = [  # (rows, seq_len, ratio): replay rows of one prompt, then whole prompts
    (128, 1024, 1), (128, 4096, 1), (128, 8192, 1), (128, 16384, 1), (128, 32768, 1), (1024, 8192, 1),
    (1024, 1024, 1), (1024, 1024, 2), (4096, 4096, 1), (4096, 4096, 2),
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


def main() -> None:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"{torch.cuda.get_device_name(dev)}, {sms} SMs; heads {HEADS}, head dim {D}, bf16")
    print("rows  seq_len ratio  blocks  plan (splits, chunk)  whole us  split us  ratio  max|diff|")
    for rows, seq_len, ratio in SHAPES:
        q = torch.randn(rows, HEADS, D, device=dev, generator=gen, dtype=torch.bfloat16)
        swa = torch.randn(seq_len + 1, D, device=dev, generator=gen, dtype=torch.bfloat16)
        glob = torch.randn(seq_len // ratio + 1, D, device=dev, generator=gen, dtype=torch.bfloat16)
        sink = torch.randn(HEADS, device=dev, generator=gen, dtype=torch.bfloat16)
        blocks = torch.tensor(at.row_blocks([0, rows], [seq_len], [seq_len - WINDOW], [0], WINDOW),
                              dtype=torch.int64, device=dev).view(-1, at.NUM_FIELDS)
        outs = {}
        us = {}
        for name, splits in (("whole", 1), ("split", None)):
            out = outs[name] = torch.empty_like(q)
            us[name] = _time(lambda: at.attend(q, out, swa, glob, ratio, blocks, WINDOW, True, sink,
                                               D ** -0.5, seq_len, splits=splits))
        plan = at.split_plan(blocks.shape[0], HEADS, seq_len // ratio, sms)
        diff = (outs["whole"].float() - outs["split"].float()).abs().max().item()
        print(f"{rows:5d} {seq_len:8d} {ratio:5d} {blocks.shape[0]:7d}  {str(plan):20s} {us['whole']:9.1f} "
              f"{us['split']:9.1f} {us['whole'] / us['split']:6.2f}  {diff:.3g}")


if __name__ == "__main__":
    main()
