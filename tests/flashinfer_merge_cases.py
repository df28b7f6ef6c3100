"""The merge of two attention states and a sink (attention_merge.merge) against one
softmax over the union of the keys: the cases shared by the CPU tests (the PyTorch
merge, and the Triton kernel under the interpreter in a child process) and the GPU
test (the kernel compiled)."""
import math

import torch

from replay_backend.reference import attention_merge


def _state(s: torch.Tensor, v: torch.Tensor):
    """Output and base-2 lse of a softmax over scores ``s`` [rows, heads, keys]; a row
    without keys gets what a kernel that divides 0 by 0 would give: NaN output."""
    total = torch.logsumexp(s, dim=-1)
    o = torch.einsum("rhk,kd->rhd", torch.exp(s - total[..., None]), v)
    return o, total / math.log(2.0)


def check_merge(device: str, kernel: bool = True) -> None:
    gen = torch.Generator().manual_seed(0)
    rows, heads, d, na, nb = 7, 5, 16, 9, 6
    for dtype in (torch.float32, torch.bfloat16):
        for with_b, permuted in ((True, False), (True, True), (False, False)):
            v = torch.randn(na + nb, d, generator=gen)
            s = torch.randn(rows, heads, na + nb, generator=gen) * 3
            s[0, :, :na] = -math.inf  # row 0: no key in the first state
            s[1, :, na:] = -math.inf  # row 1: none in the second
            if not with_b:
                s[:, :, na:] = -math.inf
            s[2, 1, :na] = -math.inf  # one head of row 2: none in the first either
            sink = torch.randn(heads, generator=gen)
            full = torch.cat([s, sink[None, :, None].expand(rows, heads, 1)], dim=-1)
            want = torch.einsum("rhk,kd->rhd", torch.softmax(full, dim=-1)[..., :-1], v)
            o_a, lse_a = _state(s[..., :na], v[:na])
            o_b, lse_b = _state(s[..., na:], v[na:]) if with_b else (None, None)
            b_rows = None
            if permuted:  # the second state computed with its rows in another order
                perm = torch.randperm(rows, generator=gen)
                o_b, lse_b = o_b[perm], lse_b[perm]
                # int32 as planned; int64 as a caller may hold it
                b_rows = torch.argsort(perm).to(device, torch.int32 if dtype == torch.float32 else torch.int64)
            to = lambda t: None if t is None else t.to(device)  # noqa: E731
            out = torch.full((rows, heads + 2, d), 9.0, dtype=dtype, device=device)[:, 1:heads + 1]
            args = (out, to(o_a).to(dtype), to(lse_a), to(o_b) if o_b is None else to(o_b).to(dtype), to(lse_b),
                    sink.to(device), b_rows)
            if kernel:
                attention_merge._merge_triton(*args)
            else:
                attention_merge.merge(*args)
            tol = 1e-5 if dtype == torch.float32 else 3e-2
            err = (out.float().cpu() - want).abs().max().item()
            assert err < tol, (dtype, with_b, permuted, err)
