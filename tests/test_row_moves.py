"""The trim op's one-launch row moves (dispatch/row_moves.py) on the CPU.

The kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``, set before Triton
is imported, hence a child process): against PyTorch indexing, and inside trimmed steps
whose main layers run without graphs, against the eager oracle.
"""
import pytest
import torch

from conftest import check_interpreted, needs_triton, run_interpreted
from replay_backend.dispatch import row_moves
from replay_backend.fallbacks import StrictFallbackError


@needs_triton
def test_kernel_moves_rows_of_mixed_dtypes_like_indexing():
    check_interpreted("row_moves_cases", "check_against_indexing")


@needs_triton
def test_trimmed_steps_without_main_graphs_run_the_kernel_and_match_the_oracle():
    out = run_interpreted("""
        import sys
        sys.path.insert(0, "tests")
        import torch
        from conftest import small_config
        from replay_backend.backend import ReplayBackend
        from replay_backend.batch import RequestChunk as R
        from replay_backend.reference.compare import max_abs_err
        from replay_backend.counters import counters
        from replay_backend.reference import build_model
        from replay_backend.reference.runner import StepRunner
        from replay_backend.dispatch import row_moves as rm

        launches = []
        launch = rm.launch
        rm.launch = lambda *a: launches.append(a[3]) or launch(*a)
        model = build_model(small_config())
        be = ReplayBackend(compiler="eager", max_num_seqs=4, max_cudagraph_capture_size=32,
                           decoder_replay_trim_threshold=24, strict=True)
        rc, ro = StepRunner(model, max_model_len=256, backend=be), StepRunner(model, max_model_len=256)
        rc.capture()
        for reqs in ([R("a", 50, 50)], [R("b", 30, 30), R("c", 20, 20)]):
            before = len(launches)
            got, want = rc.step(reqs), ro.step(reqs)
            assert got.step.kind == "eager" and got.trim.trimmed and got.trim.graph, (got.step, got.trim)
            assert launches[before:] == [False, True], launches  # one gather, one scatter
            assert max_abs_err(got.logits, want.logits) <= 1e-4
            for r in (rc, ro):
                for q in reqs:
                    r.free(q.req_id)
        assert not counters.fallbacks, counters.fallbacks
        print("oracle ok")
    """)
    assert "oracle ok" in out


def test_fit_gives_the_row_widths_or_names_the_tensor_and_the_problem():
    rows_t = torch.tensor([1, 3])
    x = torch.zeros(5, 4)
    assert row_moves.fit([x, torch.zeros(5, 2, 3), torch.zeros(5)], [torch.zeros(4, 4), torch.zeros(4, 2, 3),
                         torch.zeros(4)], rows_t, scatter=False) == [4, 6, 1]
    # every source (and every destination) has tensor 0's rows: the plan is kept by those
    assert "tensor 1: 5 / 3 rows for 2 replay rows" in \
        row_moves.fit([x, x], [torch.zeros(4, 4), torch.zeros(3, 4)], rows_t, scatter=False)
    assert "tensor 0: torch.float32 into torch.bfloat16" in \
        row_moves.fit([x], [torch.zeros(4, 4, dtype=torch.bfloat16)], rows_t, scatter=False)
    assert "tensor 1: rows not contiguous" in \
        row_moves.fit([x, x.t()], [x, x.t().contiguous()], rows_t, scatter=False)
    assert "7 tensors into 7" in row_moves.fit([x] * 7, [x] * 7, rows_t, scatter=False)
    assert "2 tensors into 1" in row_moves.fit([x] * 2, [x], rows_t, scatter=False)
    assert "1 / 5 rows for 2 replay rows" in row_moves.fit([x[:1]], [x], rows_t, scatter=True)


