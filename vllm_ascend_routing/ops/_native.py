# SPDX-License-Identifier: Apache-2.0
"""Load the optional native kernels (``vllm_ascend_routing._C``) once; report which backend serves.

Importing ``_C`` registers its kernel for the op's device dispatch key (CUDA or PrivateUse1); devices it
does not cover, and installs without ``_C``, use the PyTorch reference. The outcome is logged once.
"""

from __future__ import annotations

import functools
import importlib

from vllm_ascend_routing import envs
from vllm_ascend_routing._logging import get_logger

logger = get_logger(__name__)


@functools.cache
def native_backend() -> str | None:
    """``"cuda"`` / ``"npu"`` when a native kernel is loaded, else ``None`` (with the reason logged)."""
    if envs.VLLM_ASCEND_ROUTING_FORCE_REFERENCE:
        logger.info("record_topk_ids: VLLM_ASCEND_ROUTING_FORCE_REFERENCE=1, using the PyTorch reference")
        return None
    try:
        module = importlib.import_module("vllm_ascend_routing._C")
    except ImportError as exc:
        logger.info("record_topk_ids: no native kernel (%s); host kernel on the CPU, PyTorch reference elsewhere", exc)
        return None
    backend = str(module.BACKEND)
    logger.info("record_topk_ids: native %s kernel loaded", backend)
    return backend
