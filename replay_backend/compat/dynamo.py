"""Dynamo (private torch): fake inputs, symbolic sizes, aliasing of traced values,
tracing knobs, the compiled callables and the ``torch.compile`` call a backend serves.
Each is feature-detected."""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Iterator

import torch


def torch_version() -> tuple[int, int]:
    major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    return major, minor


def detect_fake_mode(inputs) -> Any:
    from torch._guards import detect_fake_mode as _detect

    return _detect(inputs)


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool | None:
    """Whether traced (fake) ``a`` is a view of ``b``'s memory, or ``b`` of ``a``'s;
    None where this torch cannot say."""
    is_alias_of = getattr(torch._C, "_is_alias_of", None)
    return None if is_alias_of is None else bool(is_alias_of(a, b))


def fakeify(fake_mode, inputs: list) -> list:
    """Example inputs as fake tensors of ``fake_mode`` (Dynamo may hand real ones)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) and not isinstance(x, FakeTensor)
            else x for x in inputs]


def compiling_frame() -> tuple[Any, bool] | None:
    """The code object Dynamo is compiling a graph of (the frame's, not a function it
    inlined) and whether this is that code's first compile since Dynamo's caches were
    last emptied (later ones are recompiles). None where this torch does not say."""
    try:
        from torch._guards import CompileContext, TracingContext

        cid, tc = CompileContext.current_compile_id(), TracingContext.try_get()
    except Exception:  # noqa: BLE001 - outside a compile, or another layout: unknown
        return None
    n = getattr(cid, "frame_compile_id", None)
    traced = getattr(tc, "traced_code", None)
    if not isinstance(n, int) or not traced:
        return None
    return traced[0], n == 0


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


# What Dynamo raises for a recompile inside ``no_recompile``: before the call runs anything.
RECOMPILE_ERRORS: tuple = tuple(e for e in (getattr(getattr(torch._dynamo, "exc", None), "RecompileError", None),)
                                if isinstance(e, type))


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


def error_chain(exc: BaseException | None) -> Iterator[BaseException]:
    """``exc`` and the errors inside it, outermost first: Dynamo wraps what a backend
    raises (``BackendCompilerFailed.inner_exception``), Python chains causes."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = getattr(exc, "inner_exception", None) or exc.__cause__


def user_error(exc: BaseException) -> ValueError | None:
    """The ValueError (bad options, a bad step) inside ``exc``."""
    return next((e for e in error_chain(exc) if isinstance(e, ValueError)), None)


def step_dependent_tags() -> tuple:
    """Tags for ops that read per-step host state (the forward context): a CUDA graph
    must not capture them. Our backend never does (they are splitting or eager ops);
    stock ``torch.compile(mode="reduce-overhead")`` reads the tag and leaves them out
    of its graphs (graph partition) instead of replaying the first step's metadata."""
    tag = getattr(torch.Tag, "cudagraph_unsafe", None)
    return (tag,) if tag is not None else ()


def symbolic_dims(t) -> list[int]:
    """Indices of the dimensions of a (fake) tensor that are symbolic."""
    return [i for i, s in enumerate(t.shape) if isinstance(s, torch.SymInt) and not _is_constant(s)]


def symbolic_layout(t) -> list[str]:
    """What of a (fake) tensor's layout Dynamo traced symbolic besides its shape: its
    storage offset or strides (a view into a larger tensor)."""
    found = []
    offset = t.storage_offset()
    if isinstance(offset, torch.SymInt) and not _is_constant(offset):
        found.append(f"storage offset {offset}")
    found += [f"stride {i} = {s}" for i, s in enumerate(t.stride())
              if isinstance(s, torch.SymInt) and not _is_constant(s)]
    return found


def same_size(a: torch.SymInt, b: torch.SymInt) -> bool:
    """Whether two symbolic sizes are the same expression (one symbol, say)."""
    try:
        return a.node.expr == b.node.expr
    except AttributeError:  # pragma: no cover
        return False


def _is_constant(s: torch.SymInt) -> bool:
    try:
        return s.node.is_constant() or not s.node.expr.free_symbols
    except AttributeError:  # pragma: no cover
        return False


def number_inputs(gm) -> tuple[int, ...] | None:
    """The positions of ``gm``'s inputs that are Python numbers Dynamo passes as fresh
    0-dim tensors on every call, as its graph arguments record them
    (``GraphArg.pass_arg_as_tensor``); None where the graph does not record it (not
    traced by Dynamo, or a torch whose records differ)."""
    out = []
    for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        flag = getattr(node.meta.get("grapharg"), "pass_arg_as_tensor", None)
        if not isinstance(flag, bool):
            return None
        if flag:
            out.append(i)
    return tuple(out)


def is_symint(x) -> bool:
    return isinstance(x, torch.SymInt) and not _is_constant(x)


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


def compile_call_backend(compiled) -> Any:
    """The backend a ``torch.compile`` call was given (``backend=...``: an object, or the
    function a name stands for), or None where torch does not keep it so."""
    call = compile_call_of(compiled)
    return getattr(call, "compiler_fn", None) if call is not None else None


def custom_op_name(op) -> str | None:
    """``namespace::name`` of what ``torch.library.custom_op`` returned, else None."""
    kind = getattr(getattr(torch, "library", None), "CustomOpDef", None)
    return getattr(op, "_qualname", None) if kind is not None and isinstance(op, kind) else None


def tree_flatten(tree) -> tuple[list, Any]:
    """The leaves of a nested result (tuples, lists, dicts) and its structure: torch's
    private pytree, the one Dynamo itself flattens outputs with."""
    from torch.utils import _pytree

    return _pytree.tree_flatten(tree)


def tree_unflatten(leaves: list, spec) -> Any:
    from torch.utils import _pytree

    return _pytree.tree_unflatten(leaves, spec)
