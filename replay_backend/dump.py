"""Readable dumps of a compiled model: one directory a person can navigate from index.md.

The same list of artifacts feeds the directory (``debug_dump_path``, ``inspect --dump``)
and the structured trace (``TORCH_TRACE`` + tlparse), so both show the same files:

    index.md                  one line per file
    config.json               the resolved options
    plan.txt / plan.json      the split plan (pieces, layers, op counts, capture sizes)
    graph_before_split.py     the graph Dynamo traced (kept only when dumping or tracing
                              at compile time: the region pass edits it in place)
    graph_after_split.py      the main graph: which piece runs when
    pieces/main/submod_N.py   every main piece's readable code
    replay_region.py          the replay region as cut out, before its split
    replay_region_split.py    the replay region split at attention
    pieces/replay/submod_N.py every replay piece's readable code
    capture.json              what was captured and dispatched (after capture())
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Callable

from torch import fx

from .capture.graphs import PieceRunner


@dataclass
class Artifact:
    rel: str  # path under the dump directory
    what: str  # one line for index.md
    make: Callable[[], str]  # the file's text, computed on first use
    gm: fx.GraphModule | None = None  # the graph it shows, for graph-code logging and depyf
    encoding: str = "string"  # for the structured trace: "string" or "json"
    traced: bool = True  # also emitted into TORCH_TRACE (plan.txt is not: plan.json says it all)
    _text: str | None = field(default=None, repr=False)

    @property
    def text(self) -> str:
        if self._text is None:
            self._text = self.make()
        return self._text

    @property
    def trace_name(self) -> str:
        """Artifact name in TORCH_TRACE (tlparse shows it as a file of that name)."""
        return "dsv41_replay_" + os.path.splitext(self.rel)[0].replace("/", "_")


def readable(gm: fx.GraphModule) -> str:
    """Python code with shapes and dtypes as comments (what ``print_readable`` gives)."""
    try:
        return gm.print_readable(print_output=False)
    except Exception:  # pragma: no cover - a graph torch cannot annotate
        return gm.code


def _layers(p) -> str:
    if not p.layers:
        return "no layer"
    return f"layer {p.layers[0]}" if len(p.layers) == 1 else f"layers {p.layers[0]}..{p.layers[-1]}"


def _piece_line(p) -> str:
    return f"{p.kind} piece, {_layers(p)}, " + (p.op if p.op else f"{p.num_ops} ops")


def _split_code(gm: fx.GraphModule, infos, title: str) -> str:
    head = [f"# {title}: each submod_N below is one piece, run in this order", "#"]
    head += [f"#   {p.name:<12s} {_piece_line(p)}" for p in infos]
    return "\n".join(head) + "\n\n" + gm.code


def _pieces(level: str, gm: fx.GraphModule, infos) -> list[Artifact]:
    out = []
    by_name = {p.name: p for p in infos}
    for name, sub in gm.named_children():
        src = sub.source if isinstance(sub, PieceRunner) else sub
        if not isinstance(src, fx.GraphModule):
            continue
        info = by_name.get(name)
        line = _piece_line(info) if info is not None else "piece"
        out.append(Artifact(f"pieces/{level}/{name}.py", f"{level} {line}",
                            lambda s=src, l=line: f"# {l}\n{readable(s)}", src))
    return out


def artifacts(compiled) -> list[Artifact]:
    """Everything a dump holds for ``compiled`` except capture.json, in index order."""
    plan, sources = compiled.plan, compiled.sources
    before = getattr(sources, "before_split", None)
    arts = [
        Artifact("config.json", "the resolved options (defaults filled in, env applied)",
                 lambda: json.dumps(compiled.cfg.as_dict(), indent=2) + "\n", encoding="json"),
        Artifact("plan.txt", "the split plan as `replay-backend inspect` prints it",
                 lambda: compiled.plan_snapshot().render() + "\n", traced=False),
        Artifact("plan.json", "the split plan as JSON (`inspect --json`)",
                 lambda: compiled.plan_snapshot().to_json() + "\n", encoding="json"),
    ]
    if before is not None:
        arts.append(Artifact("graph_before_split.py", "the graph Dynamo traced, before the split",
                             lambda: before))
    arts.append(Artifact("graph_after_split.py", f"the main graph after the split: {len(plan.main_pieces)} "
                         "pieces in run order", lambda: _split_code(compiled.split_gm, plan.main_pieces,
                                                                     "main graph"), compiled.split_gm))
    arts += _pieces("main", compiled.split_gm, plan.main_pieces)
    region = getattr(sources, "replay_region", None)
    if region is not None:
        arts.append(Artifact("replay_region.py", f"the replay region (layers {plan.replay_layers}) as cut "
                             "out of the main graph, before its split", lambda: readable(region), region))
    if compiled.replay is not None:
        rgm = compiled.replay.region
        arts.append(Artifact("replay_region_split.py", f"the replay region after the split: "
                             f"{len(plan.replay_pieces)} pieces in run order",
                             lambda: _split_code(rgm, plan.replay_pieces, "replay region"), rgm))
        arts += _pieces("replay", rgm, plan.replay_pieces)
    return arts


def capture_artifact(compiled) -> Artifact:
    def make() -> str:
        runners = {k: v.as_dict() for k, v in compiled.plan_snapshot().runners.items()}
        return json.dumps({"summary": compiled.capture_summary, "runners": runners}, indent=2) + "\n"

    return Artifact("capture.json", "what capture() captured per runner (sizes, graphs, seconds, GiB), "
                    "written at the end of capture(); plan_of() has live dispatch counts", make,
                    encoding="json")


def _write(path: str, rel: str, text: str) -> None:
    full = os.path.join(path, rel)
    os.makedirs(os.path.dirname(full), exist_ok=True)
    with open(full, "w") as f:
        f.write(text)


def _write_index(compiled, path: str, arts: list[Artifact]) -> None:
    plan = compiled.plan
    lines = ["# dsv41_replay dump", "",
             f"Main graph: {len(plan.main_pieces)} pieces {plan.pieces_by_kind('main')}; replay layers "
             f"{plan.replay_layers or 'none'}" + (f" (off: {plan.replay_off_reason})" if plan.replay_off_reason
                                                 else "") + ".", ""]
    lines += [f"- [{a.rel}]({a.rel}) — {a.what}" for a in arts]
    if compiled.sources is None or compiled.sources.before_split is None:
        lines.append("- graph_before_split.py — not kept: set `debug_dump_path` (or DSV41_REPLAY_DUMP) "
                     "before compiling to get it")
    if not os.path.exists(os.path.join(path, "capture.json")):
        lines.append("- capture.json — appears after `capture()`" if compiled.dump_dir == path
                     else "- capture.json — not written here: dump again after `capture()`")
    _write(path, "index.md", "\n".join(lines) + "\n")


def dump_compiled(compiled, path: str) -> list[str]:
    """Write the dump of ``compiled`` (anything ``plan_of`` takes but a plan) under
    ``path`` (see the module docstring); later captures update its capture.json.
    Returns the files written, relative to ``path``."""
    from .plan import compiled_model_of

    compiled = compiled_model_of(compiled)
    os.makedirs(path, exist_ok=True)
    arts = artifacts(compiled)
    if compiled.capture_summary:
        arts.append(capture_artifact(compiled))
    for a in arts:
        _write(path, a.rel, a.text)
    _write_index(compiled, path, arts)
    return ["index.md"] + [a.rel for a in arts]


def dump_capture(compiled, path: str) -> str:
    """Write capture.json and re-index ``path``."""
    art = capture_artifact(compiled)
    _write(path, art.rel, art.text)
    _write_index(compiled, path, artifacts(compiled) + [art])
    return art.rel
