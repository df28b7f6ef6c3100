"""FlashInfer's paged prefill wrapper emulated in PyTorch from its documented semantics.

The CPU tests run ``attention_impl="flashinfer"`` on it (StepRunner's
``attention_wrapper_factory``), and ``scripts/flashinfer_check.py`` holds FlashInfer's
kernels to it on the GPU, part by part. It is written from FlashInfer's documented
semantics, not from this project's attention:
request i's query rows are ``qo_indptr[i]:qo_indptr[i+1]`` and its keys the pages
``kv_indices[kv_indptr[i]:kv_indptr[i+1]]`` (page size 1: one slot each). With
``causal``, row r of a request of ``L`` rows and ``K`` keys sees key j when
``j <= r + K - L``, and with ``window_left >= 0`` only when also
``j >= r + K - L - window_left``. The key tensor is the value tensor (one latent). The
log-sum-exp is base 2; a row that sees no key gets output 0 and lse -inf (FlashInfer's
own is a large negative number: either weighs nothing). As the real wrapper does,
``run`` refuses a query whose row count is not the plan's (here its kernel module, which
the run ends in, as FlashInfer's does), and a CUDA-graph wrapper
refuses a plan whose request count differs from its buffers', or whose page table is
longer than its page-index buffer. A causal request with keys but fewer keys than rows
is refused at ``plan``: FlashInfer's kernels mask such a request wrongly (they compute
the mask's start from ``K - L`` unsigned). As there, a wrapper allocates buffers when
made and ``plan`` copies into them in place (a wrapper made under
``torch.inference_mode`` cannot plan outside it).

A CUDA-graph plan that does not split its keys lists one work item per row tile of
each request, staged in a pinned host buffer and copied whole into the int workspace,
and the kernel launches the graph's worst-case count of blocks: the blocks past the
list read what the staging buffer held before (reference/flashinfer_compat.py). The
emulation's buffer starts with bytes that are no request index, and ``run`` raises
where such a block would read out of bounds, as the GPU faults.
"""
from __future__ import annotations

import math

import torch

WORK_BYTES = 1 << 20  # the emulated int workspace


