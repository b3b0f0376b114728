# SPDX-License-Identifier: Apache-2.0
"""Every MoE quant method of the vllm-ascend release under test, found by walking its source, not listed.

A method is a subclass (defined in ``vllm_ascend``) of vLLM's ``FusedMoEMethodBase`` or of vllm-ascend's
``AscendMoEScheme``. Every module of the package is imported (a second pass resolves import-order
cycles); a module that still fails to import is allowed only if its source names no MoE method base, so a
method cannot hide in a module this suite never loaded. A new method in a new release is then tested (or
refused by the plugin) without editing the suite.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import pkgutil
import sys
from functools import cache
from pathlib import Path
from typing import Any

from tests.ascend import real_moe
from tests.ascend.real_moe import probe_instance

PACKAGE = "vllm_ascend"
BASE_NAMES = ("FusedMoEMethodBase", "UnquantizedFusedMoEMethod", "AscendMoEScheme")
SCHEME_BASE = "vllm_ascend.quantization.methods.base.AscendMoEScheme"
ADAPTER = "vllm_ascend.quantization.method_adapters.AscendFusedMoEMethod"
# The 310P class each design builds its layer from (real_moe.build's layer_cls): the layer, the runner that is
# the layer, or the routed experts (router design, with the 310P router).
LAYER_310P = {
    "layer": "vllm_ascend._310p.fused_moe.fused_moe.AscendFusedMoE310",
    "runner": "vllm_ascend._310p.fused_moe.fused_moe.AscendMoERunner310",
    "router": "vllm_ascend._310p.fused_moe.fused_moe.AscendRoutedExperts310",
}


def _object(path: str) -> Any:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


@cache
def import_failures() -> dict[str, str]:
    """Modules of the package that cannot be imported here (missing NPU-only packages), with why."""
    package = importlib.import_module(PACKAGE)
    names = [info.name for info in pkgutil.walk_packages(package.__path__, f"{PACKAGE}.")]
    failures: dict[str, str] = {}
    for _ in range(2):  # a module that failed inside an import cycle imports once the cycle is loaded
        failures = {}
        for name in names:
            if name in sys.modules:
                continue
            try:
                importlib.import_module(name)
            except Exception as exc:  # noqa: BLE001 (any import error is recorded and judged below)
                sys.modules.pop(name, None)
                failures[name] = f"{type(exc).__name__}: {exc}"
    return failures


def unimportable_method_modules() -> dict[str, str]:
    """Failed modules whose source names an MoE method base: these could hide an untested method."""
    hidden: dict[str, str] = {}
    for name, why in import_failures().items():
        spec = importlib.util.find_spec(name)
        origin = Path(spec.origin) if spec and spec.origin else None
        if origin and origin.suffix == ".py" and any(base in origin.read_text() for base in BASE_NAMES):
            hidden[name] = why
    return hidden


@cache
def method_classes() -> tuple[type, ...]:
    """Concrete MoE method classes defined in ``vllm_ascend`` (the adapter that wraps schemes excluded:
    it is tested around every scheme)."""
    import_failures()
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase

    bases: list[type] = [FusedMoEMethodBase, _object(SCHEME_BASE)]
    found: set[type] = set()
    for base in bases:
        stack = list(base.__subclasses__())
        while stack:
            cls = stack.pop()
            stack.extend(cls.__subclasses__())
            if cls.__module__.split(".")[0] == PACKAGE and not inspect.isabstract(cls):
                found.add(cls)
    adapter = _object(ADAPTER)
    return tuple(sorted(found - {adapter}, key=lambda cls: f"{cls.__module__}.{cls.__qualname__}"))


def is_scheme(cls: type) -> bool:
    return issubclass(cls, _object(SCHEME_BASE))


def method_instance(cls: type) -> Any:
    """The quant method a layer holds in production: a scheme wrapped in vllm-ascend's adapter
    (``AscendFusedMoEMethod``), an unquantized method as it is."""
    method = probe_instance(cls)
    if isinstance(getattr(cls, "bf16_method", None), property):  # FP8-block (0.30) serves bf16 experts through
        unquantized = importlib.import_module(real_moe.ROUTED_EXPERTS).AscendUnquantizedFusedMoEMethod
        object.__setattr__(method, "_bf16_method", probe_instance(unquantized))  # the unquantized method
        object.__setattr__(method, "mxfp8_method", None)  # (MXFP8 only on the 950)
    if not is_scheme(cls):
        return method
    adapter = probe_instance(_object(ADAPTER))
    object.__setattr__(adapter, "quant_method", method)
    object.__setattr__(adapter, "tid2eid", None)
    return adapter


def layer_class(cls: type) -> type | None:
    """The layer class that runs ``cls``: the design's 310P one for 310P methods, else the default."""
    return _object(LAYER_310P[real_moe.design()]) if is_310p(cls) else None


def is_310p(cls: type) -> bool:
    return f"{PACKAGE}._310p." in cls.__module__


def method_id(cls: type) -> str:
    return f"{cls.__module__.removeprefix(PACKAGE + '.')}.{cls.__name__}"
