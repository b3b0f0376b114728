# SPDX-License-Identifier: Apache-2.0
"""The only module that applies patches. Called once by ``register()`` when ``VLLM_ASCEND_ROUTING=1``.

What is patched, why, for which releases and when to remove it is listed in ``manifest.PATCHES``; the
generation adapters (``compat``) and backends (``backends``) own the patches themselves.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

from vllm_ascend_routing import _cpu_compat, manifest, ops, validate
from vllm_ascend_routing._logging import get_logger
from vllm_ascend_routing._post_import import when_imported
from vllm_ascend_routing.compat import UnsupportedVllmError, get_api, vllm_version
from vllm_ascend_routing.compat.base import CaptureAPI
from vllm_ascend_routing.runner_mixin import apply_mixin

logger = get_logger(__name__)

# Model-runner classes per platform device type; absent modules are skipped (a release may lack MRV2).
_GPU_RUNNERS = (
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner",  # V1 runner
    "vllm.v1.worker.gpu.model_runner:GPUModelRunner",  # Model Runner V2 (0.26+)
)
_RUNNERS = {
    "cuda": _GPU_RUNNERS,
    # The CPU runners subclass the GPU ones and override load_model, so they are patched too.
    "cpu": (
        *_GPU_RUNNERS,
        "vllm.v1.worker.cpu_model_runner:CPUModelRunner",
        "vllm.v1.worker.cpu.model_runner:CPUModelRunner",
    ),
    # vllm-ascend's runners override the hooked methods: patched when the worker imports them.
    "npu": _GPU_RUNNERS,
}
_NPU_RUNNERS = (
    "vllm_ascend.worker.model_runner_v1:NPUModelRunner",
    "vllm_ascend.worker.v2.model_runner:NPUModelRunner",
)


def _load(path: str) -> type | None:
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return None
    cls = getattr(module, attr, None)
    return cls if isinstance(cls, type) else None


def install() -> None:
    """Detect the vLLM generation, patch the runner hooks, log one start-up line."""
    api = get_api()
    from vllm.platforms import current_platform

    device = str(current_platform.device_type)
    if device not in _RUNNERS:
        raise UnsupportedVllmError(
            f"vllm-ascend-routing: platform '{device}' is not supported by this version "
            f"(supported: {', '.join(sorted(_RUNNERS))}); unset VLLM_ASCEND_ROUTING."
        )
    runners = [cls for cls in map(_load, _RUNNERS[device]) if cls is not None]
    if not runners:
        raise UnsupportedVllmError(f"vllm-ascend-routing: no model runner found for '{device}'.")
    for cls in runners:
        apply_mixin(cls)
    api.install()
    validate.install()
    if device == "npu":
        for path in _NPU_RUNNERS:
            module_name, _, attr = path.partition(":")
            when_imported(module_name, functools.partial(_patch_npu_runner, attr=attr, api=api))
    fixed = device == "cpu" and _cpu_compat.apply()
    logger.info(
        "vllm-ascend-routing enabled: vLLM %s, API generation %s, platform %s, kernel backend %s%s",
        vllm_version(),
        api.generation.value,
        device,
        ops.kernel_backend(),
        ", CPU MoE compat fix applied" if fixed else "",
    )


def _patch_npu_runner(module: ModuleType, *, attr: str, api: CaptureAPI) -> None:
    """Runs right after the worker imports a vllm-ascend runner module: check, then patch."""
    manifest.verify(api.generation, "npu")
    cls = getattr(module, attr, None)
    if isinstance(cls, type):
        apply_mixin(cls)
    api.install_ascend()
