"""A view's key sets as FlashInfer batches: the requests of each part and their arrays.

Each key set is a batch of causal requests over a page table of page size 1, the
table's entries being cache slots (a request's block is ``base + position``):

* SWA: the keys ``[max(p0 - W + 1, floor), seq_len)`` with ``window_left = W - 1``; a
  row whose keys all lie below the floor sees none (its state has no mass). Such rows
  are a request of their own (:func:`_split_blind`).
* Global, ratio 1: entries ``[0, seq_len)``, plain causal.
* Global, ratio r > 1: row p reads entries ``m < (p + 1) // r``, a slope FlashInfer's
  causal mask cannot express. Rows of one residue class of p mod r read exactly one
  more entry per row, so each class is its own causal request; the rows are permuted
  into class order for the kernel, and the merge reads each row's state where the
  inverse permutation says.

Host-side and pure: attention_flashinfer.py plans these batches and runs them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


# FlashInfer's causal mask is only right for a request with at least as many keys as
# query rows (its kernels compute the mask's first iteration from ``kv_len - qo_len``
# unsigned), or with none. A request's leading rows that see no key (rows below the
# replay floor; in a ratio-r global cache a row whose position completes no entry yet)
# are therefore a request of their own, without keys, and the rest see as many keys
# as they have rows, or more.
def _split_blind(out: list, blind: int, rows: int, first: int, keys: int) -> None:
    if blind:
        out.append((blind, 0, 0))
    if rows > blind:
        out.append((rows - blind, first, keys))


def swa_part(view, window: int, floored: bool) -> list[tuple[int, int, int]]:
    """Per (sub-)request ``(qo_len, first slot, kv_len)`` of the SWA keys (see the
    module doc)."""
    qsl = view.query_start_loc
    out: list[tuple[int, int, int]] = []
    for i, seq_len in enumerate(view.seq_lens):
        n = qsl[i + 1] - qsl[i]
        p0 = seq_len - n
        floor = view.kv_start[i] if floored else 0
        lo = min(max(p0 - window + 1, floor, 0), seq_len)
        _split_blind(out, min(max(lo - p0, 0), n), n, view.cache_base[i] + lo, seq_len - lo)
    return out


def global_part(view, ratio: int) -> tuple[list[tuple[int, int, int]], torch.Tensor | None]:
    """Per (sub-)request ``(qo_len, first slot, kv_len)`` of the global entries, and for
    ratio > 1 the view's rows in the order of those sub-requests (int32)."""
    qsl = view.query_start_loc
    out: list[tuple[int, int, int]] = []
    # One range per residue class: a step's rows, as Python ints, would cost the host
    # more than the rest of its plan.
    classes: list[torch.Tensor] | None = [] if ratio > 1 else None
    for i, seq_len in enumerate(view.seq_lens):
        r0, r1 = qsl[i], qsl[i + 1]
        gbase = view.cache_base[i] // ratio
        if ratio == 1:
            out.append((r1 - r0, gbase, seq_len))
            continue
        p0 = seq_len - (r1 - r0)
        for c in range(min(ratio, r1 - r0)):
            members = torch.arange(r0 + c, r1, ratio, dtype=torch.int32)
            n = members.numel()
            last = p0 + c + ratio * (n - 1)
            # one more entry per row of the class: only its first row can see none
            _split_blind(out, int((p0 + c + 1) // ratio == 0), n, gbase, (last + 1) // ratio)
            classes.append(members)
    if classes is None:
        return out, None
    return out, torch.cat(classes) if classes else torch.zeros(0, dtype=torch.int32)


def padded(reqs: list, num_tokens: int, rows: int, batch: int) -> list:
    """For a CUDA-graph plan: empty requests up to ``batch - 1``, then one request
    without keys holding the rows from ``num_tokens`` to ``rows`` (the graph's pad rows),
    so that every plan of the graph has its request count and row count."""
    if len(reqs) + 1 > batch:
        raise ValueError(f"a view of {len(reqs)} FlashInfer requests exceeds the graph plan's {batch - 1}")
    if num_tokens > rows:
        raise ValueError(f"a view of {num_tokens} rows exceeds the graph plan's {rows}")
    return reqs + [(0, 0, 0)] * (batch - 1 - len(reqs)) + [(rows - num_tokens, 0, 0)]


@dataclass(frozen=True)
class PartSets:
    """The key sets (parts, ``(kind, arg)``: ``("swa", floored)``, ``("global", ratio)``)
    that each kind of layer reads: the main layers on the whole batch, the replay layers
    on the view the replay region runs on (a replay view, or the whole batch)."""

    main_layers: tuple
    replay_layers: tuple

    @classmethod
    def of(cls, cfg) -> "PartSets":
        replay = cfg.replay_layers
        src = cfg.global_source(replay[0]) if len(replay) else None
        if src is not None and cfg.compress_ratio(src) != 1:
            raise ValueError("attention_impl='flashinfer' needs the replay layers' source at ratio 1: "
                             "a ratio-r part permutes its rows, which a replay graph cannot do per step")
        globs = tuple(("global", r) for r in sorted(cfg.global_ratios))
        return cls(main_layers=(("swa", False), *globs),
                   replay_layers=(("swa", True), *((("global", 1),) if src is not None else ())))

    @property
    def every(self) -> tuple:
        return (*self.main_layers, *(p for p in self.replay_layers if p not in self.main_layers))


@dataclass(frozen=True)
class PartLayout:
    """One key set of one view as FlashInfer's batch (int32, as its kernels index):
    ``small`` holds ``qo_indptr``, ``kv_indptr``, ``kv_lens`` and the last page's
    length (page size 1: 1, or 0 for no keys) back to back, for ``batch`` requests;
    ``longest`` and ``keys`` are the most rows and the most keys of one request;
    ``kv_indices`` is the page table of cache slots; ``perm`` the rows in sub-request
    order for a ratio-r global part (None: rows in view order), and ``unperm`` its
    inverse: where each row of the view lies in that order."""

    batch: int
    rows: int
    longest: int
    keys: int
    small: list[int]
    kv_indices: torch.Tensor
    perm: torch.Tensor | None
    unperm: torch.Tensor | None


def layout_of(reqs: list[tuple[int, int, int]], perm: torch.Tensor | None = None) -> PartLayout:
    qo, kv, longest, keys = [0], [0], 0, 0
    for q, _, k in reqs:
        qo.append(qo[-1] + q)
        kv.append(kv[-1] + k)
        longest, keys = max(longest, q), max(keys, k)
    lens = [k for _, _, k in reqs]
    pieces = [torch.arange(s, s + k, dtype=torch.int32) for _, s, k in reqs if k]
    idx = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int32)
    unperm = None
    if perm is not None:
        unperm = torch.empty_like(perm)
        unperm[perm.long()] = torch.arange(perm.numel(), dtype=perm.dtype)
    return PartLayout(len(reqs), qo[-1], longest, keys, qo + kv + lens + [int(k > 0) for k in lens], idx, perm,
                      unperm)
