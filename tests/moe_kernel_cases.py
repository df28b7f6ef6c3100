"""The grouped MoE's sort, SwiGLU and combine kernels (reference/moe_triton.py) against
the PyTorch ops they replace (a stable sort, a division and a search; a SiLU and a
product; an unsort, a product, a sum and casts), and the whole op with and without
them: the cases shared by the CPU test (under Triton's interpreter, in a child
process) and the GPU test."""
import torch

from replay_backend.reference import moe_triton
from replay_backend.reference.moe import MoE


def _routings(device: str):
    """(top_i, num_experts): one to eight blocks of pairs, the last one partial, top_k
    1 and 2, empty and crowded experts, and expert counts that are not a power of two."""
    gen = torch.Generator().manual_seed(0)
    cases = []
    for tokens, k, experts in ((3, 2, 4), (150, 2, 16), (600, 1, 6), (1000, 2, 16)):
        scores = torch.rand(tokens, experts, generator=gen)
        if tokens == 1000:
            scores[:, 5] += 2  # expert 5 in every token's top k: one group dominates
            scores[:, 9] -= 2  # expert 9 in none: an empty group
        cases.append((scores.topk(k, dim=-1).indices.to(device), experts))
    return cases


def _reference_route(top_i: torch.Tensor, num_experts: int):
    experts, order = torch.sort(top_i.reshape(-1), stable=True)
    ends = torch.searchsorted(experts, torch.arange(num_experts, device=top_i.device), right=True,
                              out_int32=True)
    return order, ends


def check_against_reference(device: str) -> None:
    """Every routing's slots are the stable sort's order and its group ends the
    search's; every combine equals the PyTorch ops to the bit, in fp32 and bf16 (on
    the CPU bf16 within the interpreter's rounding)."""
    gen = torch.Generator().manual_seed(1)
    for top_i, experts in _routings(device):
        t, k = top_i.shape
        src_rows, slot_of, ends = moe_triton.route(top_i, experts)
        order, want_ends = _reference_route(top_i, experts)
        assert torch.equal(src_rows, order // k), (t, k, experts)
        assert torch.equal(ends, want_ends), (ends, want_ends)
        # slot_of is the sort's inverse permutation: pair order[p] sits at slot p
        assert torch.equal(slot_of[order].long(), torch.arange(t * k, device=device))
        if device == "cpu" and t > 150:
            continue  # the interpreter runs one program at a time: the combine on the small cases
        top_w = torch.rand(t, k, generator=gen).to(device)
        top_w = top_w / top_w.sum(-1, keepdim=True)
        if t <= 150:  # silu(g) * u: rows of [g | u], I not a power of two in fp32
            for dtype, inter in ((torch.float32, 48), (torch.bfloat16, 1100)):
                gu = (torch.randn(t * k, 2 * inter, generator=gen) * 3).to(dtype).to(device)
                g, u = gu.chunk(2, dim=-1)
                _same(moe_triton.silu_mul(gu), torch.nn.functional.silu(g) * u, device)
        for dtype, hidden in ((torch.float32, 96), (torch.bfloat16, 1100)):
            y = (torch.randn(t * k, hidden, generator=gen) * 4).to(dtype).to(device)  # rows in sorted order
            got = moe_triton.combine(y, top_w, slot_of, dtype)
            unsorted = torch.empty_like(y).index_copy_(0, order, y).view(t, k, -1)
            want = (unsorted.float() * top_w[..., None]).sum(1).to(dtype)
            _same(got, want, device)

    # The whole op, where this torch has grouped GEMMs on the device (CUDA; CPU in 2.13)
    moe = MoE(64, 6, 2, 32, 32, gen, impl="grouped").to(device, torch.bfloat16)
    x = torch.randn(300, 64, generator=gen).to(device, torch.bfloat16)
    top_w, top_i = torch.topk(torch.softmax(x.float() @ moe.router.float().t(), dim=-1), 2, dim=-1)
    args = (x, top_w / top_w.sum(-1, keepdim=True), top_i, moe.w_gate_up, moe.w_down, moe.expert_ids)
    try:
        want = torch.ops.dsv41.moe_grouped(*args, False)
    except (RuntimeError, NotImplementedError) as e:
        if device != "cpu":
            raise
        print(f"the whole op not checked: torch._grouped_mm on CPU: {e}")  # the GPU test checks it
        return
    got = torch.ops.dsv41.moe_grouped(*args, True)
    if device == "cpu":  # the interpreter's roundings, carried through the second GEMM
        torch.testing.assert_close(got, want, atol=0.01 * want.abs().max().item(), rtol=0)
    else:
        _same(got, want, device)


def _same(got: torch.Tensor, want: torch.Tensor, device: str) -> None:
    """Equal to the bit on the GPU. Under Triton's interpreter, which rounds fp32 to
    bf16 toward zero (the GPU to nearest) and computes exp with numpy, within one
    rounding of the dtype."""
    if device != "cpu":
        assert torch.equal(got, want), (got.dtype, (got.float() - want.float()).abs().max().item())
    else:
        eps = torch.finfo(got.dtype).eps
        torch.testing.assert_close(got, want, atol=eps, rtol=2 * eps)
