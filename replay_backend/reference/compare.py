"""Comparisons used by verify, the demo and the tests: logits and replay-layer KV."""
from __future__ import annotations

import torch

from ..batch import StepBatch
from ..requests import kept_len
from .kv_caches import KVCaches


def replay_kv_slots(batch: StepBatch) -> torch.Tensor:
    """Cache slots of the rows the replay layers keep (the only ones a later step reads)."""
    slots = []
    for i, r in enumerate(batch.requests):
        k = kept_len(r, batch.window)
        base = batch.view.cache_base[i]
        slots.extend(range(base + r.seq_len - k, base + r.seq_len))
    return torch.tensor(slots, dtype=torch.int64)


def kept_kv(caches: KVCaches, batch: StepBatch) -> torch.Tensor:
    """The replay layers' SWA KV of the batch's kept rows, ``[layers, rows, head_dim]``, in fp32."""
    slots = replay_kv_slots(batch).to(caches.swa[0].device)
    return torch.stack([caches.swa[layer].index_select(0, slots).float() for layer in caches.cfg.replay_layers])


def max_abs_err_kv(a: KVCaches, b: KVCaches, batch: StepBatch) -> float:
    """Largest difference of the SWA KV the replay layers wrote for kept rows."""
    if not a.cfg.replay_layers:
        return 0.0
    got, want = kept_kv(a, batch), kept_kv(b, batch)
    return max_abs_err(got, want) if got.numel() else 0.0


def max_abs_err(x: torch.Tensor, y: torch.Tensor) -> float:
    return (x.float() - y.float()).abs().max().item()


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want||, in fp32."""
    want = want.float()
    return ((got.float() - want).norm() / want.norm()).item()


def row_rel_l2(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Each row's (the last dim's) relative L2 distance, in fp32; a row that is not
    finite is infinitely far, so no comparison with a limit lets it pass."""
    got, want = got.float(), want.float()
    rows = (got - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-6)
    return torch.where(torch.isfinite(rows), rows, torch.inf)


def worst_row_rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest :func:`row_rel_l2`: one wrong row is not averaged away by the right
    ones."""
    return row_rel_l2(got, want).max().item() if got.numel() else 0.0


# 16-bit comparisons: the reference model's rounding-noise band in bf16 (relative L2 of
# last-row logits; tests/test_bench_accuracy.py holds the model to it) and how
# many bands away a result may land before it counts as an error.
BF16_BAND = 0.02
BAND_FACTOR = 1.5


def within_band(got: torch.Tensor, want: torch.Tensor) -> bool:
    """A 16-bit result agrees: relative L2 at most ``BAND_FACTOR * BF16_BAND``."""
    return rel_l2(got, want) <= BAND_FACTOR * BF16_BAND


def default_tolerance(dtype: torch.dtype) -> float:
    """Absolute tolerance for compiled-vs-oracle comparisons (float reassociation only)."""
    return {torch.float32: 1e-3, torch.float64: 1e-8}.get(dtype, 5e-2)
