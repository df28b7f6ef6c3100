"""DSv4.1 attention in plain PyTorch, on CPU and GPU: the oracle every kernel is
checked against. One softmax over the union of a layer's own SWA keys and the global
keys of its source, with a per-head sink logit in the denominator; the single shared
latent is both key and value."""
from __future__ import annotations

import torch

from .layers import rms_norm


# Elements of one [heads, rows, keys] score block; bounds temporary memory.
_SCORE_BUDGET = 1 << 25


def attend_request(q: torch.Tensor, swa: torch.Tensor, glob: torch.Tensor | None, ratio: int,
                   seq_len: int, floor: int, window: int, sink: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """Attention for one request whose ``n`` rows are its last ``n`` positions.

    ``swa`` / ``glob`` are the request's own cache regions (position-indexed, global
    entries entry-indexed). Row at position p reads SWA keys in
    ``[max(p - W + 1, floor), p]`` and the global entries complete at p.
    """
    n, nh, _ = q.shape
    p0 = seq_len - n
    dev = q.device
    n_glob_max = 0 if glob is None else (seq_len if ratio == 1 else seq_len // 2)
    rows_per_block = max(16, _SCORE_BUDGET // max(1, nh * (window + n + n_glob_max)))
    outs = []
    for a in range(0, n, rows_per_block):
        b = min(n, a + rows_per_block)
        pa, pb = p0 + a, p0 + b - 1
        qp = torch.arange(pa, pb + 1, device=dev)
        # A block wholly below the floor reads no SWA keys (global keys and sink only).
        lo = min(max(0, pa - window + 1, floor), pb + 1)
        kp = torch.arange(lo, pb + 1, device=dev)
        keys = swa[lo:pb + 1]
        mask = (kp[None, :] <= qp[:, None]) & (kp[None, :] >= torch.clamp(qp - window + 1, min=floor)[:, None])
        if glob is not None:
            # Entry m of a ratio-r cache is complete once position r*m + r - 1 exists.
            g_hi = pb + 1 if ratio == 1 else (pb + 1) // 2
            count = qp + 1 if ratio == 1 else (qp + 1) // 2
            gmask = torch.arange(g_hi, device=dev)[None, :] < count[:, None]
            keys = torch.cat([glob[:g_hi], keys])
            mask = torch.cat([gmask, mask], dim=1)
        kf = keys.float()
        s = torch.einsum("qhd,kd->hqk", q[a:b].float(), kf) * scale
        s = s.masked_fill(~mask[None], float("-inf"))
        m = torch.maximum(s.amax(-1), sink.float()[:, None])
        e = torch.exp(s - m[..., None])
        denom = e.sum(-1) + torch.exp(sink.float()[:, None] - m)
        o = torch.einsum("hqk,kd->qhd", e, kf) / denom.transpose(0, 1)[..., None]
        outs.append(o)
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def compress_kv(layer: int, kv_c: torch.Tensor, gate: torch.Tensor | None, norm_w: torch.Tensor,
                n: int, slots: torch.Tensor, comp_slots: torch.Tensor, caches, eps: float) -> None:
    """KV-source compressor: write the global entries of the step's ``n`` rows."""
    glob = caches.glob[layer]
    if gate is None:  # ratio 1: norm(w x) per token
        glob.index_copy_(0, slots, rms_norm(kv_c[:n], norm_w, eps).to(glob.dtype))
        return
    raw = caches.raw[layer]
    raw.index_copy_(0, slots, torch.cat([kv_c[:n], gate[:n]], dim=-1).float())
    # Odd positions complete a pair whose even half is in the raw cache (this step or
    # an earlier one); even positions compute a throw-away value that lands in the pad
    # slot. Slot - 1 of an odd position stays inside the request's own block.
    pair = torch.stack([raw[slots - 1], raw[slots]], dim=1)  # [n, 2, 2*hd]
    hd = kv_c.shape[-1]
    weights = torch.softmax(pair[..., hd:], dim=1)
    pooled = (weights * pair[..., :hd]).sum(1)
    glob.index_copy_(0, comp_slots, rms_norm(pooled, norm_w, eps).to(glob.dtype))


def attend_view(q: torch.Tensor, out: torch.Tensor, swa: torch.Tensor, glob: torch.Tensor | None, ratio: int,
                view, floored: bool, window: int, sink: torch.Tensor, scale: float) -> None:
    """Every request of ``view`` (an ``AttnView``) into its rows of ``out``, from the
    layer's SWA cache ``swa`` and global cache ``glob`` (ratio ``ratio``; None: none);
    ``floored``: each request's SWA keys start at its replay floor. Rows past the
    view's tokens (padding) are left as they are."""
    qsl = view.query_start_loc
    for i, seq_len in enumerate(view.seq_lens):
        r0, r1 = qsl[i], qsl[i + 1]
        if r1 == r0:
            continue
        base = view.cache_base[i]
        g = None
        if glob is not None:
            gbase = base // ratio
            g = glob[gbase:gbase + (seq_len // ratio)]
        o = attend_request(q[r0:r1], swa[base:base + seq_len], g, ratio, seq_len,
                           view.kv_start[i] if floored else 0, window, sink, scale)
        out[r0:r1] = o.to(out.dtype)
