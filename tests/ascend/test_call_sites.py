# SPDX-License-Identifier: Apache-2.0
"""Every place vllm-ascend routes is one the plugin records, checked on the call sites themselves (every
vllm-ascend function whose bytecode reads the routing entry point), not on what the plugin chose to patch.

* select_experts designs: once every MoE method is bound, every function that reads the global
  ``select_experts`` resolves it to the plugin's recording wrapper.
* router design: routing is reached only through ``AscendRoutedExperts`` (its ``forward_impl`` calling its
  ``_select_experts`` calling the router's): a new routing call site in a later release fails here.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.ascend import moe_methods, real_moe
from tests.ascend.conftest import ASCEND_SRC
from vllm_ascend_routing.backends import ascend
from vllm_ascend_routing.backends._recorded import RoutingNotRecordedError
from vllm_ascend_routing.capture import LayerCapture, new_capture_buffer, new_error_counter
from vllm_ascend_routing.patching import is_wrapped
from vllm_ascend_routing.patching import original_of as inner_of

pytestmark = [pytest.mark.vllm, pytest.mark.ascend]

SELECTOR = "select_experts"
DESIGN = real_moe.design() if ASCEND_SRC else ""


def bind_every_method(monkeypatch: pytest.MonkeyPatch, gate: bool = False) -> list[real_moe.RealMoE]:
    layers = []
    for cls in moe_methods.method_classes():
        moe = real_moe.build(
            monkeypatch, moe_methods.method_instance(cls), layer_cls=moe_methods.layer_class(cls), gate=gate
        )
        buffer = new_capture_buffer(4, 4, real_moe.TOP_K, real_moe.NUM_EXPERTS, "cpu")
        ascend.bind(
            moe.layer,
            LayerCapture(buffer, moe.layer_id, real_moe.NUM_EXPERTS, new_error_counter("cpu")),
            moe.layer.layer_name,
        )
        layers.append(moe)
    return layers


def functions_reading(name: str) -> Iterator[tuple[str, types.FunctionType]]:
    """Every function defined in an imported vllm-ascend module whose bytecode reads ``name`` (a global or
    an attribute: methods, nested functions and module functions)."""
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith(f"{moe_methods.PACKAGE}.") or module is None:
            continue
        for function in _functions(module):
            if name in ascend.global_names(function.__code__):
                yield f"{module_name}:{function.__qualname__}", function


def selector_call_sites() -> Iterator[tuple[str, types.FunctionType]]:
    """Functions reading the global ``select_experts``, except in the modules that define one."""
    for site, function in functions_reading(SELECTOR):
        selector = function.__globals__.get(SELECTOR)
        if selector is None or getattr(inner_of(selector), "__module__", None) == function.__module__:
            continue  # an attribute of that name only, or the module defining select_experts
        yield site, function


def _functions(module: types.ModuleType) -> Iterator[types.FunctionType]:
    for value in vars(module).values():
        members = vars(value).values() if isinstance(value, type) else [value]
        for member in members:
            function = ascend.function_of(member)
            if function is not None and function.__globals__ is vars(module):
                yield function


@pytest.fixture
def every_module_imported() -> None:
    if not ASCEND_SRC:
        pytest.skip("needs vllm-ascend's source")
    assert moe_methods.unimportable_method_modules() == {}


@pytest.mark.usefixtures("every_module_imported")
def test_every_routing_call_site_is_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    if DESIGN == "router":
        sites = {site for site, _ in functions_reading("_select_experts")}
        sites |= {site for site, _ in functions_reading(SELECTOR)}
        # vllm-ascend's routers (which implement the template's _compute_routing) and the router factory
        # are where routing is computed, not called from.
        callers = {site for site in sites if not site.startswith(real_moe.ROUTERS)}
        assert callers == {
            f"{real_moe.ROUTED_EXPERTS}:AscendRoutedExperts._select_experts",
            f"{real_moe.ROUTED_EXPERTS}:AscendRoutedExperts.forward_impl",
        }
        return
    bind_every_method(monkeypatch)
    sites = dict(selector_call_sites())
    assert sites, "no select_experts call site found: the source layout changed, update this test"
    unwrapped = sorted(site for site, fn in sites.items() if not is_wrapped(fn.__globals__[SELECTOR]))
    assert unwrapped == []
    if DESIGN == "layer":
        # The gate path: the select_experts that AscendFusedMoE.forward_impl really calls (0.23.x defines it
        # in fused_moe_0_23_0 and renames the class's __module__, which is what hid it before).
        fused_moe = importlib.import_module(real_moe.FUSED_MOE)
        assert is_wrapped(fused_moe.AscendFusedMoE.forward_impl.__globals__[SELECTOR])


@pytest.mark.usefixtures("every_module_imported")
def test_an_unwrapped_gate_call_site_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    """The broken wiring on purpose (the gate path's select_experts left unwrapped, as patching by
    ``cls.__module__`` did on 0.23.x): a gate-on quantized layer raises instead of returning zeros. The
    gate path (the layer itself calling select_experts) exists in the layer design only: the other designs'
    MoE forwards are checked to have none."""
    if DESIGN != "layer":
        fused_moe = importlib.import_module(real_moe.FUSED_MOE)
        own = [ascend.function_of(member) for member in vars(fused_moe.AscendMoERunner).values()]
        assert not [fn for fn in own if fn is not None and SELECTOR in ascend.global_names(fn.__code__)]
        return
    w8a8 = importlib.import_module("vllm_ascend.quantization.methods.w8a8_dynamic")
    moe = real_moe.build(monkeypatch, moe_methods.method_instance(w8a8.AscendW8A8DynamicFusedMoEMethod), gate=True)
    buffer = new_capture_buffer(6, 4, real_moe.TOP_K, real_moe.NUM_EXPERTS, "cpu")
    ascend.bind(moe.layer, LayerCapture(buffer, moe.layer_id, real_moe.NUM_EXPERTS, new_error_counter("cpu")), "l")
    gate_namespace: dict[str, Any] = type(moe.layer).forward_impl.__globals__
    monkeypatch.setitem(gate_namespace, SELECTOR, inner_of(gate_namespace[SELECTOR]))
    generator = torch.Generator().manual_seed(3)
    with pytest.raises(RoutingNotRecordedError, match="without calling select_experts"):
        moe.forward(
            torch.randn(6, real_moe.HIDDEN, generator=generator),
            torch.randn(6, real_moe.NUM_EXPERTS, generator=generator),
        )
    assert (buffer == 0).all()
