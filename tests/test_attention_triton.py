"""The attention kernel (models/attention_triton.py) on the CPU: under Triton's
interpreter in a child process, whole and with its global keys split, against the
PyTorch reference (attention_kernel_cases.py, which test_gpu.py runs compiled), and
the split plan's host arithmetic."""
from attention_kernel_cases import check_split_plan
from conftest import check_interpreted, needs_triton


@needs_triton
def test_kernel_whole_and_split_matches_the_reference():
    check_interpreted("attention_kernel_cases", "check_against_reference")


def test_split_plan_splits_only_few_programs_over_many_keys():
    check_split_plan()


@needs_triton
def test_model_steps_with_split_attention_match_the_reference_model():
    check_interpreted("attention_kernel_cases", "check_model_steps_split")