def test_a_failing_kernel_is_a_counted_fallback_and_the_ops_still_serve(monkeypatch):
    seen = []
    monkeypatch.setattr(row_moves, "INTERPRETED", True)  # take the kernel's branch on the CPU
    monkeypatch.setattr(row_moves, "triton", object())
    monkeypatch.setattr(row_moves, "launch", lambda *a: (_ for _ in ()).throw(RuntimeError("no PTX")))
    moves = row_moves.RowMoves(lambda reason, detail: seen.append((reason, detail)))
    rows_t = torch.tensor([1, 3])
    x = torch.arange(10.0).view(5, 2)
    buf = torch.full((4, 2), -1.0)
    moves.gather([x], [buf], rows_t)
    assert torch.equal(buf[:2], x[rows_t]) and (buf[2:] == -1).all()
    out = torch.full((5, 2), 9.0)
    moves.scatter([buf], [out], rows_t)
    want = torch.zeros(5, 2)
    want[rows_t] = x[rows_t]
    assert torch.equal(out, want)
    assert [r for r, _ in seen] == ["row_moves_kernel"] * 2
    assert "the kernel failed: RuntimeError: no PTX" in seen[0][1]

    def strict(reason, detail):
        raise StrictFallbackError(f"{reason}: {detail}")
    with pytest.raises(StrictFallbackError, match="row_moves_kernel: trim op row moves: the kernel failed"):
        row_moves.RowMoves(strict).gather([x], [buf], rows_t)


def test_layouts_are_checked_once_per_signature_and_the_row_count_every_call(monkeypatch):
    """The kernel's branch on the CPU with a stand-in build: the checks run once per
    (direction, tensor count, row counts), the first launch goes through Triton's entry
    and later ones through the kept build, and more replay rows than the kept limit are
    refused (a counted fallback) instead of written past the buffer."""
    monkeypatch.setattr(row_moves, "INTERPRETED", True)
    monkeypatch.setattr(row_moves, "triton", object())
    checks, entry, kept = [], [], []
    fit = row_moves.fit
    monkeypatch.setattr(row_moves, "fit", lambda *a: checks.append(a[3]) or fit(*a))

    class Build:  # what Triton's entry returns; no launcher parts, so launched as build[grid]
        def __getitem__(self, grid):
            return lambda *args: kept.append((grid, args))
    monkeypatch.setattr(row_moves, "launch", lambda *a: entry.append(a[3]) or Build())
    seen = []
    moves = row_moves.RowMoves(lambda reason, detail: seen.append(detail))
    moves._stream = lambda index: 0  # no CUDA stream here
    x, buf = torch.zeros(6, 3), torch.zeros(4, 3)
    for picked in ([1, 3], [0, 2, 5], [4]):
        moves.gather([x, x], [buf, buf], torch.tensor(picked))
    assert checks == [False] and entry == [False] and len(kept) == 2
    grid, args = kept[-1]
    assert grid == (1, 2, 1) and args[1] == 1 and args[14:20] == (3, 3, 0, 0, 0, 0), (grid, args[:2], args[14:])
    # the kept build gets addresses, which Triton's launcher does not look up with the
    # driver; the unused slots repeat tensor 0's
    assert args[2:14] == (x.data_ptr(),) * 6 + (buf.data_ptr(),) * 6 and isinstance(args[0], int)
    moves.scatter([buf], [x], torch.tensor([1, 3]))  # a new signature: checked, then Triton's entry
    assert checks == [False, True] and entry == [False, True]
    with pytest.raises(IndexError, match="Number of indices"):  # the PyTorch ops refuse it too
        moves.scatter([buf], [x], torch.tensor([0, 1, 2, 3, 4]))
    with pytest.raises(ValueError, match="5 replay rows into a buffer of 4 rows"):
        moves.gather([x, x], [buf, buf], torch.tensor([0, 1, 2, 3, 4]))
    assert seen == ["trim op row moves: 5 replay rows for 4 rows; a launch per tensor instead"] * 2, seen
    assert checks == [False, True] and len(kept) == 2


