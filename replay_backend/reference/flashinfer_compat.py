"""FlashInfer's private parts that the FlashInfer attention relies on: the one adapter.

A plan's work list (which request and which row tile each thread block of the kernel
takes) is written on the host into a pinned staging buffer, then copied into the
wrapper's int workspace on the device by a copy queued on the stream.

Two facts about that memory matter here:

* A CUDA-graph plan that does not split its keys launches the graph's worst-case count
  of blocks, more than the list holds, and only a plan that splits tells the extra
  blocks to stop: without a split they read the list past its end, where no plan of
  this size writes, so they take whatever that memory held (a reused pinned block holds
  an earlier tensor's bytes) as a request index and read out of bounds. Cleared when
  the wrapper is made, that memory holds only zeros and the entries of the wrapper's
  earlier plans, each a (request, tile) of the graph's fixed request count: work that
  reads the request's own keys and writes only the rows it owns, which the block that
  the plan gives that tile writes with the same values.
* The queued copy reads the staging buffer when the GPU reaches it, so a plan must not
  write into a staging buffer whose previous copy is still queued. FlashInfer takes the
  staging buffer from the wrapper at each ``plan()``, so a caller may hand it one of
  several buffers in turn (:func:`stage_plans_in`) instead of waiting for the GPU.
"""
from __future__ import annotations

import torch

# FlashInfer 0.6.13's names (prefill.py) of the pinned staging buffer and the int
# workspace it is copied into.
_HOST, _DEVICE = "_pin_memory_int_workspace_buffer", "_int_workspace_buffer"


def plan_memory(wrapper) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``wrapper``'s staging buffer and int workspace, or None where this FlashInfer does
    not keep them as the adapter knows them (two byte tensors of one size, the first on
    the host)."""
    host, device = getattr(wrapper, _HOST, None), getattr(wrapper, _DEVICE, None)
    known = (isinstance(host, torch.Tensor) and isinstance(device, torch.Tensor)
             and host.dtype == device.dtype == torch.uint8 and host.numel() == device.numel()
             and host.device.type == "cpu")
    return (host, device) if known else None


def clear_plan_memory(wrapper) -> bool:
    """Zero ``wrapper``'s staging buffer and int workspace; False, touching nothing,
    where :func:`plan_memory` does not find them."""
    memory = plan_memory(wrapper)
    if memory is not None:
        for t in memory:
            t.zero_()
    return memory is not None


def staging_buffer(wrapper) -> torch.Tensor:
    """``wrapper``'s staging buffer, which the start-up probe found on a wrapper like it."""
    memory = plan_memory(wrapper)
    if memory is None:
        raise RuntimeError("a FlashInfer wrapper without the plan memory that the start-up probe's had")
    return memory[0]


def stage_plans_in(wrapper, host: torch.Tensor) -> None:
    """Make ``host`` (a byte tensor of :func:`staging_buffer`'s size) the staging buffer
    of ``wrapper``'s next plans."""
    own = staging_buffer(wrapper)
    if host.dtype != torch.uint8 or host.numel() != own.numel():
        raise ValueError(f"a staging buffer of {host.numel()} {host.dtype} for one of {own.numel()} bytes")
    setattr(wrapper, _HOST, host)
