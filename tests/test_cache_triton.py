"""The attention ops' one-launch cache writes (reference/cache_triton.py) on the CPU:
the kernel under Triton's interpreter in a child process against the reference ops
(cache_write_cases.py, which test_gpu.py runs compiled), and the kept build's launch."""
import pytest

from conftest import check_interpreted, needs_triton
from replay_backend.compat import triton as _triton


@needs_triton
def test_kernel_writes_the_caches_like_the_reference_ops():
    check_interpreted("cache_write_cases", "check_against_reference")


def test_kept_kernel_launches_its_build_directly_after_the_first_call(monkeypatch):
    """The first call per key goes through Triton's entry and keeps the build; later
    calls launch it directly with the current stream and every argument, constexprs
    last; another key builds again."""
    calls = []

    class Build:  # the parts of a compiled build a direct launch uses
        function, packed_metadata = "fn", "meta"

        def run(self, *args):
            calls.append(("direct", args))

        def __getitem__(self, grid):  # pragma: no cover - only with a launch hook
            raise AssertionError("a kept build goes direct")

    class Kernel:
        def __getitem__(self, grid):
            def entry(*args, **constexprs):
                calls.append(("entry", grid, args, constexprs))
                return Build()
            return entry

    if _triton.triton is None:
        pytest.skip("Triton is not installed")
    monkeypatch.setattr(_triton.compat_graphs, "raw_stream_getter", lambda: lambda index: 1000 + index)
    # a stand-in's __getitem__ is not Triton's: take its launch layout as checked
    monkeypatch.setattr(_triton, "launch_layout_verified", lambda build_type: True)
    kept = _triton.KeptKernel(Kernel())

    class Dev:
        index = 3

    kept(("k1",), (4, 1, 1), Dev, ("x", 7), {"D": 128})
    kept(("k1",), (5, 1, 1), Dev, ("y", 8), {"D": 128})
    kept(("k2",), (6, 1, 1), Dev, ("z", 9), {"D": 64})
    assert calls == [("entry", (4, 1, 1), ("x", 7), {"D": 128}),
                     ("direct", (5, 1, 1, 1003, "fn", "meta", None, None, None, "y", 8, 128)),
                     ("entry", (6, 1, 1), ("z", 9), {"D": 64})]
