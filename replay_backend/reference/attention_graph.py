"""The reference attention in fixed shapes, for FULL graphs on any device.

Between pieces the reference attention walks the step's requests in Python, from the
view's host fields; inside a FULL graph those are the captured step's. This one reads
only device tensors of fixed shapes: the view's row blocks at their capacity
(``attention_triton.row_blocks``, blocks past the step's own empty), every row's SWA
keys and every global entry a sequence may have, masked to the row's own.
"""
from __future__ import annotations

import torch

from . import attention_triton


def attend_blocks(q, out, swa, glob, ratio: int, blocks, window: int, floored: bool, sink, scale: float,
                  max_model_len: int) -> None:
    """The reference attention over row blocks (``attention_triton.row_blocks``), in
    fixed shapes: each row's SWA keys and every global entry a sequence may have,
    masked to the row's own. For FULL graphs on any device; memory grows with rows
    times ``window + max_model_len / ratio``."""
    rows, dev = q.shape[0], q.device
    off = torch.arange(attention_triton.BLOCK_M, device=dev)
    covered = off[None, :] < blocks[:, 1:2]
    # Each block's rows scattered to their own index; rows no block covers go to a
    # spare last index, dropped.
    index = torch.where(covered, blocks[:, 0:1] + off, rows).reshape(-1)

    def per_row(values: torch.Tensor) -> torch.Tensor:
        dst = torch.zeros(rows + 1, dtype=torch.int64, device=dev)
        return dst.scatter_(0, index, values.expand_as(covered).reshape(-1))[:rows]

    pos, base = per_row(blocks[:, 2:3] + off), per_row(blocks[:, 3:4])
    floor = per_row(blocks[:, 4:5]) if floored else torch.zeros_like(pos)
    real = per_row(covered.long()).bool()
    kp = pos[:, None] - window + 1 + torch.arange(window, device=dev)
    ok = (kp >= 0) & (kp >= floor[:, None]) & real[:, None]
    keys = swa[base[:, None] + kp.clamp(min=0)]
    if glob is not None:
        m = torch.arange(max_model_len // ratio, device=dev)
        gok = (m[None, :] < ((pos + 1) // ratio)[:, None]) & real[:, None]
        gidx = (base // ratio)[:, None] + m
        keys = torch.cat([glob[gidx.clamp(max=glob.shape[0] - 1)], keys], dim=1)
        ok = torch.cat([gok, ok], dim=1)
    kf = keys.float()
    s = torch.einsum("rhd,rkd->hrk", q[:rows].float(), kf) * scale
    s = s.masked_fill(~ok[None], float("-inf"))
    mx = torch.maximum(s.amax(-1), sink.float()[:, None])
    e = torch.exp(s - mx[..., None])
    denom = e.sum(-1) + torch.exp(sink.float()[:, None] - mx)
    o = torch.einsum("hrk,rkd->rhd", e, kf) / denom.transpose(0, 1)[..., None]
    out[:rows] = torch.where(real[:, None, None], o, 0.0).to(out.dtype)
