"""The one adapter over private torch APIs, with feature detection (torch >= 2.11).

Everything in the package that touches ``torch._inductor``, fake-tensor helpers, shape
environment configuration or structured tracing goes through here, so a torch upgrade
that moves one of them breaks one file, with a clear message.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import os
import time
from typing import Any, Callable, Iterator

import torch


def torch_version() -> tuple[int, int]:
    major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    return major, minor


def detect_fake_mode(inputs) -> Any:
    from torch._guards import detect_fake_mode as _detect

    return _detect(inputs)


def fakeify(fake_mode, inputs: list) -> list:
    """Example inputs as fake tensors of ``fake_mode`` (Dynamo may hand real ones)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) and not isinstance(x, FakeTensor)
            else x for x in inputs]


@contextlib.contextmanager
def size_oblivious() -> Iterator[None]:
    """Trace without specialising the token count on 0/1, so a one-token step does not
    recompile. Without the knob (older torch) callers must avoid 1-token traces."""
    cfg = getattr(torch.fx.experimental, "_config", None)
    if cfg is not None and hasattr(cfg, "backed_size_oblivious"):
        with cfg.patch(backed_size_oblivious=True):
            yield
    else:  # pragma: no cover - depends on torch build
        yield


class no_recompile:
    """Make any Dynamo recompile raise inside a ``with`` (after warm-up a recompile is an
    error). Entered once per served step, so the flag is set and restored directly:
    ``config.patch`` costs several times as much host time, on the step's critical path."""

    def __enter__(self) -> None:
        self.saved = torch._dynamo.config.error_on_recompile
        torch._dynamo.config.error_on_recompile = True

    def __exit__(self, *exc) -> None:
        torch._dynamo.config.error_on_recompile = self.saved


def mark_tokens_dynamic(*token_inputs) -> None:
    """Dim 0 (the token count) of every token-indexed input is dynamic."""
    for t in token_inputs:
        torch._dynamo.mark_dynamic(t, 0)


def inductor_compile(gm: torch.fx.GraphModule, example_inputs: list, mode: str | None) -> Callable:
    """Compile one piece with Inductor for every value of the token count.

    ``compile_fx`` has been the stable entry since torch 2.0 and accepts the fake,
    symbolic example inputs of the surrounding Dynamo trace.
    """
    try:
        from torch._inductor.compile_fx import compile_fx
    except ImportError as e:  # pragma: no cover
        raise RuntimeError(f"this torch ({torch.__version__}) has no torch._inductor.compile_fx: "
                           "use compiler='eager'") from e
    patches = {"max_autotune": True} if mode in ("max-autotune", "max-autotune-no-cudagraphs") else {}
    # Inductor's own cudagraphs must stay off: this backend captures the pieces itself.
    patches["triton.cudagraphs"] = False
    return compile_fx(gm, example_inputs, config_patches=patches)


def user_error(exc: BaseException) -> ValueError | None:
    """The ValueError (bad options, a bad step) inside ``exc``: Dynamo wraps what a
    backend raises (``BackendCompilerFailed.inner_exception``), Python chains causes."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, ValueError):
            return exc
        exc = getattr(exc, "inner_exception", None) or exc.__cause__
    return None


def step_dependent_tags() -> tuple:
    """Tags for ops that read per-step host state (the forward context): a CUDA graph
    must not capture them. Our backend never does (they are splitting or eager ops);
    stock ``torch.compile(mode="reduce-overhead")`` reads the tag and leaves them out
    of its graphs (graph partition) instead of replaying the first step's metadata."""
    tag = getattr(torch.Tag, "cudagraph_unsafe", None)
    return (tag,) if tag is not None else ()


def reduce_overhead_options() -> dict:
    """``torch.compile`` options equal to ``mode="reduce-overhead"`` (CUDA graph trees),
    with graph partition where this torch has it, so ops tagged by
    :func:`step_dependent_tags` run outside the graphs."""
    import torch._inductor.config as inductor_config

    opts = {"triton.cudagraphs": True}
    if hasattr(inductor_config, "graph_partition"):
        opts["graph_partition"] = True
    return opts


