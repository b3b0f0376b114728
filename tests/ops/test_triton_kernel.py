# SPDX-License-Identifier: Apache-2.0
"""The Triton kernel (``ops/_triton.py``): against the oracle in Triton's interpreter on the CPU (make test-native,
where Triton is installed), and on a GPU through the op's CUDA dispatch, in a CUDA graph too (make gpu-check, before
it builds the native kernel, which would take the CUDA key)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from tests.ops import gpu_cases
from tests.ops.vectors import NUM_TOKENS, case_ids, make_case
from vllm_ascend_routing import ops
from vllm_ascend_routing.ops import _triton

# The interpreter runs each program in NumPy: every shape but the largest token count.
INTERPRETED = [case for case in case_ids() if case[0] < max(NUM_TOKENS)]


@pytest.fixture
def interpreted(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Triton's interpreter (CPU tensors, the same kernel source): set before the kernel is first decorated."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _triton._kernel.cache_clear()
    yield
    _triton._kernel.cache_clear()


@pytest.mark.triton
@pytest.mark.parametrize(("n", "k", "id_dtype", "checked"), INTERPRETED)
def test_matches_oracle_in_the_interpreter(
    interpreted: None, n: int, k: int, id_dtype: torch.dtype, checked: bool, run_seed: int
) -> None:
    case = make_case(n, k, id_dtype, checked, run_seed + n * 7 + k)
    expected, bad = case.expected()
    errors = torch.zeros(1, dtype=torch.int64)
    _triton.record_topk_ids_triton(case.ids, case.out, case.layer_id, case.num_experts, errors)
    assert int(errors) == bad
    np.testing.assert_array_equal(case.out.numpy(), expected)


@pytest.mark.triton
def test_strided_ids_and_an_int32_counter_in_the_interpreter(interpreted: None) -> None:
    """ids that are a strided view (a column slice of a wider tensor) and a 32-bit error counter."""
    wide = torch.tensor([[1, 9, 2, 9], [40, 9, -1, 9], [3, 9, 4, 9]], dtype=torch.int32)
    ids = wide[:, ::2]
    out = torch.full((4, 2, 2), 77, dtype=torch.int16)
    errors = torch.zeros(1, dtype=torch.int32)
    _triton.record_topk_ids_triton(ids, out, 1, 32, errors)
    assert out[:3, 1].tolist() == [[1, 2], [-1, -1], [3, 4]]
    assert (out[:, 0] == 77).all() and (out[3] == 77).all()
    assert int(errors) == 2


@pytest.fixture
def cuda_triton() -> None:
    assert ops.TRITON_KERNEL and ops.native_backend() is None, (
        f"the op's CUDA kernel is not Triton's here ({ops.kernel_backend()}): run without the native build"
    )


@pytest.mark.cuda
@pytest.mark.triton
@pytest.mark.parametrize(("n", "k", "id_dtype", "checked"), case_ids())
def test_matches_oracle_on_gpu(
    cuda_triton: None, n: int, k: int, id_dtype: torch.dtype, checked: bool, run_seed: int
) -> None:
    gpu_cases.matches_oracle(n, k, id_dtype, checked, run_seed + n * 7 + k)


@pytest.mark.cuda
@pytest.mark.triton
def test_cuda_graph_capture_and_replay(cuda_triton: None) -> None:
    gpu_cases.graph_replays_new_ids()


@pytest.mark.cuda
@pytest.mark.triton
def test_opcheck_on_gpu(cuda_triton: None) -> None:
    gpu_cases.opcheck()
