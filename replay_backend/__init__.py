"""dsv41-replay: a torch.compile backend for DeepSeek-V4.1-style models."""
from .backend import ReplayBackend
from .batch import RequestChunk, StepBatch
from .config import ReplayConfig
# The Counters object (SPEC §8: ``replay_backend.counters.expect(...)``), not the module.
from .counters import counters
from .boundary import replay_begin, replay_end
from .forward_context import ForwardContext, get_forward_context, set_forward_context
from .inspection import depyf_debug
from .models import DSv41Mini, ModelConfig, build_model, preset
from .passes.roles import declare_attention, declare_row_local
from .plan import SplitPlan, plan_of
from .runner import StepRunner

__version__ = "0.1.0"

__all__ = [
    "DSv41Mini", "ForwardContext", "ModelConfig", "ReplayBackend", "ReplayConfig", "RequestChunk",
    "SplitPlan", "StepBatch", "StepRunner", "build_model", "counters", "declare_attention", "declare_row_local", "depyf_debug",
    "get_forward_context", "plan_of", "preset", "replay_begin", "replay_end", "set_forward_context",
]
