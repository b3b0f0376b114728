# SPDX-License-Identifier: Apache-2.0
"""The CUDA kernel: compiled by nvcc wherever nvcc exists; run against the oracle where a GPU exists."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests.ops import gpu_cases
from tests.ops.vectors import case_ids
from vllm_ascend_routing.ops._native import native_backend

ROOT = Path(__file__).resolve().parents[2]


def test_kernel_compiles_with_nvcc(tmp_path: Path) -> None:
    """Every dtype combination the binding dispatches to compiles (no GPU, no CUDA torch needed)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not installed here")
    subprocess.run(
        [
            nvcc,
            "-c",
            f"-I{ROOT / 'csrc/cuda'}",
            str(ROOT / "tests/ops/native/cuda_compile_check.cu"),
            "-o",
            str(tmp_path / "check.o"),
        ],
        check=True,
    )


@pytest.fixture
def cuda_native() -> None:
    assert native_backend() == "cuda", (
        "build the CUDA kernel first: VLLM_ASCEND_ROUTING_TARGET_DEVICE=cuda pip install --no-build-isolation ."
    )


@pytest.mark.cuda
@pytest.mark.parametrize(("n", "k", "id_dtype", "checked"), case_ids())
def test_matches_oracle_on_gpu(
    cuda_native: None, n: int, k: int, id_dtype: torch.dtype, checked: bool, run_seed: int
) -> None:
    gpu_cases.matches_oracle(n, k, id_dtype, checked, run_seed + n * 7 + k)


@pytest.mark.cuda
def test_cuda_graph_capture_and_replay(cuda_native: None) -> None:
    gpu_cases.graph_replays_new_ids()


@pytest.mark.cuda
def test_opcheck_on_gpu(cuda_native: None) -> None:
    gpu_cases.opcheck()


@pytest.mark.cuda
def test_layer_captures_of_several_layers_replay_into_one_buffer(cuda_native: None) -> None:
    """What a CUDA-graph rollout does: one graph holding every MoE layer's router top-k and its LayerCapture
    call, replayed step after step into the one shared buffer; every layer's rows are the step's top-k ids,
    a dense layer and the rows past the step stay untouched, invalid ids are -1 and counted."""
    from vllm_ascend_routing.capture import LayerCapture

    tokens, num_layers, top_k, experts = 48, 6, 4, 32
    moe_layers = (0, 1, 3, 4, 5)  # layer 2 dense: no capture
    buffer = torch.zeros(tokens + 8, num_layers, top_k, dtype=torch.int16, device="cuda")
    errors = torch.zeros(1, dtype=torch.int64, device="cuda")
    captures = [LayerCapture(buffer, layer, experts, errors) for layer in moe_layers]
    logits = torch.zeros(len(moe_layers), tokens, experts, device="cuda")  # the graph's static inputs
    shift = torch.zeros(len(moe_layers), 1, 1, dtype=torch.int32, device="cuda")  # plants invalid ids

    def forward() -> None:
        for index, capture in enumerate(captures):
            capture(torch.topk(logits[index], top_k, dim=-1).indices.to(torch.int32) + shift[index])

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    generator = torch.Generator(device="cuda").manual_seed(0)
    for step in range(3):
        logits.copy_(torch.randn(logits.shape, generator=generator, device="cuda"))
        shift.zero_()
        if step == 2:
            shift[1] = experts  # layer 1's ids all out of range this step
        buffer.zero_()
        errors.zero_()
        graph.replay()
        torch.cuda.synchronize()
        for index, layer in enumerate(moe_layers):
            ids = torch.topk(logits[index], top_k, dim=-1).indices + shift[index]
            expected = torch.where(ids >= experts, -1, ids).to(torch.int16)
            assert torch.equal(buffer[:tokens, layer], expected), (step, layer)
        assert not buffer[:, 2].any() and not buffer[tokens:].any(), step
        assert int(errors) == (tokens * top_k if step == 2 else 0), step