class CudaTracing:
    """Kineto's CUDA tracing (CUPTI) over one phase of profiler sessions: each
    :meth:`session` leaves it attached for the next, :meth:`release` tears it down
    after the last. Attached, it makes every later CUDA call slower on the host, which
    would fall on whatever is timed afterwards (docs/benchmarks.md).

    Kineto resets its trace state as each session starts and again as it ends. A reset
    under ``TEARDOWN_CUPTI=1`` while the tracing is attached starts a teardown, carried
    out on the process's next CUDA call, and a session in which that call lands records
    no GPU kernels: a reset at one session's end can empty the next one, a reset at a
    session's start empties that session itself. So the variable is ``0`` from each
    session's start on, and stays ``0``: every later session starts with the tracing
    attached and nothing to tear down. A session's start sees the variable as left
    before it: at the process's first session nothing is attached yet, and after a
    release it is ``1``, under which the start re-attaches the torn-down tracing
    (Kineto's lazy re-init).

    Whether a release may tear down is the environment's as found when the phase starts,
    before its sessions set the variable: not where ``TEARDOWN_CUPTI=0`` was set (the
    user, or torch itself where CUDA graphs and teardown crash, CUDA before 12.6) or
    torch's profiler marks a session after a teardown as crashing
    (``DISABLE_CUPTI_LAZY_REINIT``), nor without CUDA."""

    def __init__(self) -> None:
        self.cuda = torch.cuda.is_available()
        self.releasable = (self.cuda and os.environ.get("TEARDOWN_CUPTI") != "0"
                           and "DISABLE_CUPTI_LAZY_REINIT" not in os.environ)
        self.attached = False

    @contextlib.contextmanager
    def session(self, activities) -> Iterator[Any]:
        """``torch.profiler.profile(activities=...)``, its tracing left attached."""
        from torch.profiler import profile

        with profile(activities=activities) as prof:
            if self.cuda:
                os.environ["TEARDOWN_CUPTI"] = "0"
                self.attached = True
            yield prof

    def release(self) -> None:
        """Tear down the tracing the sessions left attached, where it may be. One short
        session whose start resets with ``TEARDOWN_CUPTI=1``, which starts the teardown,
        and inside it CUDA calls that carry it out (Kineto runs it from a thread of its
        own, so a few, a moment apart), while the variable still says ``1`` (its lazy
        re-init stays on); ``0`` just before the session ends, so its end starts no
        second teardown. The variable is left at ``1``, under which the next session
        re-attaches the tracing (and a plain profiler session tears it down at its end,
        Kineto's own way)."""
        if not (self.attached and self.releasable):
            return  # a release's session where nothing is attached would attach it
        from torch.profiler import ProfilerActivity, profile

        os.environ["TEARDOWN_CUPTI"] = "1"
        with profile(activities=[ProfilerActivity.CUDA]):
            for _ in range(_RELEASE_CALLS):
                time.sleep(_RELEASE_PAUSE_S)
                torch.cuda.synchronize()
            os.environ["TEARDOWN_CUPTI"] = "0"
        os.environ["TEARDOWN_CUPTI"] = "1"
        self.attached = False


# The release's CUDA calls, and the pause before each: Kineto's teardown thread arms
# the teardown a moment after the session's start.
_RELEASE_CALLS, _RELEASE_PAUSE_S = 3, 0.01


def has_non_owning_alias() -> bool:
    return hasattr(torch._C, "_construct_storage_from_data_pointer")


def non_owning_alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s memory that does not keep that memory allocated.

    Graph outputs are held this way, so memory that the step frees returns to the graph
    pool and later captures reuse it (the same trick as Inductor's CUDA graph trees)."""
    storage = t.untyped_storage()
    alias = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), t.device, storage.nbytes())
    return torch.empty((0,), dtype=t.dtype, device=t.device).set_(
        alias, t.storage_offset(), t.size(), t.stride())


def symbolic_dims(t) -> list[int]:
    """Indices of the dimensions of a (fake) tensor that are symbolic."""
    return [i for i, s in enumerate(t.shape) if isinstance(s, torch.SymInt) and not _is_constant(s)]


