# SPDX-License-Identifier: Apache-2.0
"""record_topk_ids against the oracle (the op's invalid-id rule in NumPy): through the dispatcher (the host
kernel on the CPU) and the PyTorch reference called directly (what every device without a native kernel runs);
compile, opcheck."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.ops.vectors import Case, case_ids, make_case
from vllm_ascend_routing.ops import _library, record_topk_ids
from vllm_ascend_routing.ops._reference import record_topk_ids_reference

KERNELS = {"dispatcher": record_topk_ids, "reference": record_topk_ids_reference}


def run_op(case: Case, kernel: str = "dispatcher") -> int:
    errors = torch.zeros(1, dtype=torch.int64)
    KERNELS[kernel](case.ids, case.out, case.layer_id, case.num_experts, errors)
    return int(errors)


@pytest.mark.host_kernel
def test_cpu_tensors_dispatch_to_the_host_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _library.HOST_KERNEL
    seen: list[str] = []
    from vllm_ascend_routing.ops import _host

    original = _host.checked_array
    monkeypatch.setattr(_host, "checked_array", lambda *a: seen.append("host") or original(*a))
    out, errors = torch.zeros(1, 1, 2, dtype=torch.int16), torch.zeros(1, dtype=torch.int64)
    record_topk_ids(torch.tensor([[70, 1]]), out, 0, 64, errors)
    assert seen == ["host"]
    assert out.tolist() == [[[-1, 1]]] and int(errors) == 1  # 70 >= 64 experts: stored as -1, counted


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize(("n", "k", "id_dtype", "checked"), case_ids())
def test_matches_oracle(kernel: str, n: int, k: int, id_dtype: torch.dtype, checked: bool, run_seed: int) -> None:
    case = make_case(n, k, id_dtype, checked, run_seed + n * 7 + k)
    expected, bad = case.expected()
    assert run_op(case, kernel) == bad
    np.testing.assert_array_equal(case.out.numpy(), expected)  # untouched rows/layers keep the poison


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_hand_written_vector_and_the_oracle_agree(kernel: str) -> None:
    """The oracle's rule checked against values written by hand (padding -1, an id of no expert, an int64 id
    that wraps into range if narrowed first, the last valid id), and every kernel against both."""
    ids = torch.tensor([[5, -1], [300, 2**40 + 5], [299, 0]], dtype=torch.int64)
    case = Case(ids, torch.full((4, 2, 2), 77, dtype=torch.int16), layer_id=1, num_experts=300)
    by_hand = np.full((4, 2, 2), 77, dtype=np.int16)
    by_hand[:3, 1] = [[5, -1], [-1, -1], [299, 0]]
    expected, bad = case.expected()
    np.testing.assert_array_equal(expected, by_hand)
    assert bad == 3
    assert run_op(case, kernel) == 3
    np.testing.assert_array_equal(case.out.numpy(), by_hand)


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_an_id_equal_to_the_expert_count_is_invalid_in_a_batch_of_valid_ids(kernel: str, id_dtype: torch.dtype) -> None:
    """No negative id in the batch: the largest id is the expert count itself, the one id the host kernel's
    single ``max < limit`` reduction must still refuse (stored as -1, counted)."""
    out = torch.full((3, 2, 2), 77, dtype=torch.int16)
    errors = torch.zeros(1, dtype=torch.int64)
    KERNELS[kernel](torch.tensor([[299, 0], [300, 5]], dtype=id_dtype), out, 1, 300, errors)
    assert out[:2, 1].tolist() == [[299, 0], [-1, 5]] and int(errors) == 1
    assert (out[:, 0] == 77).all() and (out[2] == 77).all()  # no other row or layer written


def test_without_num_experts_values_are_cast() -> None:
    out = torch.zeros(2, 1, 2, dtype=torch.int16)
    record_topk_ids(torch.tensor([[3, 9], [0, 1]], dtype=torch.int32), out, 0)
    assert out[:, 0].tolist() == [[3, 9], [0, 1]]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"layer_id": 4}, "layer_id 4"),
        ({"ids": torch.zeros(9, 2, dtype=torch.int32)}, "do not fit"),
        ({"ids": torch.zeros(2, 3, dtype=torch.int32)}, "top_k mismatch"),
        ({"ids": torch.zeros(2, 2)}, "int32 or int64"),
        ({"out": torch.zeros(8, 4, 2, dtype=torch.int32)}, "must be int16"),
    ],
)
def test_bad_arguments_raise(kwargs: dict, message: str) -> None:
    ids = kwargs.get("ids", torch.zeros(2, 2, dtype=torch.int32))
    out = kwargs.get("out", torch.zeros(8, 4, 2, dtype=torch.int16))
    with pytest.raises((RuntimeError, TypeError, ValueError), match=message):
        record_topk_ids(ids, out, kwargs.get("layer_id", 0))


def test_write_survives_torch_compile_fullgraph() -> None:
    """The reason the op exists: a compiled callback must keep the write into a captured buffer."""
    buffer = torch.zeros(16, 3, 2, dtype=torch.int16)

    def layer_forward(x: torch.Tensor) -> torch.Tensor:
        ids = torch.topk(x, 2, dim=-1).indices.to(torch.int32)
        record_topk_ids(ids, buffer, 1, x.shape[-1])
        return x * 2

    compiled = torch.compile(layer_forward, fullgraph=True)
    x = torch.randn(5, 8)
    expected = torch.topk(x, 2, dim=-1).indices
    y = compiled(x)
    torch.testing.assert_close(y, x * 2)
    assert buffer[:5, 1].tolist() == expected.tolist()
    assert (buffer[:, [0, 2]] == 0).all() and (buffer[5:] == 0).all()
    x2 = torch.randn(5, 8)  # a second call with new data updates the buffer again
    compiled(x2)
    assert buffer[:5, 1].tolist() == torch.topk(x2, 2, dim=-1).indices.tolist()


def test_fake_kernel_under_compile_with_invalid_ids_and_empty_batch() -> None:
    buffer = torch.zeros(8, 2, 2, dtype=torch.int16)
    errors = torch.zeros(1, dtype=torch.int32)

    @torch.compile(fullgraph=True)
    def record(ids: torch.Tensor) -> None:
        record_topk_ids(ids, buffer, 0, 4, errors)

    record(torch.tensor([[1, 9], [-1, 3]], dtype=torch.int32))
    record(torch.zeros(0, 2, dtype=torch.int32))  # N == 0 is valid
    assert buffer[:2, 0].tolist() == [[1, -1], [-1, 3]] and int(errors) == 2  # 9 >= 4 experts; padding -1
    assert int(buffer.sum()) == 2


def test_opcheck() -> None:
    op = torch.ops.vllm_ascend_routing.record_topk_ids.default
    ids = torch.randint(0, 8, (6, 2), dtype=torch.int32)
    for args in [
        (ids, torch.zeros(8, 3, 2, dtype=torch.int16), 2, 8, torch.zeros(1, dtype=torch.int32)),
        (ids, torch.zeros(8, 3, 2, dtype=torch.int16), 0, None, torch.zeros(1, dtype=torch.int64)),
    ]:
        torch.library.opcheck(op, args)
