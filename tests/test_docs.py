"""The user docs name what the package has: every option, every fallback reason, and
every ``replay_backend`` name they use exists, so a reader's copy of a line runs."""
from __future__ import annotations

import dataclasses
import importlib
import re
from pathlib import Path

import pytest

from replay_backend.config import ReplayConfig
from replay_backend.fallbacks import Fallback

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _text(name: str) -> str:
    return (ROOT / "docs" / name).read_text()


def _section(text: str, heading: str) -> str:
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def test_every_fallback_reason_is_explained_where_the_counters_are():
    counters = _section(_text("debugging.md"), "Counters")
    missing = [r.value for r in Fallback if f"`{r.value}`" not in counters]
    assert not missing, f"debugging.md, Counters, does not explain {missing}"


def test_every_option_is_in_the_configuration_page():
    text = _text("configuration.md")
    options = [f.name for f in dataclasses.fields(ReplayConfig) if f.init and not f.name.startswith("_")
               and f.name != "inductor_mode"]
    missing = [o for o in options if f"`{o}`" not in text]
    assert not missing, f"configuration.md does not name the options {missing}"


def _resolves(module: str, dotted: str) -> bool:
    """``dotted`` (``a.b``) as an attribute path of ``module``, each step an attribute or
    a submodule, as ``from module import a`` and ``module.a.b`` find it."""
    obj = importlib.import_module(module)
    for part in dotted.split("."):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        try:
            obj = importlib.import_module(f"{obj.__name__}.{part}")
        except (ImportError, AttributeError):
            return False
    return True


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_replay_backend_name_a_doc_uses_exists(doc):
    text = doc.read_text()
    refs = {("replay_backend", d.split(".", 1)[1])
            for d in re.findall(r"\breplay_backend(?:\.[A-Za-z_]\w*)+", text)}
    refs |= {("replay_backend" + mod, name.strip())
             for mod, names in re.findall(r"from replay_backend((?:\.\w+)*) import ([\w, ]+)", text)
             for name in names.split(",") if name.strip()}
    # a dump's generated names (replay_backend.__graph_code) are no names of the package
    missing = sorted(f"{m}.{d}" for m, d in refs if not d.startswith("__") and not _resolves(m, d))
    assert not missing, f"{doc.name} names {missing}, which replay_backend does not have"
