"""The trim op's one-launch row moves against the PyTorch ops (GPU): the same result, and
the host time per call of each (the kernel through Triton's entry; as RowMoves launches
it, from its kept build and checks, directly; and the same through Triton's launch path),
on mini-2k's boundary tensors; then the kept build's launch alone, given its pointers as
tensors and as addresses, against the same launch through the launcher's Python call
instead of its C entry.

usage: python3 scripts/row_moves_probe.py [--tokens 8192] [--calls 200]

Row tensors as the trim op sees them: hidden [T, 2048] and residual [T, 4, 2048] bf16,
pre and post [T, 4] and comb [T, 4, 4] fp32, positions [T] int64; 128 replay rows
gathered, one [T, 2048] bf16 output scattered.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from replay_backend import triton_compat as _triton
from replay_backend.triton_compat import triton
from replay_backend.dispatch import row_moves


def host_us(fn, calls: int) -> float:
    times = []
    for i in range(calls):
        if i % 20 == 0:
            torch.cuda.synchronize()  # the launch queue never fills
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    t, dev = args.tokens, "cuda"
    shapes = [((2048,), torch.bfloat16), ((4, 2048), torch.bfloat16), ((4,), torch.float32),
              ((4,), torch.float32), ((4, 4), torch.float32), ((), torch.int64)]
    rows = [(torch.randn(t, *s, device=dev) * 10).to(d) for s, d in shapes]
    rows_t = torch.arange(t - 128, t, device=dev)
    bufs = [torch.zeros((256, *x.shape[1:]), dtype=x.dtype, device=dev) for x in rows]
    res, outs = [torch.randn(256, 2048, device=dev).bfloat16()], [torch.empty(t, 2048, device=dev).bfloat16()]
    seen = []
    kernel = row_moves.RowMoves(lambda reason, detail: seen.append(detail))
    kernel.gather(rows, bufs, rows_t)
    kernel.scatter(res, outs, rows_t)
    # The same, but its kept builds launched through Triton's launch path (build[grid]).
    via_triton = row_moves.RowMoves(lambda reason, detail: seen.append(detail))
    kept = row_moves.kept_launch
    row_moves.kept_launch = lambda build: (lambda grid, stream, *a: build[grid](*a))
    try:
        via_triton.gather(rows, bufs, rows_t)
        via_triton.scatter(res, outs, rows_t)
    finally:
        row_moves.kept_launch = kept
    torch.cuda.synchronize()
    assert not seen, seen
    for x, b in zip(rows, bufs):
        assert torch.equal(b[:128], x[rows_t])
    want = torch.zeros_like(outs[0])
    want[rows_t] = res[0][:128]
    assert torch.equal(outs[0], want)
    print(f"kernel == indexing at {t} tokens: yes")

    def ops_gather():
        for x, b in zip(rows, bufs):
            torch.index_select(x, 0, rows_t, out=b[:128])

    def ops_scatter():
        outs[0].zero_()
        outs[0].index_copy_(0, rows_t, res[0][:128])
    # "Triton's entry" (row_moves.launch): the shape checks and Triton's own search for
    # the build from the arguments on each call, as RowMoves did before it kept both.
    for name, ops, entry, kept, launch_path in (
            ("gather", ops_gather, lambda: row_moves.launch(rows_t, rows, bufs, False),
             lambda: kernel.gather(rows, bufs, rows_t), lambda: via_triton.gather(rows, bufs, rows_t)),
            ("scatter", ops_scatter, lambda: row_moves.launch(rows_t, res, outs, True),
             lambda: kernel.scatter(res, outs, rows_t), lambda: via_triton.scatter(res, outs, rows_t))):
        a, b, c, d = (host_us(fn, args.calls) for fn in (ops, entry, kept, launch_path))
        print(f"{name}: PyTorch ops {a:.1f} us, one launch through Triton's entry {b:.1f} us, "
              f"RowMoves {c:.1f} us (its kept build through Triton's launch path {d:.1f} us) "
              f"per call (host, median of {args.calls})")
    # The kept build's launch alone, given the 13 pointers as tensors (Triton's launcher
    # calls data_ptr() and asks the driver about each) or as addresses; then, given
    # addresses, the same build kept with no C entry allowed (C_LAUNCH_VERSIONS empty), so
    # that it goes through the launcher's Python call (``CudaLauncher.__call__``: a
    # closure and two scratch checks per call). Both address launches are checked against
    # indexing first.
    for name, srcs, dsts, scatter in (("gather", rows, bufs, False), ("scatter", res, outs, True)):
        plan = row_moves.make_plan(srcs, dsts, rows_t, scatter)
        stream = kernel._stream(plan.device)
        build = row_moves.launch(rows_t, srcs, dsts, scatter, plan)
        c_entry = _triton._c_entry(build.run) is not None
        versions, _triton.C_LAUNCH_VERSIONS = _triton.C_LAUNCH_VERSIONS, ()
        try:
            via_python = _triton.kept_launch(build)
        finally:
            _triton.C_LAUNCH_VERSIONS = versions
        calls = {}
        kept = kernel._launchers[plan.key]
        for key, fn, raw in (("tensors", kept, False), ("addresses", kept, True), ("python", via_python, True)):
            grid, call_args = row_moves.arguments(plan, rows_t, srcs, dsts, raw=raw)
            calls[key] = lambda fn=fn, grid=grid, call_args=call_args: fn(grid, stream, *call_args)
        for key in ("addresses", "python"):
            for d in dsts:
                d.zero_()
            calls[key]()
            torch.cuda.synchronize()
            if scatter:
                assert torch.equal(outs[0], want), key
            else:
                assert all(torch.equal(b[:128], x[rows_t]) for x, b in zip(rows, bufs)), key
        rounds = [{k: host_us(fn, args.calls) for k, fn in calls.items()} for _ in range(2)]

        def both(k):
            return f"{rounds[0][k]:.1f} / {rounds[1][k]:.1f} us"
        how = "C entry" if c_entry else f"Python call: no C entry on Triton {triton.__version__} or for this build"
        print(f"{name}: the kept launch ({how}) given tensors {both('tensors')}, given addresses "
              f"{both('addresses')}; through the launcher's Python call, given addresses {both('python')} "
              f"(== indexing; two rounds; arguments built beforehand)")


if __name__ == "__main__":
    main()
