# SPDX-License-Identifier: Apache-2.0
"""The AscendC kernel source, compiled with g++ against a CPU emulation of the AscendC primitives it uses
(tests/ops/native/ascendc_emulation), on the same vectors as every other backend.

What this proves: the kernel's tiling, per-core split (no two cores store into one 32-byte GM block), queue
discipline, 32-byte UB alignment, strided and per-row DataCopyPad addressing, range check, padding rows
and error counting. What it cannot prove: that
CANN compiles it, vector-unit timing, or behaviour on a real NPU (needs Ascend hardware).
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.ops.vectors import Case, case_ids, make_case

ROOT = Path(__file__).resolve().parents[2]
NATIVE = Path(__file__).resolve().parent / "native"


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    compiler = shutil.which("g++")
    assert compiler, "g++ is required to compile the AscendC kernel source under emulation"
    lib = tmp_path_factory.mktemp("ascendc") / "record_topk_ids_emulated.so"
    subprocess.run(
        [compiler, "-O2", "-std=c++17", "-shared", "-fPIC", "-Wall", "-Werror",
         f"-I{NATIVE / 'ascendc_emulation'}", f"-I{ROOT / 'csrc/ascend/op_kernel'}",
         f"-I{ROOT / 'csrc/ascend/op_host'}", str(NATIVE / "ascendc_harness.cpp"), "-o", str(lib)],
        check=True,
    )
    return ctypes.CDLL(str(lib))


def narrow_to_int32(t: torch.Tensor) -> np.ndarray:
    """What the torch_npu host does before launch: clamp (never wrap) ids and rows into int32."""
    info = torch.iinfo(torch.int32)
    return np.ascontiguousarray(t.clamp(info.min, info.max).to(torch.int32).numpy())


def run_emulated(kernel: ctypes.CDLL, case: Case, max_cores: int) -> int:
    ids = narrow_to_int32(case.ids)
    rows = None if case.rows is None else narrow_to_int32(case.rows)
    out = case.out.numpy()
    errors = ctypes.c_int64(0)
    message = ctypes.create_string_buffer(512)
    n, k = case.ids.shape
    status = kernel.run_record_topk_ids(
        ids.ctypes.data_as(ctypes.c_void_p),
        None if rows is None else rows.ctypes.data_as(ctypes.c_void_p),
        out.ctypes.data_as(ctypes.c_void_p),
        ctypes.c_int(int(case.out.dtype == torch.uint8)),
        *(ctypes.c_int64(v) for v in (n, k, out.shape[0], out.shape[1], case.layer_id,
                                       -1 if case.num_experts is None else case.num_experts, max_cores)),
        ctypes.byref(errors), message, ctypes.c_int64(len(message)),
    )
    assert status == 0, message.value.decode()
    return errors.value


@pytest.mark.parametrize(("n", "k", "id_dtype", "with_rows", "out_dtype", "checked"), case_ids())
def test_matches_oracle(kernel: ctypes.CDLL, n: int, k: int, id_dtype: torch.dtype, with_rows: bool,
                        out_dtype: torch.dtype, checked: bool, run_seed: int) -> None:
    case = make_case(n, k, id_dtype, with_rows, out_dtype, checked, run_seed + n * 7 + k)
    expected, bad = case.expected()
    max_cores = 1 + (run_seed + n + k) % 48  # 1 .. 48 AI cores: uneven per-core splits included
    assert run_emulated(kernel, case, max_cores) == bad
    np.testing.assert_array_equal(case.out.numpy(), expected)


def test_emulation_catches_a_misaligned_copy(kernel: ctypes.CDLL, tmp_path: Path) -> None:
    """The emulation is not a rubber stamp: an unaligned UB copy, as a wrong kernel would do, fails."""
    probe = tmp_path / "probe.cpp"
    probe.write_text(
        '#include "kernel_operator.h"\n'
        "using namespace AscendC;\n"
        'extern "C" int probe() {\n'
        "  emulation::begin_core(0, 1); TPipe pipe; TBuf<QuePosition::VECCALC> buf; pipe.InitBuffer(buf, 64);\n"
        "  int16_t gm[16] = {0}; GlobalTensor<int16_t> g; g.SetGlobalBuffer(gm, 16);\n"
        "  LocalTensor<int16_t> t = buf.Get<int16_t>();\n"
        "  try { DataCopyPad(g, t[3], DataCopyExtParams(1, 4, 0, 0, 0)); }\n"
        "  catch (const std::logic_error&) { return 1; }\n"
        "  return 0;\n"
        "}\n"
    )
    lib = tmp_path / "probe.so"
    subprocess.run(["g++", "-std=c++17", "-shared", "-fPIC", f"-I{NATIVE / 'ascendc_emulation'}", str(probe),
                    "-o", str(lib)], check=True)
    assert ctypes.CDLL(str(lib)).probe() == 1
