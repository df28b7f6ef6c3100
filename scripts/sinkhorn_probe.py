"""The fused Sinkhorn as an opaque op against a ``triton_op`` (GPU).

The model's op (``dsv41::sinkhorn``) is opaque to Inductor. As a ``triton_op``
Inductor would launch the kernel from the piece's own code. This probe compiles the
hyper-connection mix (a bf16 projection with fp32 results, its Sinkhorn part a strided
view of it) with each variant and reports, per variant: the max error against the
reference Sinkhorn at several token counts (one compile, dynamic token count), the
stride the compiled code hands the kernel, and the host time per call of the compiled
mix. Variant ``a`` passes the input's row stride as traced, ``b`` makes the input
contiguous first.

usage: python3 scripts/sinkhorn_probe.py
"""
from __future__ import annotations

import time

import torch

from replay_backend.reference import sinkhorn_triton as st
from replay_backend.reference.layers import mm_fp32, sinkhorn

HC, HIDDEN, ITERS = 4, 256, 20


def _launch(x: torch.Tensor, stride: int) -> torch.Tensor:
    t = x.shape[0]
    out = torch.empty((t, HC, HC), dtype=torch.float32, device=x.device)
    torch.library.wrap_triton(st._sinkhorn_kernel)[(st.triton.cdiv(t, st.BLOCK),)](
        x, out, t, STRIDE_ROW=stride, ITERS=ITERS, HC=HC, BLOCK_T=st.BLOCK)
    return out


@torch.library.triton_op("probe::sinkhorn_a", mutates_args=())
def sinkhorn_a(logits: torch.Tensor) -> torch.Tensor:
    return _launch(logits, logits.stride(0))


@torch.library.triton_op("probe::sinkhorn_b", mutates_args=())
def sinkhorn_b(logits: torch.Tensor) -> torch.Tensor:
    return _launch(logits.contiguous(), HC * HC)


def mix(op):
    def run(stream, weight, bias):
        t = stream.shape[0]
        flat = stream.reshape(t, -1)
        scale = torch.rsqrt(flat.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        m = mm_fp32(flat, weight) * scale + bias.float()
        return torch.sigmoid(m[:, :HC]), op(m[:, 2 * HC:].view(t, HC, HC))
    return run


def main() -> None:
    if not (torch.cuda.is_available() and st.available()):
        raise SystemExit("sinkhorn_probe needs a CUDA device and Triton")
    from torch._inductor.utils import run_and_get_code

    gen = torch.Generator().manual_seed(0)
    n = 2 * HC + HC * HC
    weight = (torch.randn(n, HC * HIDDEN, generator=gen) * (HC * HIDDEN) ** -0.5).cuda().bfloat16()
    bias = (torch.randn(n, generator=gen) * 0.5).cuda().bfloat16()
    reference = mix(lambda logits: sinkhorn(logits.float(), ITERS))
    variants = {"opaque_op": lambda logits: torch.ops.dsv41.sinkhorn(logits, ITERS),
                "triton_op_a": torch.ops.probe.sinkhorn_a, "triton_op_b": torch.ops.probe.sinkhorn_b}
    for name, op in variants.items():
        torch._dynamo.reset()
        fn = torch.compile(mix(op), dynamic=True, fullgraph=True)
        errs, launch = {}, []
        for t in (300, 1000, 4096):
            stream = torch.randn(t, HC, HIDDEN, device="cuda", dtype=torch.bfloat16)
            if not launch:
                got, code = run_and_get_code(fn, stream, weight, bias)
                launch = [ln.strip() for c in code for ln in c.splitlines()
                          if "_sinkhorn_kernel" in ln and ".run(" in ln]
            else:
                got = fn(stream, weight, bias)
            want = reference(stream, weight, bias)
            errs[t] = max((g.float() - w.float()).abs().max().item() for g, w in zip(got, want))
        stream = torch.randn(4096, HC, HIDDEN, device="cuda", dtype=torch.bfloat16)
        for _ in range(20):
            fn(stream, weight, bias)
        torch.cuda.synchronize()
        reps = 300
        t0 = time.perf_counter()
        for _ in range(reps):  # launches only: the host time per call
            fn(stream, weight, bias)
        host_us = (time.perf_counter() - t0) / reps * 1e6
        torch.cuda.synchronize()
        print(f"{name}: max error by tokens {errs}, host {host_us:.1f} us per call"
              + (f"; launch: {launch[0]}" if launch else ""), flush=True)


if __name__ == "__main__":
    main()
