"""The trim op's row-moves kernel (dispatch/row_moves.py) against PyTorch indexing:
the cases shared by the CPU test (under Triton's interpreter, in a child process) and
the GPU test."""
import torch

from replay_backend.dispatch import row_moves

# The boundary tensors' kinds (hidden and residual bf16, the mixes fp32, positions
# int64), a row wider than one kernel block, and fp16.
KINDS = [((64,), torch.bfloat16), ((3, 700), torch.bfloat16), ((4,), torch.float32), ((), torch.int64),
         ((4, 4), torch.float32), ((3,), torch.float16)]
T = 45


def check_against_indexing(device: str) -> None:
    """Gather and scatter 1, 3 and 6 tensors with rows at both ends, a block at the end,
    every row and none, then warm; any difference, or any fallback (the kernel must have
    run), fails."""
    seen = []
    moves = row_moves.RowMoves(lambda reason, detail: seen.append(detail))
    gen = torch.Generator().manual_seed(0)

    def rand(*shape, dtype):
        return (torch.randn(*shape, generator=gen) * 100).to(dtype).to(device)

    for k in (1, 3, 6):
        for picked in ([0, 1, 2], [5, 40, 41, T - 1], list(range(T - 32, T)), list(range(T)), []):
            rows_t = torch.tensor(picked, dtype=torch.int64, device=device)
            n = len(picked)
            srcs = [rand(T, *s, dtype=d) for s, d in KINDS[:k]]
            bufs = [torch.full((n + 3, *x.shape[1:]), 7, device=device).to(x.dtype) for x in srcs]
            moves.gather(srcs, bufs, rows_t)
            for x, b in zip(srcs, bufs):
                assert torch.equal(b[:n], x[rows_t]), ("gather", k, picked)
                assert (b[n:] == 7).all(), ("gather wrote padding", k, picked)
            res = [rand(n + 2, *x.shape[1:], dtype=x.dtype) for x in srcs]
            outs = [torch.full_like(x, 5) for x in srcs]
            moves.scatter(res, outs, rows_t)
            for r, o in zip(res, outs):
                want = torch.zeros_like(o)
                want[rows_t] = r[:n]
                assert torch.equal(o, want), ("scatter", k, picked)
    # warm: both directions built on scratch, the tensors themselves untouched
    srcs = [rand(T, *s, dtype=d) for s, d in KINDS]
    copies = [x.clone() for x in srcs]
    moves.warm(srcs, srcs[:2])
    assert all(torch.equal(x, c) for x, c in zip(srcs, copies))
    assert not seen, seen
    if device == "cuda":  # the cases after the first of each build ran from the kept build
        assert moves._launchers
        check_cuda_launches(moves, srcs)


def check_cuda_launches(moves, srcs) -> None:
    """The kept builds launch on the current stream, in its order, and a host tensor is
    refused before any launch (a launcher error would disable the kernel for good)."""
    rows_t = torch.tensor([1, T // 2, T - 1], device="cuda")
    bufs = [torch.zeros((3, *x.shape[1:]), dtype=x.dtype, device="cuda") for x in srcs]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # ~25 ms: a launch on another stream would run first
        for x in srcs:
            x.add_(1)
        moves.gather(srcs, bufs, rows_t)
    side.synchronize()
    for x, b in zip(srcs, bufs):
        assert torch.equal(b, x[rows_t]), "the kept build ran outside the current stream's order"
    why = row_moves.fit([srcs[0].cpu()], [bufs[0]], rows_t, scatter=False)
    assert isinstance(why, str) and "cpu" in why, why
