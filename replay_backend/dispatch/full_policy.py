"""Which steps run as one FULL graph, decided once: when capture learns what the
model's attention can run inside a graph.

``cudagraph_mode`` asks for FULL graphs; the attention ops declare what they support
(``CudagraphSupport``, passes/roles.py) and the model gets the lowest. Where that is
less than the mode needs, the mode is downgraded: FULL graphs for uniform decode
batches only, or none. A downgrade is a fallback (counted and logged once, an error
under ``strict``), since the user asked for more than runs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..config import ReplayConfig, padded_size
from ..passes.roles import CudagraphSupport, cudagraph_support_of


@dataclass(frozen=True)
class FullPolicy:
    """The FULL graph sizes (ascending) and which batches may take them."""

    sizes: tuple[int, ...]
    uniform_only: bool  # only batches whose requests all have one query length ...
    uniform_len: int  # ... of at most this many tokens
    # The backend's metadata buffer, where a FULL graph reads its steps' metadata.
    metadata: Any = field(default=None, compare=False)

    @property
    def rows(self) -> int:
        """The rows of a batch's graph layout: the largest FULL size."""
        return self.sizes[-1]

    def uniform(self, requests) -> bool:
        q = requests[0].query_len if requests else 0
        return 0 < q <= self.uniform_len and all(r.query_len == q for r in requests)

    def wants_layout(self, requests) -> bool:
        """A batch of ``requests`` is built in the graph layout: it may run FULL."""
        tokens = sum(r.query_len for r in requests)
        return tokens <= self.rows and (not self.uniform_only or self.uniform(requests))

    def dummy_shapes(self, max_requests: int) -> dict[int, tuple[int, int | None]]:
        """For each FULL size a batch that pads to it and that this policy admits, as
        ``size -> (tokens, tokens per request)`` (None: any split), for capture's dummy
        steps. A uniform-only policy needs a uniform decode of at most ``max_requests``
        requests; a size that none pads to is left out (no served batch reaches it)."""
        shapes, below = {}, 0
        for size in self.sizes:
            if not self.uniform_only:
                shapes[size] = (size, None)
            else:
                for q in range(1, self.uniform_len + 1):
                    k = min(size // q, max_requests)
                    if k * q > below:
                        shapes[size] = (k * q, q)
                        break
            below = size
        return shapes

    def admits(self, batch) -> bool:
        """``batch`` may run as one FULL graph: laid out for one, and a batch the
        attention takes there."""
        graph = batch.graph
        return graph is not None and graph.rows >= self.rows and (
            not self.uniform_only or self.uniform(batch.requests))


def lowest_support(attention_ops, setup) -> tuple[CudagraphSupport, str | None]:
    """The lowest FULL graph support among ``attention_ops`` (their targets) for
    ``setup``, and the op that has it (None: no attention op, nothing limits)."""
    worst, name = CudagraphSupport.ALWAYS, None
    for op in attention_ops:
        got = cudagraph_support_of(op, setup)
        if got < worst or name is None:
            worst, name = min(worst, got), str(op)
    return worst, name


def resolve(cfg: ReplayConfig, sizes: list[int], support: CudagraphSupport, op: str | None,
            metadata) -> tuple[FullPolicy | None, str | None]:
    """The policy for FULL graphs of ``sizes`` (the mode's, config.full_capture_sizes)
    under ``support``, their steps' metadata in ``metadata`` (the backend's buffer, None
    where it has none), and why the mode was downgraded (None: it was not)."""
    if not cfg.full_graphs or not sizes:
        return None, None
    mode = cfg.cudagraph_mode
    rest = "the other steps run in pieces" if cfg.piecewise_graphs else "the other steps run eagerly"
    if metadata is None:
        return None, (f"cudagraph_mode={mode!r}: no FULL graph, since served steps' metadata has no fixed address "
                      f"(metadata_in_place=False, or a ViewField without max_rows); {rest}")
    if support is CudagraphSupport.NEVER:
        return None, (f"cudagraph_mode={mode!r}: attention op {op} declares cudagraph_support NEVER (it cannot run "
                      f"inside a graph), so no step runs as a FULL graph; {rest}")
    uniform_only = mode == "full_decode_only" or support is CudagraphSupport.UNIFORM_DECODE
    if uniform_only:
        cap = padded_size(sizes, cfg.max_num_seqs * cfg.uniform_decode_query_len)
        sizes = [s for s in sizes if cap is None or s <= cap]
    policy = FullPolicy(tuple(sorted(sizes)), uniform_only, cfg.uniform_decode_query_len, metadata)
    if mode != "full_decode_only" and support is CudagraphSupport.UNIFORM_DECODE:
        return policy, (f"cudagraph_mode={mode!r}: attention op {op} declares cudagraph_support UNIFORM_DECODE, so "
                        f"only uniform decode batches (one query length, at most uniform_decode_query_len="
                        f"{cfg.uniform_decode_query_len}) run as FULL graphs; {rest}")
    return policy, None
