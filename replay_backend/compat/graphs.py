"""CUDA graphs and streams (private torch): output aliases that do not own their memory,
and the current stream's raw handle."""
from __future__ import annotations

from typing import Callable

import torch


def has_non_owning_alias() -> bool:
    return hasattr(torch._C, "_construct_storage_from_data_pointer")


def non_owning_alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s memory that does not keep that memory allocated.

    Graph outputs are held this way, so memory that the step frees returns to the graph
    pool and later captures reuse it (the same trick as Inductor's CUDA graph trees)."""
    storage = t.untyped_storage()
    alias = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), t.device, storage.nbytes())
    return torch.empty((0,), dtype=t.dtype, device=t.device).set_(
        alias, t.storage_offset(), t.size(), t.stride())


def raw_stream_getter() -> Callable[[int], int]:
    """``index -> the current stream's handle`` on CUDA device ``index``: the private C
    call where this torch has it (what Triton uses too), else the public one, which goes
    through a Stream object."""
    fast = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if fast is not None:
        return fast
    return lambda index: torch.cuda.current_stream(index).cuda_stream