def test_a_kept_build_that_fails_later_is_a_counted_fallback_for_every_signature(monkeypatch):
    """A launch from the kept build (a signature's later steps) that raises disables the
    kernel like a failing first build: counted, the PyTorch ops serve that call and
    every later one, in both directions."""
    monkeypatch.setattr(row_moves, "INTERPRETED", True)
    monkeypatch.setattr(row_moves, "triton", object())
    launches = []

    class Build:
        def __getitem__(self, grid):
            def run(*args):
                launches.append(grid)
                raise RuntimeError("launch failed")
            return run
    monkeypatch.setattr(row_moves, "launch", lambda *a: Build())
    seen = []
    moves = row_moves.RowMoves(lambda reason, detail: seen.append(detail))
    moves._stream = lambda index: 0
    x, buf, rows_t = torch.arange(12.0).view(6, 2), torch.zeros(4, 2), torch.tensor([1, 4])
    moves.gather([x], [buf], rows_t)  # the first: Triton's entry (stubbed), then kept
    assert not seen and moves._launchers
    moves.gather([x], [buf], rows_t)  # the kept build raises: the ops write the rows
    assert torch.equal(buf[:2], x[rows_t]) and len(launches) == 1
    out = torch.full((6, 2), 3.0)
    moves.scatter([buf], [out], rows_t)  # another signature: refused without a launch
    want = torch.zeros(6, 2)
    want[rows_t] = x[rows_t]
    assert torch.equal(out, want) and len(launches) == 1
    assert seen == ["trim op row moves: the kernel failed: RuntimeError: launch failed; "
                    "a launch per tensor instead"] * 2, seen


@needs_triton
def test_direct_launch_passes_the_stream_and_no_hooks_unless_a_hook_is_registered(monkeypatch):
    """The kept build's direct launch calls Triton's launcher with the stream and no hook
    chains; while a launch hook is registered (a profiler) it goes through Triton's path,
    so the hook sees the launch."""
    import triton

    from replay_backend.compat.triton import direct_launcher

    calls = []

    class Build:  # the parts of a compiled build the direct launch uses
        function, packed_metadata = "fn", "meta"

        def run(self, *args):
            calls.append(("direct", args))

        def __getitem__(self, grid):
            return lambda *args, stream=None: calls.append(("triton", grid, stream, args))

    # a stand-in's __getitem__ is not Triton's: take its layout as checked
    monkeypatch.setattr("replay_backend.compat.triton.launch_layout_verified", lambda build_type: True)
    launch = direct_launcher(Build())
    launch((3, 2, 1), 77, "a", 5)
    assert calls == [("direct", (3, 2, 1, 77, "fn", "meta", None, None, None, "a", 5))]
    hook = lambda metadata: None  # noqa: E731
    hooks = triton.knobs.runtime.launch_enter_hook
    if not hasattr(hooks, "add"):
        pytest.skip("this Triton's launch hooks are not chains")
    hooks.add(hook)
    try:
        launch((3, 2, 1), 77, "a", 5)
    finally:
        hooks.remove(hook)
    assert calls[-1] == ("triton", (3, 2, 1), 77, ("a", 5))
    assert direct_launcher(object()) is None  # a build without the launcher's parts


@needs_triton
def test_the_direct_launch_layout_is_checked_against_tritons_own_launch():
    """The direct launch restates how Triton's compiled kernel calls its launcher: it is
    used only where Triton's own ``CompiledKernel.__getitem__`` makes that call, and a
    Triton that calls it otherwise keeps its own entry, a counted fallback."""
    from triton.compiler.compiler import CompiledKernel

    from replay_backend import counters
    from replay_backend.compat.triton import direct_launcher, launch_layout_verified

    assert launch_layout_verified(CompiledKernel)  # the installed Triton's real source
    calls = []

    class Reordered:  # a later Triton whose launcher takes the metadata first
        function, packed_metadata = "fn", "meta"

        def run(self, *args):
            calls.append(args)

        def __getitem__(self, grid):
            def runner(*args, stream=None):
                self.run(self.packed_metadata, grid[0], grid[1], grid[2], stream, self.function, *args)
            return runner

    assert not launch_layout_verified(Reordered)
    with counters.expect(strict=False, fallbacks={"triton_launch_layout": 1}):
        assert direct_launcher(Reordered()) is None
