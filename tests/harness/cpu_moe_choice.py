# SPDX-License-Identifier: Apache-2.0
"""Which CPU MoE kernel vLLM 0.20-0.27 picks for a test model on this machine, asked of vLLM itself.

vLLM's ``CPUFusedMOE.check_grouped_gemm`` decides from the wheel's ops, the CPU (AMX or not) and the
weights' dtype and shapes. The answer is not "AVX-512 or not": on an AMX CPU float32 weights take the
pure-PyTorch loop (0.20-0.26; it crashes without the plugin's CPU compat fix) or are refused outright
(0.27). Tests and benchmarks ask here instead of guessing from CPU flags. Only shapes are passed
(meta tensors), so nothing is allocated or built.
"""

from __future__ import annotations

import contextlib
import enum
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import torch

from vllm_ascend_routing.preflight import models

CPU_MOE_MODULE = "vllm.model_executor.layers.fused_moe.cpu_fused_moe"


class CpuMoeKernel(enum.Enum):
    GROUPED_GEMM = "grouped-gemm"  # vLLM's packed kernels ("vec" or "amx")
    PURE_TORCH = "pure-torch"  # the per-expert loop, where 0.20-0.27 build SiluAndMul at forward time
    REFUSED = "refused"  # 0.27 on an AMX CPU: no kernel for these weights, the engine does not start
    MODULAR = "modular"  # no CPUFusedMOE (0.28+: modular CPU experts, no compat fix needed; or no vLLM)


def vllm_cpu_moe_kernel(architecture: str, dtype: torch.dtype = torch.float32) -> CpuMoeKernel:
    """The kernel the installed vLLM's CPU MoE would use for ``architecture``'s expert weights."""
    import importlib

    try:
        cpu_fused_moe = importlib.import_module(CPU_MOE_MODULE)
    except ImportError:
        return CpuMoeKernel.MODULAR
    fused_moe_class = getattr(cpu_fused_moe, "CPUFusedMOE", None)
    if fused_moe_class is None or not hasattr(fused_moe_class, "check_grouped_gemm"):
        return CpuMoeKernel.MODULAR
    _load_vllm_ops()
    checker = fused_moe_class.__new__(fused_moe_class)  # the check reads only the layer's weights
    try:
        uses_grouped_gemm, _isa = checker.check_grouped_gemm(_weights_only_layer(architecture, dtype, cpu_fused_moe))
    except RuntimeError:
        return CpuMoeKernel.REFUSED
    return CpuMoeKernel.GROUPED_GEMM if uses_grouped_gemm else CpuMoeKernel.PURE_TORCH


def _load_vllm_ops() -> None:
    """The check looks for ``torch.ops._C.prepack_moe_weight``: load vLLM's CPU ops as an engine does, through
    the platform, which picks the library this CPU runs (``_C``, ``_C_AVX512`` or ``_C_AVX2``, all registering
    namespace ``_C``: importing ``vllm._C`` after the platform loaded ``_C_AVX2`` aborts the process)."""
    # A wheel without them: the check then answers "pure-torch", as vLLM's engine would.
    with contextlib.suppress(ImportError):
        from vllm.platforms import current_platform

        current_platform.import_kernels()


def _weights_only_layer(architecture: str, dtype: torch.dtype, cpu_fused_moe: Any) -> SimpleNamespace:
    config = models.model_config(architecture)
    experts = int(getattr(config, "num_experts", None) or config.num_local_experts)
    hidden = int(config.hidden_size)
    intermediate = int(getattr(config, "moe_intermediate_size", None) or config.intermediate_size)
    activation = getattr(getattr(cpu_fused_moe, "MoEActivation", None), "SILU", None)
    return SimpleNamespace(
        w13_weight=torch.empty(experts, 2 * intermediate, hidden, dtype=dtype, device="meta"),
        w2_weight=torch.empty(experts, hidden, intermediate, dtype=dtype, device="meta"),
        activation=activation,
    )


NO_AMX_STANDIN = Path(__file__).with_name("no_amx_standin")


def engine_pythonpath_standin(architectures: tuple[str, ...] = models.ARCHITECTURES) -> Path | None:
    """TEST-ONLY: the stand-in folder for the engine processes' ``PYTHONPATH`` where this vLLM refuses a
    test model's float32 experts on this CPU (0.27 on AMX), else ``None`` (nothing changed)."""
    if any(vllm_cpu_moe_kernel(arch) is CpuMoeKernel.REFUSED for arch in architectures):
        return NO_AMX_STANDIN
    return None


def hide_amx(cpu_fused_moe: ModuleType) -> None:
    """TEST-ONLY (``no_amx_standin``): vLLM's CPU MoE kernel choice sees a CPU without AMX."""
    cpu_fused_moe.torch.cpu._is_amx_tile_supported = _no_amx


def _no_amx() -> bool:
    return False
