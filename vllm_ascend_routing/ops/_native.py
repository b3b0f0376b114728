# SPDX-License-Identifier: Apache-2.0
"""Load the optional native kernels (``vllm_ascend_routing._C``) once; report which backend serves.

Importing ``_C`` registers its kernels for the op's dispatch keys: the CPU kernel in every build, and the device
kernel of the build (CUDA or PrivateUse1); it also carries the CPU kernel's direct entry for the eager capture
(``record_rows``). Devices it does not cover, and installs without ``_C``, keep the Python kernels. The outcome
is logged once.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from types import ModuleType

import torch

from vllm_ascend_routing import envs
from vllm_ascend_routing._logging import get_logger

logger = get_logger(__name__)

# ``_C.record_rows(topk_ids, out, layer_id, limit, errors)``: the op's CPU kernel without the dispatcher; True
# when written, None (nothing written) where the tensors are not what it accepts (csrc/cpu/record_rows_python.h).
RecordRows = Callable[[torch.Tensor, torch.Tensor, int, int, torch.Tensor], "bool | None"]


@functools.cache
def _native_module() -> ModuleType | None:
    if envs.VLLM_ASCEND_ROUTING_FORCE_REFERENCE:
        logger.info("record_topk_ids: VLLM_ASCEND_ROUTING_FORCE_REFERENCE=1, using the PyTorch reference")
        return None
    try:
        module = importlib.import_module("vllm_ascend_routing._C")
    except ImportError as exc:
        logger.info("record_topk_ids: no native kernel (%s); host kernel on the CPU, PyTorch reference elsewhere", exc)
        return None
    logger.info("record_topk_ids: native %s build loaded (with the CPU kernel)", module.BACKEND)
    return module


def native_backend() -> str | None:
    """``"cpu"`` / ``"cuda"`` / ``"npu"``: the build of the native kernels loaded, else ``None`` (reason logged)."""
    module = _native_module()
    return None if module is None else str(module.BACKEND)


def native_record_rows() -> RecordRows | None:
    """The native CPU kernel's direct entry, or ``None`` without a native build (or with the reference forced).
    Its presence also means the native build registered its CPU kernel for the op's CPU key."""
    module = _native_module()
    return None if module is None else module.record_rows  # type: ignore[no-any-return]
