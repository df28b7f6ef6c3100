"""dsv41-replay: a torch.compile backend for DeepSeek-V4.1-style models."""
import importlib

from .backend import ReplayBackend, backend_of
from .lifecycle import Phase
from .batch import AttnView, StepBatch, ViewField, build_step_batch, dummy_step_batch
from .requests import ReplayRows, RequestChunk, replay_rows_for
from .config import ReplayConfig
# The Counters object (``replay_backend.counters.expect(...)``), not the module.
from .counters import counters
from .tracing.dynamic import mark_token_dims
from .serving import ReplayCompiled, compile
from .step_setup import StepSetup
from .dispatch.decide import StepKind, StepResult
from .rank_errors import RankFailed, RanksApart
from .fallbacks import StrictFallbackError
from .tracing.boundary import replay_begin, replay_end
from .kv_cache import CacheLayout
from .forward_context import ForwardContext, get_forward_context, set_forward_context
from .inspection import depyf_debug
from .passes.roles import CudagraphSupport, declare_attention, declare_row_local
from .plan import SplitPlan, plan_of

__version__ = "0.1.0"

# The reference model and its runner load on first use: the backend imports no model.
_REFERENCE = {"DSv41Mini": ".reference", "ModelConfig": ".reference", "build_model": ".reference",
              "preset": ".reference", "StepRunner": ".reference.runner"}


def __getattr__(name: str):
    if name in _REFERENCE:
        return getattr(importlib.import_module(_REFERENCE[name], __name__), name)
    raise AttributeError(f"module 'replay_backend' has no attribute {name!r}")


__all__ = [
    "AttnView", "backend_of", "build_model", "build_step_batch", "CacheLayout", "compile",
    "counters", "CudagraphSupport", "declare_attention", "declare_row_local", "depyf_debug", "DSv41Mini",
    "dummy_step_batch", "ForwardContext", "get_forward_context", "mark_token_dims", "ModelConfig",
    "Phase", "plan_of", "preset", "RankFailed", "RanksApart", "replay_begin", "replay_end", "replay_rows_for",
    "ReplayBackend", "ReplayCompiled", "ReplayConfig", "ReplayRows", "RequestChunk", "set_forward_context",
    "SplitPlan", "StepBatch", "StepKind", "StepResult", "StepRunner", "StepSetup", "StrictFallbackError",
    "ViewField",
]
