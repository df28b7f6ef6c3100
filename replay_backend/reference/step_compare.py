"""What a served step wrote, compared with the oracle's: each compared part (the SWA
KV, the replay layers' SWA KV of kept rows, the global entries, the raw halves) layer
by layer, and the logits. The soak (soak.py) and scripts/flashinfer_check.py judge
steps by it."""
from __future__ import annotations

import torch

from ..requests import RequestChunk, kept_len


def written_slots(caches, chunks: list[RequestChunk], batch, kept_only: bool = True
                  ) -> dict[str, list[tuple[torch.Tensor, torch.Tensor, int]]]:
    """Per compared part, (cache tensor, slots, layer) of what the step wrote, by layer.
    The replay layers' SWA counts kept rows only unless ``kept_only`` is false."""
    cfg, window = caches.cfg, batch.window
    slots, kept = [], []
    for i, c in enumerate(chunks):
        base = batch.view.cache_base[i]
        slots.extend(range(base + c.context_len, base + c.seq_len))
        kept.extend(range(base + c.seq_len - kept_len(c, window), base + c.seq_len))
    dev = caches.swa[0].device
    slots_t = torch.tensor(slots, dtype=torch.int64, device=dev)
    kept_t = torch.tensor(kept, dtype=torch.int64, device=dev) if kept_only else slots_t
    # A block's base is even (CacheLayout), so a slot's parity is its position's: odd
    # positions complete the ratio-2 entry slot // 2.
    pairs = slots_t[slots_t % 2 == 1] // 2
    parts: dict[str, list] = {"swa": [], "swa-replay": [], "global": [], "raw": []}
    for layer, swa in enumerate(caches.swa):
        parts["swa-replay" if layer > cfg.cut else "swa"].append((swa, kept_t if layer > cfg.cut else slots_t, layer))
    for src, glob in sorted(caches.glob.items()):
        parts["global"].append((glob, slots_t if cfg.compress_ratio(src) == 1 else pairs, src))
    for src, raw in sorted(caches.raw.items()):
        parts["raw"].append((raw, slots_t, src))
    return parts


def compare_layers(got_kv, want_kv, chunks: list[RequestChunk], got, want, err
                   ) -> dict[str, list[tuple[int | None, float]]]:
    """``err(got, want)`` per compared part of one step, layer by layer: the logits
    (layer None), then each layer's part of the cache slots the step wrote
    (:func:`written_slots`), ``got`` from the runner of ``got_kv`` and ``want`` from
    that of ``want_kv``. Logits that are not finite are infinitely far."""
    logits = err(got.logits.float(), want.logits.float())
    errs = {"logits": [(None, logits if torch.isfinite(got.logits).all() else float("inf"))]}
    mine, theirs = written_slots(got_kv, chunks, got.batch), written_slots(want_kv, chunks, want.batch)
    for part in mine:
        errs[part] = [(layer, err(t.index_select(0, s).float(), w.index_select(0, s).float()))
                      for (t, s, layer), (w, _, _) in zip(mine[part], theirs[part])]
    return errs


def per_part(errs: dict[str, list[tuple[int | None, float]]]) -> dict[str, float]:
    """:func:`compare_layers`' errors as one per part, its worst layer's (``err`` being a
    worst row's, the same as over all the part's rows at once); 0 for a part no layer has."""
    return {part: max((e for _, e in layers), default=0.0) for part, layers in errs.items()}


def compare_step(got_kv, want_kv, chunks: list[RequestChunk], got, want, err) -> dict[str, float]:
    """:func:`compare_layers` as one error per part (:func:`per_part`)."""
    return per_part(compare_layers(got_kv, want_kv, chunks, got, want, err))


def first_over(errs: list[tuple[int | None, float]], limit: float) -> tuple[int | None, float] | None:
    """The lowest layer of a part beyond ``limit`` and the part's worst error, or None
    where every layer is within it."""
    over = [layer for layer, e in errs if not e <= limit]
    if not over:
        return None
    return over[0], max(e for _, e in errs)
