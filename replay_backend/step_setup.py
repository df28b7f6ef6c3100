"""What the backend builds a model's steps from: its ``StepSetup``."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from .batch import AttnView, StepBatch, ViewField, dummy_step_batch
from .forward_context import ForwardContext
from .kv_cache import CacheLayout


@dataclass(frozen=True, eq=False)
class StepSetup:
    """What the backend needs to build a step of this model by itself: the cache layout
    its slots address, the sliding window ``W`` of its replay markers, the device of its
    metadata, its KV cache object (``ForwardContext.kv``), its per-view metadata
    (``ViewField``) and its host-side planning hook (``ForwardContext.prepare_view``)."""

    layout: CacheLayout
    window: int
    kv: Any
    device: Any = "cpu"
    view_fields: Mapping[str, ViewField] = field(default_factory=dict)
    prepare_view: Callable[[AttnView, "int | None"], None] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.layout, CacheLayout):
            raise ValueError(f"StepSetup.layout must be a CacheLayout, got {type(self.layout).__name__}")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"StepSetup.window must be an integer >= 1, got {self.window!r}")
        try:
            object.__setattr__(self, "device", torch.device(self.device))
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"StepSetup.device: {e}") from None
        if not isinstance(self.view_fields, Mapping) or not all(
                isinstance(k, str) and isinstance(v, ViewField) for k, v in self.view_fields.items()):
            raise ValueError("StepSetup.view_fields must map names to ViewField objects")
        if self.prepare_view is not None and not callable(self.prepare_view):
            raise ValueError(f"StepSetup.prepare_view must be callable, got {self.prepare_view!r}")

    def same_as(self, other: "StepSetup") -> bool:
        """Builds the same steps: equal layout, window, device and view fields, the same
        cache object and planning hook."""
        return (self is other or self.layout == other.layout and self.window == other.window
                and self.device == other.device and self.kv is other.kv and self.prepare_view == other.prepare_view
                and dict(self.view_fields) == dict(other.view_fields))

    def context(self, batch: StepBatch, **kw) -> ForwardContext:
        """The forward context of a step of ``batch``, its whole view planned
        (``prepare_view``) before the model reads it; ``kw``: other ForwardContext fields."""
        missing = self.view_fields.keys() - batch.view.derived.keys()
        if missing:
            raise ValueError(f"the batch has no {sorted(missing)} view fields of this StepSetup: build it with the "
                             "compiled model's build_batch, or pass view_fields=setup.view_fields to build_step_batch")
        if self.prepare_view is not None:
            self.prepare_view(batch.view, None)
        return ForwardContext(batch, self.kv, prepare_view=self.prepare_view, **kw)

    def dummy_batch(self, num_tokens: int, context: int = 0, **kw) -> StepBatch:
        """A batch of ``num_tokens`` rows whose KV writes all go to the pad slot; ``kw``:
        ``graph_rows`` and ``metadata``, as ``build_step_batch``'s."""
        return dummy_step_batch(num_tokens, self.layout, self.window, self.device, context, self.view_fields, **kw)

    def replay_view(self, num_rows: int) -> AttnView:
        """The replay layers' view of ``num_rows`` dummy replay rows."""
        return self.dummy_batch(num_rows).replay.view
