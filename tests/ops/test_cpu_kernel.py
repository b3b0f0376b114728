# SPDX-License-Identifier: Apache-2.0
"""The native build's C++ CPU kernel (csrc/cpu): through the op's CPU key and through its direct entry
(``_C.record_rows``, what the eager capture calls), against the oracle of ``tests/ops/vectors.py``. Runs where a
native build is loaded (make test-native-cpu builds one; elsewhere these tests skip: the host kernel serves)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.ops.vectors import POISON, Case, case_ids, make_case
from vllm_ascend_routing import ops
from vllm_ascend_routing.ops import _library
from vllm_ascend_routing.ops._native import RecordRows

pytestmark = pytest.mark.native_cpu


@pytest.fixture
def record_rows() -> RecordRows:
    native = _library.NATIVE_RECORD_ROWS
    assert native is not None
    return native


def test_the_native_build_serves_the_cpu() -> None:
    assert not _library.HOST_KERNEL and "native-cpp on cpu" in ops.kernel_backend()
    dump = torch._C._dispatch_dump("vllm_ascend_routing::record_topk_ids")
    cpu = [line for line in dump.splitlines() if line.startswith("CPU:")]
    assert cpu and "csrc/cpu/record_topk_ids.cpp" in cpu[0], dump


@pytest.mark.parametrize(("n", "k", "id_dtype", "checked"), case_ids())
def test_direct_entry_matches_oracle(
    record_rows: RecordRows, n: int, k: int, id_dtype: torch.dtype, checked: bool, run_seed: int
) -> None:
    case = make_case(n, k, id_dtype, checked, run_seed + n * 5 + k)
    expected, bad = case.expected()
    errors = torch.full((1,), 3, dtype=torch.int64)
    limit = -1 if case.num_experts is None else case.num_experts
    assert record_rows(case.ids, case.out, case.layer_id, limit, errors) is True
    np.testing.assert_array_equal(case.out.numpy(), expected)  # other rows and layers keep the poison
    assert int(errors) == 3 + bad


@pytest.mark.parametrize("dense", [False, True], ids=["layer-of-buffer", "dense-out"])
@pytest.mark.parametrize("checked", [True, False])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_every_top_k_and_layout_matches_oracle(
    record_rows: RecordRows, dense: bool, checked: bool, id_dtype: torch.dtype, run_seed: int
) -> None:
    """The kernel compiles a loop per common top-k (1, 2, 4, 6, 8, 10, 16), one for any other, and one for a
    dense ``out`` (a single layer): each against the oracle, with invalid ids when checked."""
    for k in range(1, 18):
        case = make_case(37, k, id_dtype, checked, run_seed + k)
        if dense:  # one layer: out rows are contiguous runs of K
            case = Case(case.ids, case.out[:, :1].contiguous(), 0, case.num_experts)
        expected, bad = case.expected()
        errors = torch.zeros(1, dtype=torch.int64)
        limit = -1 if case.num_experts is None else case.num_experts
        assert record_rows(case.ids, case.out, case.layer_id, limit, errors) is True
        np.testing.assert_array_equal(case.out.numpy(), expected, err_msg=f"K={k}")
        assert int(errors) == bad, f"K={k}"


@pytest.mark.parametrize("entry", ["op", "direct"])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_strided_ids_and_out(record_rows: RecordRows, entry: str, id_dtype: torch.dtype, run_seed: int) -> None:
    """Column-major ids (a transpose) into a permuted, non-contiguous ``out``, counted into an int32 counter."""
    ids = torch.randint(0, 64, (4, 9), dtype=id_dtype, generator=torch.Generator().manual_seed(run_seed))
    ids[0, 0], ids[3, 5], ids[2, 8] = -1, 64, 70  # invalid ids planted (never left to chance)
    ids = ids.t()  # [9, 4], strides (1, 9)
    out = torch.full((3, 12, 4), POISON, dtype=torch.int16).permute(1, 0, 2)  # [12, 3, 4], not contiguous
    case = Case(ids, out.clone(), layer_id=2, num_experts=64)
    expected, bad = case.expected()
    errors = torch.zeros(1, dtype=torch.int32)
    if entry == "op":
        ops.record_topk_ids(ids, out, 2, 64, errors)
    else:
        assert record_rows(ids, out, 2, 64, errors) is True
    np.testing.assert_array_equal(out.numpy(), expected)
    assert int(errors) == bad == 3


def test_the_kernel_is_built_to_split_large_batches_over_torchs_threads() -> None:
    """Compiled with OpenMP (csrc/CMakeLists.txt): without it ATen's parallel_reduce runs serially, and a long
    prefill's write on a many-core host stays on one thread while ``copy_`` uses them all."""
    from vllm_ascend_routing import _C  # type: ignore[attr-defined]

    assert _C.CPU_PARALLEL == 1


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("entry", ["op", "direct"])
def test_a_large_batch_split_over_threads_matches_oracle(
    record_rows: RecordRows, entry: str, threads: int, run_seed: int
) -> None:
    """Past 32768 ids the rows are split into parts written by torch's threads, each part's invalid count
    summed: an invalid id planted in every part, the rows strided, the same result at every thread count."""
    n, k, grain_rows = 5 * 4096 + 17, 8, 4096  # five and a bit parts of 32768 ids at top-8
    ids = torch.randint(0, 64, (n, k), generator=torch.Generator().manual_seed(run_seed))
    planted = [(part * grain_rows + 3, part % k) for part in range(6)]
    for row, slot in planted:
        ids[row, slot] = -1 if row % 2 else 64
    case = Case(ids, torch.full((n + 5, 3, k), POISON, dtype=torch.int16), layer_id=1, num_experts=64)
    expected, bad = case.expected()
    assert bad == len(planted)
    errors = torch.zeros(1, dtype=torch.int64)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        if entry == "op":
            ops.record_topk_ids(case.ids, case.out, 1, 64, errors)
        else:
            assert record_rows(case.ids, case.out, 1, 64, errors) is True
    finally:
        torch.set_num_threads(before)
    np.testing.assert_array_equal(case.out.numpy(), expected)
    assert int(errors) == bad