def _is_constant(s: torch.SymInt) -> bool:
    try:
        return s.node.is_constant() or not s.node.expr.free_symbols
    except AttributeError:  # pragma: no cover
        return False


def is_symint(x) -> bool:
    return isinstance(x, torch.SymInt) and not _is_constant(x)


# ---- inspection hooks: TORCH_TRACE (tlparse), TORCH_LOGS=graph_code, depyf -------------
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


def graph_code_enabled() -> bool:
    glog = _graph_code_logger()
    return glog is not None and glog.isEnabledFor(logging.DEBUG)


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
    """Make an active ``depyf.prepare_debug`` work with this torch and this model (SPEC §10).

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


def compiled_callables(fn) -> list:
    """What Dynamo compiled for ``fn`` (a ``torch.compile``-d function or module), newest
    first: the backend results installed as ``__compiled_fn_*`` globals of the frames it
    converted, unwrapped. Empty when this torch does not expose its cache entries."""
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:  # pragma: no cover
        return []
    orig = getattr(fn, "_orig_mod", None)
    target = type(orig).forward if isinstance(orig, torch.nn.Module) else getattr(
        fn, "_torchdynamo_orig_callable", fn)
    target = inspect.unwrap(getattr(target, "__func__", target))
    code, scope = getattr(target, "__code__", None), getattr(target, "__globals__", {})
    if code is None:
        return []
    out = []
    for entry in _debug_get_cache_entry_list(code):
        for name in entry.code.co_names:
            if name.startswith("__compiled_fn") and name in scope:
                out.append(inspect.unwrap(scope[name]))
    return out


def raw_stream_getter() -> Callable[[int], int]:
    """``index -> the current stream's handle`` on CUDA device ``index``: the private C
    call where this torch has it (what Triton uses too), else the public one, which goes
    through a Stream object."""
    fast = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if fast is not None:
        return fast
    return lambda index: torch.cuda.current_stream(index).cuda_stream


# ---- the torch.compile call a backend serves ----------------------------------------
# ``torch.compile(m, backend="name", options=...)`` makes one wrapper object and calls the
# registered function through it for every graph of that call; the wrapper is the only
# thing that tells two graphs of one call from graphs of two calls.
_STATE_ATTR = "_dsv41_replay_state"


def _compile_wrapper_type():
    return getattr(torch, "_TorchCompileWrapper", None)


def torch_compile_call(frame) -> object | None:
    """The wrapper of the ``torch.compile`` call whose backend was called from ``frame``
    (the backend function's caller), or None where torch does not call it that way."""
    kind = _compile_wrapper_type()
    owner = frame.f_locals.get("self") if frame is not None else None
    return owner if kind is not None and isinstance(owner, kind) else None


def compile_call_state(call: object, make: Callable[[], Any]) -> Any:
    """The state kept for one ``torch.compile`` call, made on its first graph. It lives
    on the call's wrapper, so it lives as long as the compiled model and no longer."""
    state = getattr(call, _STATE_ATTR, None)
    if state is None:
        state = make()
        setattr(call, _STATE_ATTR, state)
    return state


def compile_call_of(compiled) -> object | None:
    """The ``torch.compile`` wrapper behind a compiled module (or None): torch keeps it at
    the end of a chain of wrappers that each name the next ``_torchdynamo_orig_backend``."""
    kind = _compile_wrapper_type()
    ctx = getattr(compiled, "dynamo_ctx", None) or getattr(compiled, "_torchdynamo_context", None)
    fn = getattr(ctx, "callback", None)
    for _ in range(8):
        if fn is None or kind is None:
            return None
        if isinstance(fn, kind):
            return fn
        fn = getattr(fn, "_torchdynamo_orig_backend", None)
    return None


def compile_call_state_of(compiled) -> Any:
    call = compile_call_of(compiled)
    return getattr(call, _STATE_ATTR, None) if call is not None else None


def custom_op_name(op) -> str | None:
    """``namespace::name`` of what ``torch.library.custom_op`` returned, else None."""
    kind = getattr(getattr(torch, "library", None), "CustomOpDef", None)
    return getattr(op, "_qualname", None) if kind is not None and isinstance(op, kind) else None
