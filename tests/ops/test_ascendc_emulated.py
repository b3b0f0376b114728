# SPDX-License-Identifier: Apache-2.0
"""The AscendC kernel source, compiled with g++ (-Wall -Werror) against a CPU emulation of the AscendC primitives
it uses (tests/ops/native/ascendc_emulation), on the same vectors as every other backend.

What this proves, for the real kernel on every vector (1 .. 48 cores, uneven per-core splits included): its
tiling fits the 192 KiB UB; no two cores store into one 32-byte GM block; every GM read and write stays inside
the tensor the launcher passed (GM is registered by name and size, inputs read-only, with guard bytes that must
stay intact); 32-byte UB alignment of DataCopyPad and its strided and per-row addressing; queue discipline (each
tensor AllocTensor -> EnQue -> DeQue -> FreeTensor, no use after free or while enqueued, and at kernel end
nothing leaked or left enqueued); every core writes its error count; the invalid-id rule and its counts.

That the checks are not a rubber stamp: mutations of the REAL kernel and host tiling source (one controlled text
change each, applied to a copy at compile time) must each be rejected with the expected message: bad tiling (a
tail tile written past the output, cores sharing a 32-byte GM block), GM writes out of bounds, unaligned copies,
and leaked tensors. Each mutation's input passes on the unmutated kernel. Probes of the emulation itself
(native/ascendc_emulation_probes.cpp) cover the rest of its checks one misuse at a time.

What it cannot prove: that CANN compiles the kernel, vector-unit timing, or behaviour on a real NPU (needs Ascend
hardware).
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.ops.vectors import POISON, Case, case_ids, make_case

ROOT = Path(__file__).resolve().parents[2]
NATIVE = Path(__file__).resolve().parent / "native"
ASCEND = ROOT / "csrc" / "ascend"
EMULATION = NATIVE / "ascendc_emulation"


def compile_shared(source: Path, lib: Path, includes: list[Path], opt: str = "-O2") -> ctypes.CDLL:
    compiler = shutil.which("g++")
    assert compiler, "g++ is required to compile the AscendC kernel source under emulation"
    subprocess.run(
        # Hidden visibility: each library keeps its own emulation state though several share this process.
        [
            compiler,
            opt,
            "-std=c++17",
            "-shared",
            "-fPIC",
            "-Wall",
            "-Werror",
            "-fvisibility=hidden",
            "-fvisibility-inlines-hidden",
            *(f"-I{path}" for path in includes),
            str(source),
            "-o",
            str(lib),
        ],
        check=True,
    )
    return ctypes.CDLL(str(lib))


def compile_harness(ascend: Path, lib: Path, opt: str = "-O2") -> ctypes.CDLL:
    """The harness around the kernel and host tiling found under `ascend` (csrc/ascend or a mutated copy)."""
    return compile_shared(
        NATIVE / "ascendc_harness.cpp", lib, [EMULATION, ascend / "op_kernel", ascend / "op_host"], opt
    )


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    return compile_harness(ASCEND, tmp_path_factory.mktemp("ascendc") / "record_topk_ids_emulated.so")


def narrow_to_int32(t: torch.Tensor) -> np.ndarray:
    """What the torch_npu host does before launch: clamp (never wrap) ids into int32."""
    info = torch.iinfo(torch.int32)
    return np.ascontiguousarray(t.clamp(info.min, info.max).to(torch.int32).numpy())


def launch(kernel: ctypes.CDLL, case: Case, max_cores: int) -> tuple[int, str, int]:
    """(status, message, error count) of one emulated launch; status 0 means every check passed."""
    ids = narrow_to_int32(case.ids)
    out = case.out.numpy()
    errors = ctypes.c_int64(0)
    message = ctypes.create_string_buffer(512)
    n, k = case.ids.shape
    status = kernel.run_record_topk_ids(
        ids.ctypes.data_as(ctypes.c_void_p),
        out.ctypes.data_as(ctypes.c_void_p),
        *(
            ctypes.c_int64(v)
            for v in (
                n,
                k,
                out.shape[0],
                out.shape[1],
                case.layer_id,
                -1 if case.num_experts is None else case.num_experts,
                max_cores,
            )
        ),
        ctypes.byref(errors),
        message,
        ctypes.c_int64(len(message)),
    )
    return status, message.value.decode(), errors.value


def run_emulated(kernel: ctypes.CDLL, case: Case, max_cores: int) -> int:
    status, message, errors = launch(kernel, case, max_cores)
    assert status == 0, message
    return errors


@pytest.mark.parametrize(("n", "k", "id_dtype", "checked"), case_ids())
def test_matches_oracle(
    kernel: ctypes.CDLL, n: int, k: int, id_dtype: torch.dtype, checked: bool, run_seed: int
) -> None:
    case = make_case(n, k, id_dtype, checked, run_seed + n * 7 + k)
    expected, bad = case.expected()
    max_cores = 1 + (run_seed + n + k) % 48  # 1 .. 48 AI cores: uneven per-core splits included
    assert run_emulated(kernel, case, max_cores) == bad
    np.testing.assert_array_equal(case.out.numpy(), expected)


# --- mutations of the real kernel source ---------------------------------------------------------------------


def simple_case(n: int, k: int, num_layers: int) -> Case:
    """N tokens into exactly N int16 output rows (so an overrun leaves `out`), last layer, in-range ids."""
    gen = torch.Generator().manual_seed(n * 131 + k)
    ids = torch.randint(0, 100, (n, k), generator=gen, dtype=torch.int32)
    out = torch.full((n, num_layers, k), POISON, dtype=torch.int16)
    return Case(ids, out, num_layers - 1, 100)


@dataclass(frozen=True)
class Mutation:
    """One controlled text change of a file under csrc/ascend, and an input on which it must be rejected."""

    name: str
    file: str  # relative to csrc/ascend
    old: str  # must occur exactly once in the real source, so a drifted source fails loudly
    new: str
    case: Case
    max_cores: int
    messages: tuple[str, ...]  # substrings of the emulation's message (sizes that follow the tiling left out)


MUTATIONS = [
    # (a) bad tiling. The tail tile of a core is copied out as a full tile: its store runs past the output
    # (N = 7 tokens, one tile of up to 1024 tokens).
    Mutation(
        "tail_tile_written_in_full",
        "op_kernel/record_topk_ids_kernel.cpp",
        "      CopyOut(first_ + done, tokens);",
        "      CopyOut(first_ + done, tiling_.tile_tokens);",
        simple_case(7, 8, 1),
        1,
        (
            "core 0 of 1: AscendC emulation: DataCopyPad: GM write out of bounds: bytes [112, 128) of 'out' "
            "(112 bytes registered)",
        ),
    ),
    # (a) bad tiling. The host no longer keeps shapes whose adjacent tokens share a 32-byte GM block on one core:
    # with L = 1 and K = 8 int16, a token is 16 bytes, so cores 0 and 1 (one token each) split one block.
    Mutation(
        "block_dim_ignores_shared_blocks",
        "op_host/record_topk_ids_tiling.h",
        "tiling.top_k * kOutBytes < 32) return 1;",
        "tiling.top_k * kOutBytes < 0) return 1;",
        simple_case(7, 8, 1),
        8,
        ("core 1 of 7: AscendC emulation: two cores store into one 32-byte GM block (cores 0 and 1)",),
    ),
    # (a) bad tiling. Error counts one int32 apart instead of one 32-byte block per core.
    Mutation(
        "error_slots_share_a_block",
        "op_kernel/record_topk_ids_tiling_data.h",
        "constexpr int64_t kErrorsStride = 8;",
        "constexpr int64_t kErrorsStride = 1;",
        simple_case(64, 8, 48),
        4,
        ("core 1 of 4: AscendC emulation: two cores store into one 32-byte GM block (cores 0 and 1)",),
    ),
    # GM write bounds: DataCopyExtParams.dstStride is the GAP between GM blocks; passing the row stride spreads
    # the rows (L+1)*K apart and the last ones land past the output.
    Mutation(
        "dst_stride_as_row_stride",
        "op_kernel/record_topk_ids_kernel.cpp",
        "static_cast<uint32_t>((row_stride - tiling_.top_k) * sizeof(OutT));",
        "static_cast<uint32_t>(row_stride * sizeof(OutT));",
        simple_case(7, 8, 1),
        1,
        (
            "core 0 of 1: AscendC emulation: DataCopyPad: GM write out of bounds: bytes [128, 144) of 'out' "
            "(112 bytes registered)",
        ),
    ),
    # (b) unaligned copy. ids loaded with DataCopy, which moves whole 32-byte blocks: 7 tokens x 1 id = 28 bytes.
    Mutation(
        "ids_loaded_with_datacopy",
        "op_kernel/record_topk_ids_kernel.cpp",
        "    DataCopyPad(ids, ids_gm_[token * tiling_.top_k],\n"
        "                DataCopyExtParams(1, static_cast<uint32_t>(tokens * tiling_.top_k * sizeof(int32_t)),"
        " 0, 0, 0),\n"
        "                DataCopyPadExtParams<int32_t>(false, 0, 0, 0));",
        "    DataCopy(ids, ids_gm_[token * tiling_.top_k], static_cast<uint32_t>(tokens * tiling_.top_k));",
        simple_case(7, 1, 2),
        1,
        (
            "core 0 of 1: AscendC emulation: DataCopy: 28 bytes is not a multiple of 32 "
            "(use DataCopyPad for unaligned lengths)",
        ),
    ),
    # Queue discipline: the ids tile is freed right after DeQue, before Compute reads it.
    Mutation(
        "ids_freed_before_use",
        "op_kernel/record_topk_ids_kernel.cpp",
        "    LocalTensor<int32_t> ids = ids_queue_.DeQue<int32_t>();\n",
        "    LocalTensor<int32_t> ids = ids_queue_.DeQue<int32_t>();\n    ids_queue_.FreeTensor(ids);\n",
        simple_case(7, 8, 2),
        1,
        ("core 0 of 1: AscendC emulation: LocalTensor::GetValue: LocalTensor used after FreeTensor",),
    ),
    # The per-core error count is computed but never stored: the harness's poisoned slot stays.
    Mutation(
        "error_count_never_stored",
        "op_kernel/record_topk_ids_kernel.cpp",
        "    DataCopyPad(errors_gm_, count, DataCopyExtParams(1, sizeof(int32_t), 0, 0, 0));\n",
        "",
        simple_case(7, 8, 2),
        1,
        ("AscendC emulation: core 0 never wrote its error count",),
    ),
    # Last line of defence: a raw store through the GM pointer bypasses every emulated copy; the guard bytes the
    # harness puts around each GM buffer catch it.
    Mutation(
        "raw_store_before_errors_ws",
        "op_kernel/record_topk_ids_kernel.cpp",
        "    count.SetValue(0, errors);\n",
        "    count.SetValue(0, errors);\n    if (GetBlockIdx() == 0) errors_gm_.data()[-1] = 0;\n",
        simple_case(7, 8, 2),
        1,
        ("AscendC emulation: guard bytes around GM 'errors_ws' were overwritten",),
    ),
    # (c) leaked tensor. The output tile is never freed: with one tile per core, only the end-of-kernel balance
    # check can see it.
    Mutation(
        "out_tile_never_freed",
        "op_kernel/record_topk_ids_kernel.cpp",
        "    out_queue_.FreeTensor(out);\n",
        "",
        simple_case(7, 8, 2),
        1,
        (
            "core 0 of 1: AscendC emulation: unbalanced queues at kernel end: TQue #1 (VECOUT, 2 x ",
            " B): 1 tensor(s) from AllocTensor never passed to FreeTensor (leaked)",
        ),
    ),
    # (c) leaked tensor over many tiles: the third AllocTensor finds both buffers still held.
    Mutation(
        "out_tiles_never_freed_many_tiles",
        "op_kernel/record_topk_ids_kernel.cpp",
        "    out_queue_.FreeTensor(out);\n",
        "",
        simple_case(4096, 8, 2),
        1,
        (
            "core 0 of 1: AscendC emulation: TQue #1 (VECOUT, 2 x ",
            " B): AllocTensor with all 2 buffers in use (missing FreeTensor?)",
        ),
    ),
]


def mutated_tree(mutation: Mutation, root: Path) -> Path:
    """A copy of csrc/ascend with the mutation applied; fails if the real source no longer has the text."""
    tree = root / "ascend"
    shutil.copytree(ASCEND, tree)
    path = tree / mutation.file
    source = path.read_text()
    assert source.count(mutation.old) == 1, f"{mutation.name}: the text to mutate is not in {mutation.file} once"
    path.write_text(source.replace(mutation.old, mutation.new))
    return tree


@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda m: m.name)
def test_mutated_kernel_is_rejected(kernel: ctypes.CDLL, mutation: Mutation, tmp_path: Path) -> None:
    # The input is valid: the real kernel passes it and matches the oracle.
    control = Case(
        mutation.case.ids,
        mutation.case.out.clone(),
        mutation.case.layer_id,
        mutation.case.num_experts,
    )
    expected, bad = control.expected()
    assert run_emulated(kernel, control, mutation.max_cores) == bad
    np.testing.assert_array_equal(control.out.numpy(), expected)

    # -O0: these libraries run one small launch each, compile time dominates.
    broken = compile_harness(mutated_tree(mutation, tmp_path), tmp_path / "broken.so", "-O0")
    status, message, _ = launch(broken, mutation.case, mutation.max_cores)
    assert status == 1, f"{mutation.name}: the emulation accepted the mutated kernel"
    for expected in mutation.messages:
        assert expected in message


# --- probes of the emulation's checks ------------------------------------------------------------------------

PROBES = {
    "clean": None,
    "gm_write_past_registered_pad": "DataCopyPad: GM write out of bounds: bytes [32, 66) of 'output' (64 bytes",
    "gm_write_past_registered_strided": "DataCopyPad: GM write out of bounds: bytes [64, 72) of 'output'",
    "gm_write_past_registered_datacopy": "DataCopy: GM write out of bounds: bytes [32, 96) of 'output'",
    "gm_write_past_registered_setvalue": "GlobalTensor::SetValue: GM write out of bounds: bytes [64, 66) of 'output'",
    "gm_write_past_declared_size": "DataCopyPad: GM write out of bounds: bytes [0, 10) of a GlobalTensor of 8 bytes",
    "gm_write_into_input": "GlobalTensor::SetValue: GM write into read-only input 'input'",
    "gm_unregistered_address": "SetGlobalBuffer: address is not inside any registered GM buffer",
    "gm_null_buffer_write": "GlobalTensor::SetValue: GM write through a GlobalTensor with no buffer",
    "gm_size_exceeds_registered": "SetGlobalBuffer: bytes [16, 80) exceed registered GM 'output' (64 bytes)",
    "ub_misaligned_pad": "DataCopyPad: UB src not 32B aligned (UB byte 6)",
    "datacopy_partial_block": "DataCopy: 20 bytes is not a multiple of 32",
    "leaked_alloc": "unbalanced queues at kernel end: TQue #0 (VECOUT, 2 x 32 B): 1 tensor(s) from AllocTensor "
    "never passed to FreeTensor (leaked)",
    "enque_never_dequeued": "unbalanced queues at kernel end: TQue #0 (VECIN, 2 x 32 B): 1 tensor(s) EnQue'd and "
    "never DeQue'd",
    "double_free": "FreeTensor of a tensor that is not allocated (double free?)",
    "free_while_enqueued": "FreeTensor of a tensor still EnQue'd (DeQue it first)",
    "use_after_free": "LocalTensor::SetValue: LocalTensor used after FreeTensor",
    "use_while_enqueued": "LocalTensor::SetValue: LocalTensor used while EnQue'd (before DeQue)",
    "enque_beyond_depth": "EnQue beyond the queue depth 1",
    "alloc_beyond_buffers": "AllocTensor with all 2 buffers in use (missing FreeTensor?)",
    "ub_overflow": "Unified Buffer overflow (192 KiB per core)",
}


@pytest.fixture(scope="module")
def probes(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    lib = compile_shared(
        NATIVE / "ascendc_emulation_probes.cpp",
        tmp_path_factory.mktemp("ascendc_probes") / "probes.so",
        [EMULATION],
        "-O0",
    )
    lib.probe_count.restype = ctypes.c_int64
    assert lib.probe_count() == len(PROBES), "every probe in the C++ file has an expectation here"
    return lib


@pytest.mark.parametrize("name", PROBES)
def test_emulation_check_fires(probes: ctypes.CDLL, name: str) -> None:
    message = ctypes.create_string_buffer(512)
    status = probes.run_probe(name.encode(), message, ctypes.c_int64(len(message)))
    expected = PROBES[name]
    if expected is None:
        assert status == 0, message.value.decode()
    else:
        assert status == 1, f"{name}: no check fired"
        assert expected in message.value.decode()
