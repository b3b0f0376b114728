# SPDX-License-Identifier: Apache-2.0
"""The only module that installs patches. Called once by ``register()`` when ``VLLM_ASCEND_ROUTING=1``.

Order: detect the generation, verify every target it relies on (``manifest.verify``: a missing one is
refused with its name before anything is patched), then let the adapter, the runner hooks, validation and
the CPU compat fix apply their own rows. vllm-ascend's targets are verified and patched when its worker
imports its runner module.
"""

from __future__ import annotations

import functools
from types import ModuleType

from vllm_ascend_routing import _cpu_compat, kv, manifest, ops, output, peers, validate
from vllm_ascend_routing._logging import get_logger
from vllm_ascend_routing._post_import import when_imported
from vllm_ascend_routing.compat import UnsupportedVllmError, get_api, vllm_version
from vllm_ascend_routing.compat.base import CaptureAPI
from vllm_ascend_routing.patching import resolve
from vllm_ascend_routing.runner_mixin import apply_mixin

logger = get_logger(__name__)


def _load(path: str) -> type | None:
    try:
        cls = resolve(path)
    except LookupError:
        return None
    return cls if isinstance(cls, type) else None


def install() -> None:
    """Detect the vLLM generation, verify its targets, patch, log one start-up line."""
    api = get_api()
    from vllm.platforms import current_platform

    device = str(current_platform.device_type)
    if device not in api.runner_classes:
        raise UnsupportedVllmError(
            f"vllm-ascend-routing: platform '{device}' is not supported by this version "
            f"(supported: {', '.join(sorted(api.runner_classes))}); unset VLLM_ASCEND_ROUTING."
        )
    findings = manifest.verify(api.generation, device, "vllm")
    runners = api.runner_classes[device]
    for cls in filter(None, (_load(runner.path) for runner in runners if not runner.in_vllm_ascend)):
        apply_mixin(cls, api)
    api.install()
    if api.kv_rows is not None:  # rows follow KV connectors where the generation can carry them
        kv.follower.install(api.kv_rows)
    validate.install()
    output.install(api, vllm_version())
    peers.install(api.routed_experts_requested)
    if device == "npu":
        for runner in runners:
            if runner.in_vllm_ascend:
                module_name, _, attr = runner.path.partition(":")
                when_imported(module_name, functools.partial(_patch_npu_runner, attr=attr, api=api))
    fixed = device == "cpu" and _cpu_compat.apply()
    logger.info(
        "vllm-ascend-routing enabled: vLLM %s, API generation %s, platform %s, %s, kernel backend %s%s",
        vllm_version(),
        api.generation.value,
        device,
        manifest.counted(findings),
        ops.kernel_backend(),
        ", CPU MoE compat fix applied" if fixed else "",
    )


def _patch_npu_runner(module: ModuleType, *, attr: str, api: CaptureAPI) -> None:
    """Runs right after the worker imports a vllm-ascend runner module: verify, then patch."""
    manifest.verify(api.generation, "npu", "vllm_ascend")
    cls = getattr(module, attr, None)
    if isinstance(cls, type):
        apply_mixin(cls, api)
    api.install_ascend()
