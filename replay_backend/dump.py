"""Readable dumps of a compiled model: the split graphs and every piece's code."""
from __future__ import annotations

import json
import os

from .runtime.graphs import PieceRunner


def _piece_code(module) -> str:
    src = getattr(module, "source", None) or module
    return getattr(src, "code", repr(src))


def dump_compiled(compiled, path: str) -> list[str]:
    """Write ``plan.json``, ``plan.txt``, ``main.py``, ``replay_region.py`` and one file per
    piece (``main/submod_N.py``, ``replay/submod_N.py``) under ``path``."""
    os.makedirs(path, exist_ok=True)
    written = []

    def write(rel: str, text: str) -> None:
        full = os.path.join(path, rel)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w") as f:
            f.write(text)
        written.append(rel)

    write("plan.json", compiled.plan.to_json() + "\n")
    write("plan.txt", compiled.plan.render() + "\n")
    write("config.json", json.dumps(compiled.cfg.as_dict(), indent=2) + "\n")
    levels = [("main", compiled.split_gm)]
    if compiled.replay is not None:
        levels.append(("replay", compiled.replay.region))
    for name, gm in levels:
        write(f"{name}.py", gm.code)
        for sub_name, sub in gm.named_children():
            kind = "graph" if isinstance(sub, PieceRunner) else "break"
            write(f"{name}/{sub_name}.py", f"# {kind} piece {sub_name}\n{_piece_code(sub)}")
    return written
