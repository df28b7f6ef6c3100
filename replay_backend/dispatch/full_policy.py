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

from ..config import ReplayConfig
from ..fallbacks import Fallback
from ..passes.roles import CudagraphSupport, cudagraph_support_of


@dataclass(frozen=True)
class FullPolicy:
    """The FULL graph sizes (ascending) and which batches may take them."""

    sizes: tuple[int, ...]
    # Only uniform decodes: every request with exactly this many tokens (None: any
    # batch). Exactly, as the graphs were captured with it: an attention that supports
    # only uniform decodes may build its launch for that query length.
    uniform_len: int | None
    # The rows of a batch's graph layout (capture's, whatever sizes stay captured),
    # and the backend's metadata buffer, where a FULL graph reads its steps' metadata.
    rows: int
    metadata: Any = field(default=None, compare=False)

    @property
    def uniform_only(self) -> bool:
        return self.uniform_len is not None

    def takes(self, requests) -> bool:
        """The attention runs a step of ``requests`` inside a FULL graph: any, or only
        a uniform decode (every request with exactly ``uniform_len`` tokens)."""
        return not self.uniform_only or (bool(requests) and all(r.query_len == self.uniform_len for r in requests))

    def wants_layout(self, requests) -> bool:
        """A batch of ``requests`` is built in the graph layout: it may run FULL."""
        return sum(r.query_len for r in requests) <= self.sizes[-1] and self.takes(requests)

    def reads(self, batch) -> bool:
        """``batch`` (laid out for FULL graphs) is where the graphs read: in the backend's
        buffer, at the graphs' rows."""
        return batch.graph.rows == self.rows and batch.metadata is self.metadata

    def dummy_shapes(self, max_requests: int, max_model_len: int) -> dict[int, tuple[int, int | None]]:
        """For each FULL size a batch that pads to it and that this policy takes, as
        ``size -> (tokens, tokens per request)`` (None: any split), for capture's dummy
        steps: at most ``max_requests`` requests of at most ``max_model_len`` tokens, as
        served batches hold. A size that no such batch pads to is left out (no served
        batch reaches it)."""
        shapes, below = {}, 0
        for size in self.sizes:
            if not self.uniform_only:
                tokens = min(size, max_requests * max_model_len)
                if tokens > below:
                    shapes[size] = (tokens, None)
            elif self.uniform_len <= max_model_len:  # else no sequence holds one such decode
                q = self.uniform_len
                k = min(size // q, max_requests)
                if k * q > below:
                    shapes[size] = (k * q, q)
            below = size
        return shapes


def lowest_support(attention_ops, setup) -> tuple[CudagraphSupport, str | None]:
    """The lowest FULL graph support among ``attention_ops`` (their targets) for
    ``setup``, and the first op that has it (None: no attention op, nothing limits)."""
    found = [(cudagraph_support_of(op, setup), i, str(op)) for i, op in enumerate(attention_ops)]
    if not found:
        return CudagraphSupport.ALWAYS, None
    worst, _, name = min(found)
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
        sizes = cfg.uniform_decode_sizes(sizes)
    sizes = tuple(sorted(sizes))
    policy = FullPolicy(sizes, cfg.uniform_decode_query_len if uniform_only else None, sizes[-1], metadata)
    if mode != "full_decode_only" and support is CudagraphSupport.UNIFORM_DECODE:
        return policy, (f"cudagraph_mode={mode!r}: attention op {op} declares cudagraph_support UNIFORM_DECODE, so "
                        f"only uniform decode batches (every request with uniform_decode_query_len="
                        f"{cfg.uniform_decode_query_len} tokens) run as FULL graphs; {rest}")
    return policy, None


def resolve_policy(cfg: ReplayConfig, model, setup, metadata) -> FullPolicy | None:
    """Which steps of ``model`` (a CompiledReplayModel) run as FULL graphs, from the
    mode and what its attention ops support for ``setup``, set on the model; decided
    once, a downgrade counted as a fallback."""
    if not model.full_sizes or model.full_resolved:
        return model.full_policy
    support, op = lowest_support(model.attention_ops(), setup)
    policy, why = resolve(cfg, model.full_sizes, support, op, metadata)
    if why is not None:
        model.res.fallback(Fallback.CUDAGRAPH_MODE, why)
    model.use_full_policy(policy)
    model.full_resolved = True
    return policy
