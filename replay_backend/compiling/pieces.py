"""Compile: each graph piece of a split graph, with the inputs it sees.

The split graph runs once on fake inputs; every graph piece is compiled (Inductor, or
kept as it is with ``compiler="eager"``) and wrapped in a ``PieceRunner`` of its graph
level, which captures and replays it. Attention and trim-op pieces stay eager.
"""
from __future__ import annotations

import torch
from torch import fx

from ..compat import inductor as compat_inductor
from ..capture.graphs import GraphLevel, GraphResources, PieceRunner
from ..config import ReplayConfig
from ..counters import counters
from ..passes.common import is_op
from ..ops import TRIM
from .piece_cache import PieceCache


def _wrap(split: fx.GraphModule, name: str, fn, level: GraphLevel, res: GraphResources,
          keep: frozenset[str]) -> None:
    sub = getattr(split, name)
    split._modules[name] = PieceRunner(name, fn if fn is not None else sub, level, res, source=sub,
                                       keep_outputs=name in keep)


def wrap_uncompiled(split: fx.GraphModule, infos, level: GraphLevel, res: GraphResources,
                    keep: frozenset[str] = frozenset()) -> None:
    """``compiler="eager"``: pieces run as they are, so no example inputs are needed and
    the fake-tensor pass over the whole graph is skipped. ``keep``: the pieces whose
    outputs stay alive across the trim op."""
    for info in infos:
        counters.pieces[info.kind] += 1
        if info.kind == "graph":
            _wrap(split, info.name, None, level, res, keep)


class PieceCompiler(torch.fx.Interpreter):
    """Runs a split graph on fake inputs and compiles each graph piece with the inputs it
    sees (vLLM's piecewise-compile idea); splitting-op pieces stay eager."""

    def __init__(self, split: fx.GraphModule, infos, cfg: ReplayConfig, level: GraphLevel,
                 res: GraphResources, cache: PieceCache, on_trim=None, keep: frozenset[str] = frozenset()) -> None:
        super().__init__(split)
        self.infos = {p.name: p for p in infos}
        self.cfg, self.level, self.res, self.on_trim = cfg, level, res, on_trim
        self.cache, self.keep = cache, keep

    def call_module(self, target, args, kwargs):
        out = super().call_module(target, args, kwargs)
        info = self.infos[target]
        counters.pieces[info.kind] += 1
        if info.kind == "replay" and self.on_trim is not None:
            self.on_trim(trim_call_args(self.fetch_attr(target), args))
        if info.kind != "graph":
            return out
        sub = self.fetch_attr(target)
        fn, hit = self.cache.get_or_compile(sub, args, lambda: compat_inductor.inductor_compile(
            sub, list(args), self.cfg.inductor_mode))
        counters.piece_cache_hits += int(hit)
        counters.compilations += int(not hit)
        _wrap(self.module, target, fn, self.level, self.res, self.keep)
        return out


def trim_call_args(piece: fx.GraphModule, args) -> tuple[list, list]:
    """The (rows, consts) values the trim op receives inside its one-op piece."""
    env = dict(zip((n for n in piece.graph.nodes if n.op == "placeholder"), args))
    call = next(n for n in piece.graph.nodes if is_op(n, TRIM))
    rows, consts = fx.map_arg((call.args[0], call.args[1]), lambda n: env[n])
    return list(rows), list(consts)
