# SPDX-License-Identifier: Apache-2.0
"""cpu_moe_choice asks vLLM's own kernel choice with the test model's expert shapes (a fake vLLM here;
the e2e suite asks the real one in every release venv)."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch

from tests.harness import cpu_moe_choice
from tests.harness.cpu_moe_choice import CPU_MOE_MODULE, CpuMoeKernel, vllm_cpu_moe_kernel


def fake_cpu_fused_moe(monkeypatch: pytest.MonkeyPatch, answer: Any, seen: list[Any]) -> types.ModuleType:
    class CPUFusedMOE:
        def __init__(self) -> None:
            raise AssertionError("the check must not build the real object")

        def check_grouped_gemm(self, layer: Any) -> tuple[bool, str]:
            seen.append(layer)
            if isinstance(answer, Exception):
                raise answer
            return answer, "vec" if answer else "none"

    module = types.ModuleType(CPU_MOE_MODULE)
    module.CPUFusedMOE = CPUFusedMOE  # type: ignore[attr-defined]
    module.torch = torch  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, CPU_MOE_MODULE, module)
    return module


@pytest.mark.parametrize(
    ("answer", "kernel"),
    [
        (True, CpuMoeKernel.GROUPED_GEMM),
        (False, CpuMoeKernel.PURE_TORCH),
        (RuntimeError("AMX grouped-gemm kernel cannot be used"), CpuMoeKernel.REFUSED),
    ],
)
def test_vllm_answer_is_reported(monkeypatch: pytest.MonkeyPatch, answer: Any, kernel: CpuMoeKernel) -> None:
    seen: list[Any] = []
    fake_cpu_fused_moe(monkeypatch, answer, seen)
    assert vllm_cpu_moe_kernel("qwen3_moe") is kernel
    (layer,) = seen
    # the shapes vLLM itself reported for this model (0.27.1's refusal message): w13 (16, 128, 128), w2 (16, 128, 64)
    assert tuple(layer.w13_weight.shape) == (16, 128, 128) and tuple(layer.w2_weight.shape) == (16, 128, 64)
    assert layer.w13_weight.dtype == torch.float32 and layer.w13_weight.device.type == "meta"


def test_dtype_and_mixtral_sizes_reach_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []
    fake_cpu_fused_moe(monkeypatch, True, seen)
    vllm_cpu_moe_kernel("mixtral", torch.bfloat16)
    config = cpu_moe_choice.models.model_config("mixtral")
    experts, hidden, inner = config.num_local_experts, config.hidden_size, config.intermediate_size
    assert tuple(seen[0].w13_weight.shape) == (experts, 2 * inner, hidden)
    assert tuple(seen[0].w2_weight.shape) == (experts, hidden, inner) and seen[0].w2_weight.dtype == torch.bfloat16


def test_no_cpu_fused_moe_is_modular(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, CPU_MOE_MODULE, types.ModuleType(CPU_MOE_MODULE))
    assert vllm_cpu_moe_kernel("qwen3_moe") is CpuMoeKernel.MODULAR


def test_standin_only_where_vllm_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cpu_fused_moe(monkeypatch, False, [])
    assert cpu_moe_choice.engine_pythonpath_standin() is None
    fake_cpu_fused_moe(monkeypatch, RuntimeError("refused"), [])
    standin = cpu_moe_choice.engine_pythonpath_standin()
    assert standin is not None and (standin / "sitecustomize.py").is_file()


def test_hide_amx_changes_only_the_amx_answer() -> None:
    fake_torch = types.SimpleNamespace(cpu=types.SimpleNamespace(_is_amx_tile_supported=lambda: True))
    module = types.ModuleType(CPU_MOE_MODULE)
    module.torch = fake_torch  # type: ignore[attr-defined]
    cpu_moe_choice.hide_amx(module)
    assert fake_torch.cpu._is_amx_tile_supported() is False
