# SPDX-License-Identifier: Apache-2.0
"""Backend ``router``: vLLM's ``BaseRouter`` calls ``capture_fn(topk_ids)`` with logical ids.

The router invokes the hook after computing routing and before the EPLB logical-to-physical mapping,
so the recorded ids are logical.
"""

from __future__ import annotations

import torch

from vllm_ascend_routing.backends._layer import is_vllm_ascend_layer, quant_method
from vllm_ascend_routing.capture import LayerCapture


def handles(module: torch.nn.Module) -> bool:
    if is_vllm_ascend_layer(module):
        return False  # a vllm-ascend MoE no Ascend backend recognised: refused (bind_model), never zeros
    qm = quant_method(module)
    if qm is not None and getattr(qm, "is_monolithic", False):
        return False  # monolithic kernels route inside the kernel and never call the hook
    # Every vLLM router (FusedMoERouter and its BaseRouter implementations) exposes set_capture_fn.
    return callable(getattr(getattr(module, "router", None), "set_capture_fn", None))


def bind(module: torch.nn.Module, capture: LayerCapture, name: str) -> None:
    getattr(module, "router").set_capture_fn(capture)  # noqa: B009 (nn.Module attribute typing)
