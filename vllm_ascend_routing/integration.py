# SPDX-License-Identifier: Apache-2.0
"""The only module that patches vLLM. Called once by ``register()`` when ``VLLM_ASCEND_ROUTING=1``.

Patch manifest (every patch is idempotent; nothing is patched when the plugin is off):

- ``load_model`` of the model-runner classes: V1 ``vllm.v1.worker.gpu_model_runner.GPUModelRunner``,
  MRV2 ``vllm.v1.worker.gpu.model_runner.GPUModelRunner`` and the CPU runners that override it.
  Why: bind MoE layers to a static buffer before vLLM first compiles the model. Releases 0.22-0.30.
- ``init_routed_experts_capturer`` of the same classes. Why: vLLM's own init runs, our binding is
  used. Releases 0.22-0.30.
- ``_bind_routed_experts_capturer`` of the same classes. Why: hand vLLM's capturer the prepared buffer
  (upstream's bind misses the CPU MoE, raises on 0.27). Releases 0.22-0.27 call it.
- ``bind_routed_experts_capturer`` as imported by the runner modules. Why: redirect vLLM's module-level
  binder to the runner's hook. Releases 0.28-0.30.
- ``CPUFusedMOE`` instances' ``forward_method`` (per bound layer, at bind time, not the class). Why:
  record top-k ids the CPU MoE computes without the router. Releases 0.22-0.27.
- ``cpu_fused_moe._CPU_MOE_ACT_FN[SILU]``. Why: the CPU compat fix (``_cpu_compat``). Releases 0.20-0.27.
All are removed with the generation that needs them (see each adapter's SCAFFOLDING line).
"""

from __future__ import annotations

import importlib

from vllm_ascend_routing import _cpu_compat, ops
from vllm_ascend_routing._logging import get_logger
from vllm_ascend_routing.compat import UnsupportedVllmError, get_api, vllm_version
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
}


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
    fixed = device == "cpu" and _cpu_compat.apply()
    logger.info(
        "vllm-ascend-routing enabled: vLLM %s, API generation %s, platform %s, kernel backend %s%s",
        vllm_version(),
        api.generation.value,
        device,
        ops.kernel_backend(),
        ", CPU MoE compat fix applied" if fixed else "",
    )
