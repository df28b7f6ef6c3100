"""The grouped MoE's sort, SwiGLU and combine kernels (reference/moe_triton.py) on the CPU:
under Triton's interpreter in a child process, against the PyTorch ops they replace,
and the whole op with and without them (moe_kernel_cases.py, which test_gpu.py runs
compiled)."""
from conftest import check_interpreted, needs_triton


@needs_triton
def test_kernels_sort_apply_swiglu_and_combine_like_the_pytorch_ops():
    check_interpreted("moe_kernel_cases", "check_against_reference")
