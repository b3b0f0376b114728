# SPDX-License-Identifier: Apache-2.0
"""Minimal fixes so vLLM's CPU MoE runs at all where it would crash (docs/evidence.md, "CPU compat fix").

vLLM's pure-PyTorch CPU MoE (releases 0.20-0.27, the path its ``CPUFusedMOE`` takes for float32 on AMX CPUs and for
sizes its grouped GEMM cannot take) crashes twice:

* it builds a ``SiluAndMul`` CustomOp on every forward (``cpu_fused_moe._CPU_MOE_ACT_FN``); outside vLLM's config
  context (always, at forward time) that raises ``AssertionError: Current vLLM config is not set``. The table entry
  is replaced (``patching.wrap``) by a call of the op's own static ``SiluAndMul.forward_native`` (identical
  arithmetic, no object built). Only this entry changes;
* it hands its op ``id(layer)``, which the compiled graph bakes in as a constant, and vLLM caches that graph: a
  restart that loads it looks up an address of the previous process (``KeyError`` in ``cpu_fused_moe_torch``). Where
  a layer takes this path (``CPUFusedMOE.init_moe_torch`` ran), the process compiles afresh:
  ``VLLM_DISABLE_COMPILE_CACHE=1`` where the environment has no value (vLLM reads it when it compiles, after the
  model loaded). Nothing else changes; other paths keep the cache.

Remove when: the lowest supported release no longer has ``_CPU_MOE_ACT_FN`` (0.28+ keys its layers by name).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any

from vllm_ascend_routing import patching
from vllm_ascend_routing._logging import get_logger
from vllm_ascend_routing.context import InstallContext
from vllm_ascend_routing.patching import RELY, Patch, resolve

ACTIVATION_TABLE = Patch(
    "vllm.model_executor.layers.fused_moe.cpu_fused_moe:_CPU_MOE_ACT_FN",
    "CPU compat fix: SiluAndMul built at forward time outside the config context (its SILU entry replaced)",
    "the lowest supported vLLM is 0.28.0 or newer",
    vllm="0.20.0-0.27.1",
    platform="cpu",
    required=False,
    releases="vLLM 0.20.0-0.27.1",
    action=RELY,
)
TORCH_PATH = Patch(
    "vllm.model_executor.layers.fused_moe.cpu_fused_moe:CPUFusedMOE.init_moe_torch",
    "CPU compat fix: the pure-PyTorch MoE bakes id(layer) into the compiled graph vLLM caches, so a restart loading "
    "it fails (KeyError); where a layer takes that path the process compiles afresh (VLLM_DISABLE_COMPILE_CACHE=1)",
    "the lowest supported vLLM is 0.28.0 or newer",
    vllm="0.20.0-0.27.1",
    params=("self", "layer"),
    platform="cpu",
    required=False,
    releases="vLLM 0.20.0-0.27.1",
)
PATCHES = (ACTIVATION_TABLE, TORCH_PATH)
NEEDS: tuple[str, ...] = ()  # a fix of vLLM's CPU MoE, whatever the generation
COMPILE_CACHE = "VLLM_DISABLE_COMPILE_CACHE"
_MODULE = ACTIVATION_TABLE.target.partition(":")[0]
logger = get_logger(__name__)


def install(ctx: InstallContext) -> None:
    """On the CPU platform: both fixes where this vLLM needs them (logged when applied)."""
    if ctx.platform == "cpu" and apply():
        logger.info("CPU MoE compat fix applied (docs/evidence.md, 'CPU compat fix')")


def apply() -> bool:
    """Both fixes where this vLLM has the faulty pure-PyTorch MoE; returns whether anything changed."""
    changed = _fix_activation_table()
    return _fix_compile_cache() or changed


def _fix_compile_cache() -> bool:
    try:
        if patching.is_wrapped(resolve(TORCH_PATH.target)):
            return False
    except LookupError:
        return False
    return patching.replace(TORCH_PATH, _compile_afresh)


def _compile_afresh(original: Callable[..., Any]) -> Callable[..., Any]:
    """``CPUFusedMOE.init_moe_torch``: vLLM's, then the compile cache off for this process where nobody chose."""

    def init_moe_torch(self: Any, layer: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, layer, *args, **kwargs)
        if COMPILE_CACHE not in os.environ:
            os.environ[COMPILE_CACHE] = "1"
            logger.info(
                "CPU compat fix: vLLM's pure-PyTorch MoE bakes its layers' addresses into compiled graphs, so this "
                "process compiles afresh (%s=1): a cached graph of an earlier process would fail (KeyError)",
                COMPILE_CACHE,
            )
        return result

    return init_moe_torch


def _fix_activation_table() -> bool:
    try:
        table = resolve(ACTIVATION_TABLE.target)
        moe_activation = resolve(f"{_MODULE}:MoEActivation")
        activation = resolve("vllm.model_executor.layers.activation:SiluAndMul")
    except LookupError:
        return False
    silu = getattr(moe_activation, "SILU", None)
    if not isinstance(inspect.getattr_static(activation, "forward_native", None), staticmethod):
        return False  # needs an instance there: not the arithmetic-only function this fix relies on
    native = activation.forward_native
    if silu not in table or patching.is_wrapped(table[silu]):
        return False
    patching.wrap(table, silu, lambda _: _silu_and_mul(native))
    return True


def _silu_and_mul(native: Callable[..., Any]) -> Callable[..., Any]:
    """The table entry: the op's own arithmetic, called without building the op (a function of this package,
    so it can carry ``patching``'s marker; ``native`` is vLLM's and stays unmarked)."""

    def silu_and_mul(*args: Any, **kwargs: Any) -> Any:
        return native(*args, **kwargs)

    return silu_and_mul
