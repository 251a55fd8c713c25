"""WriteBackAdamW's fused expert step on a GPU against torch's fused AdamW (write_back_cases.py)."""

from __future__ import annotations

import pytest

from tests.moontrain.optim.write_back_cases import (
    check_bf16_moment_step_on_the_gpu_matches_the_cpu,
    check_write_back_bf16_moments,
    check_write_back_many_tensors,
    check_write_back_matches_adamw,
    check_write_back_skips_on_the_flag,
)

pytestmark = pytest.mark.gpu


def test_write_back_adamw_matches_fused_adamw_gpu() -> None:
    check_write_back_matches_adamw("cuda", fused=True, exact_rounding=True)


def test_write_back_adamw_skips_on_the_device_flag_gpu() -> None:
    check_write_back_skips_on_the_flag("cuda", fused=True)


def test_write_back_steps_many_tensors_in_one_launch_gpu() -> None:
    check_write_back_many_tensors("cuda", exact_rounding=True)


def test_write_back_with_bf16_moments_matches_its_specification_gpu() -> None:
    check_write_back_bf16_moments("cuda")


def test_bf16_moment_step_of_the_rest_runs_the_kernel_gpu() -> None:
    check_bf16_moment_step_on_the_gpu_matches_the_cpu()
