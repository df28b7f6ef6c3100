"""FlashInfer's private parts that the FlashInfer attention relies on: the one adapter.

A plan's work list (which request and which row tile each thread block of the kernel
takes) is written on the host into a pinned staging buffer, then copied into the
wrapper's int workspace on the device. A CUDA-graph plan that does not split its keys
launches the graph's worst-case count of blocks, more than the list holds, and only a
plan that splits tells the extra blocks to stop: without a split they read the list past
its end, where no plan of this size writes, so they take whatever that memory held (a
reused pinned block holds an earlier tensor's bytes) as a request index and read out of
bounds. Cleared once when the wrapper is made, that memory holds only zeros and the
entries of the wrapper's earlier plans, each a (request, tile) of the graph's fixed
request count: work that reads the request's own keys and writes only the rows it owns,
which the block that the plan gives that tile writes with the same values.
"""
from __future__ import annotations

import torch

# FlashInfer 0.6.13's names (prefill.py) of the pinned staging buffer and the int
# workspace it is copied into.
_HOST, _DEVICE = "_pin_memory_int_workspace_buffer", "_int_workspace_buffer"


def clear_plan_memory(wrapper) -> bool:
    """Zero ``wrapper``'s plan staging buffer and int workspace; False, touching nothing,
    where this FlashInfer does not keep them as the adapter knows them (two byte tensors
    of one size, the first on the host)."""
    host, device = getattr(wrapper, _HOST, None), getattr(wrapper, _DEVICE, None)
    known = (isinstance(host, torch.Tensor) and isinstance(device, torch.Tensor)
             and host.dtype == device.dtype == torch.uint8 and host.numel() == device.numel()
             and host.device.type == "cpu")
    if known:
        host.zero_()
        device.zero_()
    return known
