"""Looking inside compiled graphs (private torch): TORCH_TRACE artifacts (tlparse), the
``graph_code`` log artifact (``TORCH_LOGS=graph_code``) and depyf's hooks."""
from __future__ import annotations

import inspect
import logging
from typing import Callable

import torch

log = logging.getLogger("replay_backend")


def trace_enabled() -> bool:
    """True when structured tracing writes somewhere (TORCH_TRACE is set): torch itself
    only formats a payload when its trace logger has handlers."""
    try:
        from torch._logging._internal import trace_log
    except ImportError:  # pragma: no cover
        return False
    for h in trace_log.handlers:
        # torch always attaches a lazy file handler; without TORCH_TRACE (root_dir None)
        # it removes itself on its first record, so until then it does not count.
        if type(h).__name__ == "LazyTraceHandler" and getattr(h, "root_dir", "") is None \
                and getattr(h, "stream", None) is None:
            continue
        # pytest >= 9 attaches its log capture to every logger, this one included:
        # formatting every graph for a test's captured log is not what TORCH_TRACE is for.
        if type(h).__module__.startswith("_pytest"):
            continue
        return True
    return False


def trace_structured(name: str, payload: Callable[[], str], encoding: str = "string") -> None:
    """Emit an artifact into TORCH_TRACE, shown by tlparse as ``<name>.txt`` / ``.json``.

    ``expect_trace_id=False``: some artifacts (the capture summary) are emitted outside a
    Dynamo compile, where torch would otherwise record a stack trace to explain why."""
    try:
        from torch._logging import trace_structured as _ts
    except ImportError:  # pragma: no cover
        return
    kw = {"expect_trace_id": False} if "expect_trace_id" in inspect.signature(_ts).parameters else {}
    _ts("artifact", metadata_fn=lambda: {"name": name, "encoding": encoding}, payload_fn=payload, **kw)


def _graph_code_logger() -> logging.Logger | None:
    try:
        return torch._logging.getArtifactLogger("replay_backend", "graph_code")
    except (AttributeError, ValueError):  # pragma: no cover - artifact not registered
        return None


def log_graph_code(title: str, gm: torch.fx.GraphModule) -> None:
    """Log a graph the way Dynamo logs its own: through ``lazy_format_graph_code`` (the
    call depyf intercepts to dump a graph as a file, so this is what makes depyf see our
    pieces) to the ``graph_code`` artifact logger ``replay_backend.__graph_code``
    (``TORCH_LOGS=graph_code``). Exceptions come from a foreign hook: callers catch them."""
    try:
        from torch.fx._utils import lazy_format_graph_code
    except ImportError:  # pragma: no cover - torch < 2.4 kept it in _dynamo.utils
        from torch._dynamo.utils import lazy_format_graph_code
    text = lazy_format_graph_code(title, gm)  # cheap: formats lazily unless depyf is active
    glog = _graph_code_logger()
    if glog is None or not glog.isEnabledFor(logging.DEBUG):
        return
    if not glog.hasHandlers():
        # torch only attaches handlers to its own loggers; without one the enabled artifact
        # would print nothing, so give it torch's console format.
        handler = logging.StreamHandler()
        fmt = getattr(torch._logging._internal, "TorchLogsFormatter", None)
        if fmt is not None:
            handler.setFormatter(fmt())
        glog.addHandler(handler)
    glog.debug("%s", text)


def adapt_depyf() -> bool:
    """Make an active ``depyf.prepare_debug`` work with this torch and this model.

    1. depyf (0.20) replaces ``PyCodeCache.load_by_key_path`` with a hook taking
       ``(key, path, linemap, attrs)``; torch >= 2.13 also passes ``set_sys_modules=``, so
       every Inductor module load inside ``prepare_debug`` raises ``TypeError``. Wrap the
       hook so it takes any keyword and hands the extra ones to the original loader.
    2. depyf's Dynamo bytecode hook decompiles every transformed frame and on a big
       ``forward`` can recurse without end, which fails the whole compile. Guard it: a
       failure there is logged and Dynamo keeps its own code.
    Returns True when it adapted something (idempotent; depyf undoes it all on exit).
    """
    return _adapt_depyf_loader() | _guard_depyf_bytecode_hooks()


def _adapt_depyf_loader() -> bool:
    try:
        from torch._inductor.codecache import PyCodeCache
    except ImportError:  # pragma: no cover
        return False
    hook = PyCodeCache.__dict__.get("load_by_key_path")
    if hook is None or isinstance(hook, (classmethod, staticmethod)) or getattr(hook, "_dsv41_adapted", False):
        return False  # torch's own classmethod (no depyf), or already adapted
    params = inspect.signature(hook).parameters.values()
    if any(p.kind is p.VAR_KEYWORD or p.name == "set_sys_modules" for p in params):
        return False  # a depyf that already copes
    import sys

    data = getattr(sys.modules.get("depyf.explain.global_variables"), "data", None)

    def load_by_key_path(key, path, linemap=None, attrs=None, **kwargs):
        original = data.get("unpatched_load_by_key_path") if isinstance(data, dict) else None
        if not kwargs or original is None:
            return hook(key, path, linemap, attrs)  # extra keywords are optional: drop them
        # depyf calls the original positionally: bind the extra keywords for this call.
        data["unpatched_load_by_key_path"] = lambda k, p, lm=None, at=None: original(k, p, lm, at, **kwargs)
        try:
            return hook(key, path, linemap, attrs)
        finally:
            data["unpatched_load_by_key_path"] = original

    load_by_key_path._dsv41_adapted = True  # type: ignore[attr-defined]
    PyCodeCache.load_by_key_path = load_by_key_path
    log.info("dsv41_replay: adapted depyf's Inductor hook to torch %s (set_sys_modules=)", torch.__version__)
    return True


class _GuardedBytecodeHook:
    """A depyf bytecode hook whose failures cost a warning, not the compile."""

    def __init__(self, hook: Callable) -> None:
        self.hook, self.warned = hook, False

    def __call__(self, code, new_code):
        try:
            return self.hook(code, new_code)
        except Exception as e:  # RecursionError in depyf's decompiler, among others
            if not self.warned:
                self.warned = True
                log.warning("dsv41_replay: depyf could not decompile %s (%s: %s); Dynamo's code is kept, "
                            "depyf's directory still gets the graphs and pieces", code.co_name,
                            type(e).__name__, str(e)[:200])
            return None


def _guard_depyf_bytecode_hooks() -> bool:
    hooks = getattr(getattr(torch._dynamo, "convert_frame", None), "_bytecode_hooks", None)
    if not isinstance(hooks, dict):  # pragma: no cover - moved in this torch
        return False
    done = False
    for key, hook in list(hooks.items()):
        if type(hook).__module__.startswith("depyf") and not isinstance(hook, _GuardedBytecodeHook):
            hooks[key] = _GuardedBytecodeHook(hook)
            done = True
    return done
