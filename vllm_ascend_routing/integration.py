# SPDX-License-Identifier: Apache-2.0
"""Installation, once per process: called by ``register()`` when ``VLLM_ASCEND_ROUTING=1``.

Order: detect the generation (its adapter), verify every target this generation, platform and the enabled features
rely on (``manifest.verify``: a missing one is refused with its name before anything is patched), then install each
feature of the registry (``features.FEATURES``) the adapter has what it needs for, in the registry's order.
vllm-ascend's targets are verified and patched when its worker imports its runner module (the capture feature).
"""

from __future__ import annotations

import functools

from vllm_ascend_routing import compat, manifest, ops
from vllm_ascend_routing._logging import get_logger
from vllm_ascend_routing.compat import UnsupportedVllmError, vllm_version
from vllm_ascend_routing.context import InstallContext
from vllm_ascend_routing.features import FEATURES

logger = get_logger(__name__)


def install() -> None:
    """Detect the vLLM generation, verify its targets, install the features, log one start-up line."""
    adapter = compat.adapter()
    from vllm.platforms import current_platform

    device = str(current_platform.device_type)
    if device not in adapter.runner_classes:
        raise UnsupportedVllmError(
            f"vllm-ascend-routing: platform '{device}' is not supported by this version "
            f"(supported: {', '.join(sorted(adapter.runner_classes))}); unset VLLM_ASCEND_ROUTING."
        )
    findings = manifest.verify(adapter.generation, device, "vllm")
    ctx = InstallContext(
        adapter, device, vllm_version(), verify=functools.partial(manifest.verify, adapter.generation, device)
    )
    installed = []
    for feature in FEATURES:
        if feature.serves(adapter):
            feature.install(ctx)
            installed.append(feature.name)
    logger.info(
        "vllm-ascend-routing enabled: vLLM %s, API generation %s, platform %s, %s, kernel backend %s",
        vllm_version(),
        adapter.generation.value,
        device,
        manifest.counted(findings),
        ops.kernel_backend(),
    )
    logger.debug("vllm-ascend-routing features installed: %s", ", ".join(installed))
