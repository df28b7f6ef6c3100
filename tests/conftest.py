"""Shared fixtures of the CPU test suite.

The small config keeps every layer role of the real model at 8 layers:
layer 0 SWA only, 1 a ratio-2 KV source, 2 a global layer reading source 1,
3 the ratio-1 source (the cut), 4..7 the decoder replay layers. The window is 16,
so prefills of a few dozen tokens already trim.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

# Inductor's C++ builder imports setuptools, whose distutils shim asserts when the
# stdlib's distutils came into a test process first (through a dependency of another
# test run earlier in the same worker). Setuptools first: one distutils in every worker.
try:
    import setuptools  # noqa: F401
except ImportError:  # no setuptools: no shim to disagree with
    pass

from replay_backend.reference import build_model, preset
from replay_backend.reference.runner import StepRunner

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")

WINDOW = 16
MAX_MODEL_LEN = 512
MAX_NUM_SEQS = 8


def small_config():
    return preset("tiny").with_layers(8, (1, 3)).replace(window=WINDOW)


@pytest.fixture(scope="session")
def cfg():
    return small_config()


@pytest.fixture(scope="session")
def model(cfg):
    torch.manual_seed(0)
    m = build_model(cfg)  # float32 on CPU
    assert next(m.parameters()).dtype == torch.float32
    return m


@pytest.fixture
def make_runner(model):
    """Factory of fresh runners (fresh, zeroed KV caches) over the shared model."""

    def make(**kw) -> StepRunner:
        kw.setdefault("max_num_seqs", MAX_NUM_SEQS)
        kw.setdefault("max_model_len", MAX_MODEL_LEN)
        return StepRunner(model, **kw)

    return make


@pytest.fixture
def fresh_dynamo():
    """The test traces from scratch and leaves no compiled code behind."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def one_thread():
    """The test models are tiny: one intra-op thread is faster, far faster when another
    process shares the machine's two cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# Triton 3.6's interpreter turns a scalar into an int with ``int(array)``, and its
# scalars derived from ``tl.program_id`` are 1-element arrays, which numpy 2.4 no longer
# converts (triton-lang/triton#9171): a loop bound read from a program's metadata
# fails. The child process squeezes the array first, where the interpreter has the hook.
_INTERPRETER_SHIM = """
import triton.runtime.interpreter as _interp
if hasattr(_interp, "_patch_lang_tensor"):
    _patch = _interp._patch_lang_tensor
    def _patch_lang_tensor(tensor, scope, _patch=_patch):
        _patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
    _interp._patch_lang_tensor = _patch_lang_tensor
"""


def run_interpreted(code: str) -> str:
    """``code`` in a child process under Triton's interpreter (``TRITON_INTERPRET=1``
    must be set before Triton is imported): the CPU tests of the Triton kernels."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = _INTERPRETER_SHIM + textwrap.dedent(code)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=600, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


def check_interpreted(module: str, check: str) -> None:
    """``check("cpu")`` from ``tests/<module>.py`` under Triton's interpreter: the CPU
    run of a kernel's cases that the GPU tests run compiled."""
    out = run_interpreted(f"""
        import sys
        sys.path.insert(0, "tests")
        from {module} import {check}
        {check}("cpu")
        print("checked")
    """)
    assert "checked" in out
