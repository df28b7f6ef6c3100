"""How a step's metadata reaches the device: one copy, and for served steps one address.

Every step's device metadata (slot mappings, replay rows, attention row blocks, and for
served steps the token ids and positions) travels in one host-to-device copy, each
field a view of it. A serving backend copies it into a :class:`MetadataBuffer`, a fixed
region of device memory allocated once at capture, so the fields have the same address
in every served step. The trim op's gather graph reads
the replay count and rows at the buffer's head in place: they are the first field of
every step's layout, so no per-step copy into the graph's own index buffer is needed
(dispatch/trim_io.py).

A fixed buffer means a batch's device fields are valid until its backend builds the
next batch. The copy is queued in stream order, so a step the GPU is still running
reads its own metadata; what cannot be allowed is a batch built, then overwritten by a
later build, then run. Each batch records the buffer's generation when it was built and
:meth:`MetadataBuffer.check` refuses a stale one with an error instead of running it on
another step's metadata. A batch built elsewhere and run on the model has its count
and rows staged at the head, which makes the buffer's batches stale as well.
"""
from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """``t`` (a host tensor) on ``device`` without holding the host back. A copy from
    pageable memory synchronises the stream first, so it would wait for every kernel
    queued before it (the previous step, or the layers before a replay region): go
    through pinned memory, whose block the caching host allocator keeps until the copy
    has run."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def metadata_capacity(max_tokens: int, max_requests: int, view_fields=None) -> int | str:
    """An upper bound on the int64 elements of one step's metadata (``build_step_batch``
    with ``inputs_in_metadata``) for at most ``max_tokens`` tokens and ``max_requests``
    requests, or why there is none (a ``ViewField`` without a bound). Per token: ids,
    positions and slots, and for replay rows the row, slot and position (6); the count
    and logits indices: 1 + requests; each field in both views. One pad element after
    each part keeps the next one 16-byte aligned."""
    total = 6 * max_tokens + 1 + max_requests + 7
    for name, f in (view_fields or {}).items():
        elements = f.capacity(max_tokens, max_requests)
        if elements is None:
            return f"ViewField {name!r} has no max_rows bound"
        total += 2 * (elements + 1)
    return total


class MetadataBuffer:
    """A serving backend's fixed device memory for its served steps' metadata."""

    def __init__(self, capacity: int, device) -> None:
        # Zeros, not empty: the gather graph's warm-up and capture read the head before
        # any step was built into it (any values are safe there, see trim_io.py).
        self.data = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.generation = 0

    def place(self, flat: torch.Tensor) -> torch.Tensor:
        """Copy ``flat`` (a 1-D int64 host tensor) to the buffer's start; returns the
        view it occupies. The batches built before this one become stale."""
        n = flat.shape[0]
        if n > self.data.shape[0]:
            raise ValueError(f"step metadata of {n} elements exceeds the backend's metadata buffer "
                             f"({self.data.shape[0]}): a ViewField's max_rows is below what its build returns")
        dst = self.data[:n]
        if self.data.is_cuda:
            dst.copy_(flat.pin_memory(), non_blocking=True)  # pinned: see to_device
        else:
            dst.copy_(flat)
        self.generation += 1
        return dst

    def overwritten(self) -> None:
        """Something other than :meth:`place` wrote into the buffer (the trim op staged
        another batch's rows at its head): every batch built so far is stale."""
        self.generation += 1

    def check(self, generation: int) -> None:
        if generation != self.generation:
            raise RuntimeError(
                "stale StepBatch: its device metadata lives in its backend's metadata buffer, which "
                "was overwritten after it was built (by a later build_batch or idle_step, or by the "
                "rows of a batch built elsewhere and run on that model). Served steps' metadata has one "
                "fixed address, read in place by the trim op's graphs: run each batch before "
                "building the next one.")


def aligned_fields(parts: list[torch.Tensor], device, buffer: MetadataBuffer | None = None
                   ) -> list[torch.Tensor]:
    """``parts`` (1-D int64 host tensors) on ``device`` in one copy (into ``buffer`` when
    given), as views that each start 16-byte aligned (an even element offset; a part of
    odd length is followed by one pad element). Triton specialises a pointer argument on
    16-byte alignment: a field whose offset moved with the step's sizes would build new
    variants of the kernels that read it on the first step where it fell odd, inside
    that step (seconds of Triton builds)."""
    chunks, starts, end = [], [], 0
    pad = parts[0].new_zeros(1)
    for x in parts:
        n = x.shape[0]  # not len(): Tensor.__len__ is Python, and this runs per step
        chunks.append(x)
        starts.append(end)
        end += n
        if n % 2:
            chunks.append(pad)
            end += 1
    flat = torch.cat(chunks)
    flat = buffer.place(flat) if buffer is not None else to_device(flat, device)
    return [flat[a:a + x.shape[0]] for a, x in zip(starts, parts)]
