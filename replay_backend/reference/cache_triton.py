"""One Triton launch per attention op for its cache writes (the reference:
attention_ops._write_kv and attention_reference.compress_kv).

Before attending, every layer writes its new SWA keys into its cache, and a KV source
also runs its compressor. As PyTorch ops that is an ``index_copy_`` per layer and, for
a ratio-2 source, about twenty small ops (concatenate, store the raw pair halves, gather
both halves, softmax, pool, RMS norm, store). Their kernels are tiny, but each costs a
launch's host time, about 0.6 ms per source layer in the H200 profiles: at the start
of a step, where the GPU waits for the host, and in every step whose main layers run
without graphs. Here one program per token does all of its row's writes.

A ratio-2 entry pools an odd position with the even one before it. The reference
writes every row's raw halves before it reads any pair, so a pair whose even half
arrives in the same step reads this step's values. Programs run in no fixed order, so
a program reads its pair's even half from the previous row's inputs when that row
holds the previous slot (rows of one request are consecutive positions in consecutive
slots, batch.py), and from the raw cache otherwise (an earlier step wrote it). Even
positions map to the global pad slot: the reference writes a throw-away value there,
these programs skip it (nothing reads the pad slot, and one writer fewer keeps the
cache deterministic).
"""
from __future__ import annotations

import torch

from ..compat.triton import KeptKernel, tl, triton

SWA_ONLY, RATIO_1, RATIO_2 = 0, 1, 2

if triton is not None:
    @triton.jit
    def _rms(x, NormW, d, dm, eps, D: tl.constexpr):
        w = tl.load(NormW + d, mask=dm, other=0.0).to(tl.float32)
        return x * tl.math.rsqrt(tl.sum(x * x, 0) / D + eps) * w

    # Every integer varies with the step or the model, and no pointer is assumed aligned:
    # one build per dtypes and constexprs serves every call (KeptKernel).
    @triton.jit(do_not_specialize=["kv_stride", "kc_stride", "gate_stride", "glob_pad"],
                do_not_specialize_on_alignment=["KV", "Swa", "Slots", "KC", "Gate", "NormW", "Raw",
                                                "Glob", "Comp"])
    def _write_kernel(KV, kv_stride, Swa, Slots, KC, kc_stride, Gate, gate_stride, NormW, Raw, Glob, Comp,
                      glob_pad, eps, D: tl.constexpr, BLOCK_D: tl.constexpr, MODE: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        slot = tl.load(Slots + t)
        kv = tl.load(KV + t * kv_stride + d, mask=dm)
        tl.store(Swa + slot * D + d, kv.to(Swa.dtype.element_ty), mask=dm)
        if MODE == 1:  # entry p = norm(kv_c[p]), rounded to the input's dtype first as the reference
            x = tl.load(KC + t * kc_stride + d, mask=dm, other=0.0).to(tl.float32)
            y = _rms(x, NormW, d, dm, eps, D).to(KC.dtype.element_ty)
            tl.store(Glob + slot * D + d, y.to(Glob.dtype.element_ty), mask=dm)
        elif MODE == 2:
            k1 = tl.load(KC + t * kc_stride + d, mask=dm, other=0.0).to(tl.float32)
            g1 = tl.load(Gate + t * gate_stride + d, mask=dm, other=0.0).to(tl.float32)
            tl.store(Raw + slot * (2 * D) + d, k1, mask=dm)
            tl.store(Raw + slot * (2 * D) + D + d, g1, mask=dm)
            comp = tl.load(Comp + t)
            if comp != glob_pad:  # an odd position: its entry is complete
                prev = tl.load(Slots + tl.maximum(t - 1, 0))
                if (t > 0) & (prev == slot - 1):  # the even half came in this step
                    k0 = tl.load(KC + (t - 1) * kc_stride + d, mask=dm, other=0.0).to(tl.float32)
                    g0 = tl.load(Gate + (t - 1) * gate_stride + d, mask=dm, other=0.0).to(tl.float32)
                else:
                    k0 = tl.load(Raw + (slot - 1) * (2 * D) + d, mask=dm, other=0.0)
                    g0 = tl.load(Raw + (slot - 1) * (2 * D) + D + d, mask=dm, other=0.0)
                m = tl.maximum(g0, g1)
                e0, e1 = tl.exp(g0 - m), tl.exp(g1 - m)
                pooled = (e0 / (e0 + e1)) * k0 + (e1 / (e0 + e1)) * k1
                y = _rms(pooled, NormW, d, dm, eps, D)
                tl.store(Glob + comp * D + d, y.to(Glob.dtype.element_ty), mask=dm)

    _KERNEL = KeptKernel(_write_kernel)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def write(kv: torch.Tensor, swa: torch.Tensor, slots: torch.Tensor, n: int, compress=None) -> None:
    """``swa[slots] = kv[:n]``, and for a KV source its compressor's writes.

    ``compress``: ``(kv_c, gate, norm_w, raw, glob, comp_slots, eps)``; ``gate`` and
    ``raw`` are None for a ratio-1 source, whose entries use ``slots`` and
    ``comp_slots`` is ignored. Caches are contiguous ``[slots + 1, D]`` (raw ``2 * D``)."""
    if n == 0:
        return
    d = swa.shape[1]
    kv = _rows(kv)
    if compress is None:
        mode, kc, gate, norm_w, raw, glob, comp, pad, eps = SWA_ONLY, kv, kv, kv, swa, swa, slots, 0, 0.0
    else:
        kc, gate, norm_w, raw, glob, comp, eps = compress
        kc, pad = _rows(kc), glob.shape[0] - 1
        if gate is None:
            mode, gate, raw, comp = RATIO_1, kc, glob, slots
        else:
            mode, gate = RATIO_2, _rows(gate)
    args = (kv, kv.stride(0), swa, slots, kc, kc.stride(0), gate, gate.stride(0), norm_w, raw, glob, comp,
            pad, eps)
    consts = {"D": d, "BLOCK_D": triton.next_power_of_2(d), "MODE": mode}
    key = (kv.device.index, mode, d, kv.dtype, swa.dtype, kc.dtype, gate.dtype, norm_w.dtype, raw.dtype,
           glob.dtype, slots.dtype, comp.dtype)
    _KERNEL(key, (n, 1, 1), kv.device, args, consts)