class EmulatedPrefillWrapper:
    def __init__(self, graph_buffers: dict | None) -> None:
        self.graph_batch = None if graph_buffers is None else graph_buffers["qo_indptr_buf"].numel() - 1
        self.graph_buffers = graph_buffers
        self.kv_lens_buffer = torch.empty(32768, dtype=torch.int32)  # FlashInfer's own size
        # FlashInfer 0.6.13's names; the staging buffer as a reused pinned block may hold it
        self._int_workspace_buffer = torch.zeros(WORK_BYTES, dtype=torch.uint8)
        self._pin_memory_int_workspace_buffer = torch.full((WORK_BYTES,), 0xAB, dtype=torch.uint8)
        self.work: tuple[int, int] | None = None  # a graph plan's (listed, launched) work items
        self._cached_module = _Kernels()
        self.plans = 0
        self.plan_rows: list[int] = []
        self.staged_in: list[int] = []  # the staging buffer of each plan, by address

    def plan(self, *, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, seq_lens,
             num_qo_heads, num_kv_heads, head_dim_qk, page_size, causal, window_left, sm_scale,
             q_data_type, kv_data_type, disable_split_kv, max_token_per_sequence=None) -> None:
        assert page_size == 1 and num_kv_heads == 1 and causal
        batch = qo_indptr.numel() - 1
        if self.graph_batch is not None and batch != self.graph_batch:
            raise ValueError(f"graph-mode wrapper planned with batch {batch}, built for {self.graph_batch}")
        lens = paged_kv_indptr[1:] - paged_kv_indptr[:-1]
        assert torch.equal(lens, seq_lens) and torch.equal(paged_kv_last_page_len, (lens > 0).int())
        rows = qo_indptr[1:] - qo_indptr[:-1]
        # FlashInfer takes it as given instead of computing it from qo_indptr
        longest = int(rows.max()) if batch else 0
        if max_token_per_sequence is not None and max_token_per_sequence != longest:
            raise ValueError(f"max_token_per_sequence {max_token_per_sequence}, the longest request has "
                             f"{longest} rows")
        short = ((lens > 0) & (lens < rows)).nonzero().flatten().tolist()
        if short:
            raise ValueError(f"requests {short}: fewer keys than query rows ({lens[short].tolist()} < "
                             f"{rows[short].tolist()}), which FlashInfer's causal mask gets wrong")
        self.kv_lens_buffer[:batch].copy_(seq_lens)
        if self.graph_buffers is not None:
            if paged_kv_indices.numel() > self.graph_buffers["paged_kv_indices_buf"].numel():
                raise ValueError("The length of paged_kv_indices exceeds the allocated buffer size.")
            self.graph_buffers["qo_indptr_buf"].copy_(qo_indptr)
            self.graph_buffers["paged_kv_indptr_buf"].copy_(paged_kv_indptr)
            self.graph_buffers["paged_kv_indices_buf"][:paged_kv_indices.numel()].copy_(paged_kv_indices)
        self.split = not disable_split_kv
        self.work = None
        if self.graph_buffers is not None and not self.split:
            self.work = self._stage_work_list(rows, num_qo_heads)
        self.qo = qo_indptr.tolist()
        self.kv = paged_kv_indptr.tolist()
        self.indices = paged_kv_indices.clone()
        self.window_left, self.scale = window_left, sm_scale
        self.plans += 1
        self.plan_rows.append(self.qo[-1])
        staging = getattr(self, "_pin_memory_int_workspace_buffer", None)  # a subclass may keep none
        self.staged_in.append(None if staging is None else staging.data_ptr())

    def _stage_work_list(self, rows: torch.Tensor, heads: int) -> tuple[int, int]:
        """A CUDA-graph plan's work list without a split: each request's rows packed with
        its ``heads`` query heads, in tiles of FlashInfer's size for the graph's longest
        possible request; the blocks launched, its bound for the graph's rows."""
        total, batch = int(rows.sum()), rows.numel()
        longest = (total - batch + 1) * heads
        tile = 128 if longest > 64 else 64 if longest > 16 else 16
        items = [i for i, r in enumerate(rows.tolist()) for _ in range(-(-r * heads // tile))]
        launched = -(-total * heads // tile) + batch - 1
        if 4 * launched > WORK_BYTES:
            raise ValueError(f"Out of workspace memory in AlignedAlloactor (emulated: {launched} work items)")
        host = self._pin_memory_int_workspace_buffer[:4 * launched]
        host.view(torch.int32)[:len(items)] = torch.tensor(items, dtype=torch.int32)
        self._int_workspace_buffer[:4 * launched] = host
        return len(items), launched

    def run(self, q, kv, *, out, lse, return_lse) -> None:
        assert return_lse
        self._cached_module.paged_run(self._int_workspace_buffer, self.work, self.qo, self.kv, self.indices, q,
                                      kv[0], kv[1], out, lse, self.window_left, self.scale)


class _Kernels:
    """The emulated kernel module: as FlashInfer's wrapper does, ``run`` ends in
    ``paged_run``, which reads the plan from its arguments alone. It refuses a call the
    real wrapper would refuse (``run``'s checks) or the GPU would fault on, whichever
    path the call took to it."""

    @staticmethod
    def paged_run(int_workspace, work, qo, kv_indptr, indices, q, k, v, out, lse, window_left, scale) -> None:
        assert k is v, "the key cache is the value cache (one latent)"
        if q.shape[0] != qo[-1]:
            raise ValueError(f"q has {q.shape[0]} rows, the plan {qo[-1]}")
        k = k.reshape(k.shape[0], -1)
        if work is not None:
            listed, launched = work
            extra = int_workspace[:4 * launched].view(torch.int32)[listed:]
            wild = extra[(extra < 0) | (extra >= len(qo) - 1)]
            if wild.numel():
                raise RuntimeError(f"CUDA error: an illegal memory access was encountered (emulated: a block "
                                   f"past the plan's {listed} work items read request {int(wild[0])} of "
                                   f"{len(qo) - 1})")
        out.zero_()
        lse.fill_(-math.inf)
        for i in range(len(qo) - 1):
            r0, r1, n = qo[i], qo[i + 1], qo[i + 1] - qo[i]
            keys = k[indices[kv_indptr[i]:kv_indptr[i + 1]].long()].float()
            if n == 0 or keys.shape[0] == 0:
                continue
            r = torch.arange(n, device=keys.device)[:, None]
            j = torch.arange(keys.shape[0], device=keys.device)[None, :]
            shift = keys.shape[0] - n
            seen = j <= r + shift
            if window_left >= 0:
                seen &= j >= r + shift - window_left
            s = torch.einsum("qhd,kd->hqk", q[r0:r1].float(), keys) * scale
            s = s.masked_fill(~seen[None], -math.inf)
            total = torch.logsumexp(s, dim=-1)  # [heads, rows]
            p = torch.exp(s - total[..., None]).nan_to_num(0.0)
            out[r0:r1] = torch.einsum("hqk,kd->qhd", p, keys).to(out.dtype)
            lse[r0:r1] = (total / math.log(2.0)).transpose(0, 1)


def factory(graph_buffers: dict | None) -> EmulatedPrefillWrapper:
    return EmulatedPrefillWrapper(graph_buffers)
