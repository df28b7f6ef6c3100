"""What a model's custom ops are to the backend, declared by the model on the ops.

The backend imports no model, so a model tells it which of its ops play a part:

* ``ATTENTION``: an attention break. It stays eager between the graph pieces, reads
  the step's metadata, and writes into an out-argument. These are the default
  ``splitting_ops``.
* ``KV_SOURCE``: an attention op that also writes KV which later layers read; none may
  follow the decoder-replay cut.
* ``ROW_LOCAL``: an opaque op that works on each row alone (a fused per-token kernel,
  a MoE that sorts rows internally), accepted by the row-locality analysis.

Ops that read per-step state need no declaration here: they carry
``torch.Tag.cudagraph_unsafe`` (``compat_dynamo.step_dependent_tags``), and the backend
refuses them inside captured pieces.

An attention op also says which CUDA graphs it can run inside (``CudagraphSupport``):
whether a step may be one FULL graph, attention included, instead of pieces with the
attention ops between them.

A declaration is an attribute on the op's packet, so it travels with the op and no
registry holds state.
"""
from __future__ import annotations

import enum

import torch
from torch import fx

from ..compat import dynamo as compat_dynamo
from .common import op_name


class OpRole(enum.Enum):
    ATTENTION = "attention"
    KV_SOURCE = "kv_source"
    ROW_LOCAL = "row_local"


class CudagraphSupport(enum.IntEnum):
    """Which steps an attention op can run inside a FULL CUDA graph, ordered: the model
    gets the lowest of its attention ops'.

    * ``ALWAYS``: any batch. Inside the graph it reads only the fixed-layout device
      metadata of ``AttnView.graph`` (``GraphFields``), never a host value of the step.
    * ``UNIFORM_DECODE``: batches whose requests all have exactly
      ``uniform_decode_query_len`` tokens, the length the graphs are captured at.
    * ``NEVER``: it plans on the host or launches per step: only between pieces."""

    NEVER = 0
    UNIFORM_DECODE = 1
    ALWAYS = 2


_ATTR = "_dsv41_replay_roles"
_SUPPORT = "_dsv41_replay_cudagraph_support"


def _packet(op):
    op = compat_dynamo.custom_op_name(op) or op  # what @torch.library.custom_op returned
    if isinstance(op, str):
        if "::" not in op:
            raise ValueError(f"an op name is 'namespace::name', got {op!r}")
        ns, name = op.split("::", 1)
        op = getattr(getattr(torch.ops, ns), name)
    if isinstance(op, torch._ops.OpOverload):
        op = op.overloadpacket
    if not isinstance(op, torch._ops.OpOverloadPacket):
        raise ValueError(f"expected a torch op (torch.ops.ns.name, a torch.library.custom_op) or a 'namespace::name' "
                         f"string, got {op!r}")
    return op


def declare(op, *roles: OpRole) -> None:
    packet = _packet(op)
    setattr(packet, _ATTR, frozenset(getattr(packet, _ATTR, frozenset())) | frozenset(roles))


def declare_attention(*ops, kv_source: bool = False, cudagraph_support=None) -> None:
    """Declare attention ops (``torch.ops.ns.name``, ``"ns::name"`` or what
    ``torch.library.custom_op`` returned): eager breaks
    between graph pieces, the default ``splitting_ops``; with ``kv_source`` they also
    write KV that later layers read, so they must not follow the replay cut.

    ``cudagraph_support``: a :class:`CudagraphSupport`, or a callable that returns one
    for the model's ``StepSetup`` (when it depends on the implementation the setup's
    caches select), asked once when the graphs are captured. None leaves what an
    earlier declaration said (``NEVER`` where none did)."""
    if cudagraph_support is not None and not (isinstance(cudagraph_support, CudagraphSupport)
                                              or callable(cudagraph_support)):
        raise ValueError(f"declare_attention(cudagraph_support=...) takes a CudagraphSupport or a callable of the "
                         f"StepSetup returning one, got {cudagraph_support!r}")
    for op in ops:
        declare(op, OpRole.ATTENTION, *((OpRole.KV_SOURCE,) if kv_source else ()))
        if cudagraph_support is not None:
            setattr(_packet(op), _SUPPORT, cudagraph_support)


def cudagraph_support_of(target, setup) -> CudagraphSupport:
    """What the attention op ``target`` declared for FULL graphs, for ``setup``
    (``NEVER`` when it declared nothing)."""
    target = _packet(target)
    declared = getattr(target, _SUPPORT, CudagraphSupport.NEVER)
    got = declared if isinstance(declared, CudagraphSupport) else declared(setup)
    if not isinstance(got, CudagraphSupport):
        raise ValueError(f"{op_name(target)}: its cudagraph_support callable returned {got!r}, not a "
                         "CudagraphSupport")
    return got


def declare_row_local(*ops) -> None:
    """Declare custom ops that work on each row alone, so that the row-locality analysis
    accepts them in the replay region and in padded main graphs."""
    for op in ops:
        declare(op, OpRole.ROW_LOCAL)


def roles_of(target) -> frozenset:
    """The roles declared for the op a node calls (empty for anything else)."""
    if isinstance(target, torch._ops.OpOverload):
        target = target.overloadpacket
    return getattr(target, _ATTR, frozenset()) if isinstance(target, torch._ops.OpOverloadPacket) else frozenset()


def declared_in(gm: fx.GraphModule, role: OpRole) -> tuple[str, ...]:
    """The ``namespace::name`` of every op in ``gm`` declared with ``role``, in order."""
    names: dict[str, None] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and role in roles_of(node.target):
            names[op_name(node.target)] = None
    return tuple(names)