def test_the_storage_limit_caps_the_expert_count(record_rows: RecordRows) -> None:
    """More experts than int16 records: ids from 32767 on are invalid, as the rule says."""
    out, errors = torch.zeros(2, 1, 3, dtype=torch.int16), torch.zeros(1, dtype=torch.int64)
    ids = torch.tensor([[32766, 32767, 40000], [0, -1, 2**31 - 1]], dtype=torch.int32)
    assert record_rows(ids, out, 0, 50_000, errors)
    assert out[:, 0].tolist() == [[32766, -1, -1], [0, -1, -1]] and int(errors) == 4


def test_without_a_limit_ids_are_narrowed_as_copy_narrows(record_rows: RecordRows) -> None:
    ids = torch.tensor([[70_000, -5, 2**40 + 3]], dtype=torch.int64)
    out, errors = torch.zeros(1, 1, 3, dtype=torch.int16), torch.zeros(1, dtype=torch.int64)
    assert record_rows(ids, out, 0, -1, errors)
    assert out[:, 0].tolist() == ids.to(torch.int16).tolist() and int(errors) == 0


def _declined() -> list[tuple[str, dict[str, object]]]:
    """(why, the argument replaced): each one alone makes the direct entry decline."""
    return [
        ("K differs", {"ids": torch.zeros(2, 4, dtype=torch.int32)}),
        ("more tokens than rows", {"ids": torch.zeros(5, 3, dtype=torch.int32)}),
        ("float ids", {"ids": torch.zeros(2, 3)}),
        ("int16 ids", {"ids": torch.zeros(2, 3, dtype=torch.int16)}),
        ("1-D ids", {"ids": torch.zeros(3, dtype=torch.int32)}),
        ("ids of the meta device", {"ids": torch.zeros(2, 3, dtype=torch.int32, device="meta")}),
        ("out not int16", {"out": torch.zeros(4, 2, 3, dtype=torch.int32)}),
        ("out not [R, L, K]", {"out": torch.zeros(4, 3, dtype=torch.int16)}),
        ("layer past the last", {"layer_id": 2}),
        ("negative layer", {"layer_id": -1}),
        ("two-element counter", {"errors": torch.zeros(2, dtype=torch.int64)}),
        ("float counter", {"errors": torch.zeros(1)}),
    ]


@pytest.mark.parametrize(("why", "replaced"), _declined(), ids=[why for why, _ in _declined()])
def test_direct_entry_declines_what_is_not_the_kernels(record_rows: RecordRows, why: str, replaced: dict) -> None:
    """None, with nothing written: the capture then takes the op, which raises the op's own error."""
    args: dict[str, object] = {
        "ids": torch.ones(2, 3, dtype=torch.int32),
        "out": torch.full((4, 2, 3), POISON, dtype=torch.int16),
        "layer_id": 1,
        "errors": torch.zeros(1, dtype=torch.int64),
    }
    args.update(replaced)
    out = args["out"]
    before = out.clone() if isinstance(out, torch.Tensor) else None
    assert record_rows(args["ids"], out, args["layer_id"], 64, args["errors"]) is None, why  # type: ignore[arg-type]
    assert before is not None and torch.equal(out, before)  # type: ignore[arg-type]


def test_direct_entry_declines_tensor_subclasses(record_rows: RecordRows) -> None:
    """A tensor subclass with Python dispatch (as tracers' tensors are) is never written through its data."""
    from torch.testing._internal.two_tensor import TwoTensor

    ids = TwoTensor(torch.ones(2, 3, dtype=torch.int32), torch.ones(2, 3, dtype=torch.int32))
    out = torch.zeros(4, 2, 3, dtype=torch.int16)
    assert record_rows(ids, out, 1, 64, torch.zeros(1, dtype=torch.int64)) is None
    assert not out.any()


def test_direct_entry_refuses_what_is_not_a_tensor(record_rows: RecordRows) -> None:
    out, errors = torch.zeros(4, 2, 3, dtype=torch.int16), torch.zeros(1, dtype=torch.int64)
    with pytest.raises(TypeError):
        record_rows([[0, 0, 0]], out, 0, 64, errors)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        record_rows(torch.zeros(2, 3, dtype=torch.int32), out, 0, 64)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        record_rows(torch.zeros(2, 3, dtype=torch.int32), out, "0", 64, errors)  # type: ignore[arg-type]
    assert not out.any()


@pytest.mark.parametrize("errors_dtype", [torch.int32, torch.int64])
def test_the_capture_counts_invalid_ids_without_the_op(errors_dtype: torch.dtype) -> None:
    """The eager capture's direct entry stores -1 and adds the count to the capture's counter itself."""
    from vllm_ascend_routing.ops import LayerRecorder

    errors = torch.full((1,), 5, dtype=errors_dtype)
    out = torch.zeros(6, 2, 3, dtype=torch.int16)
    recorder = LayerRecorder(out, 1, 64, errors)
    recorder(torch.tensor([[1, 64, -1], [63, 0, 2]], dtype=torch.int32))
    recorder(torch.tensor([[7, 8, 9]], dtype=torch.int64))
    assert out[:, 1].tolist() == [[7, 8, 9], [63, 0, 2], [0, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert int(errors) == 7 and not out[:, 0].any()
