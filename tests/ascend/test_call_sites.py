# SPDX-License-Identifier: Apache-2.0
"""Where ``select_experts`` is called, the name resolves to the plugin's recording wrapper once every MoE
method is bound: checked on the call sites themselves (every vllm-ascend function whose bytecode reads the
global ``select_experts``), not on the modules the plugin chose to patch."""

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
from vllm_ascend_routing.capture import LayerCapture, new_capture_buffer, new_error_counter

pytestmark = [pytest.mark.vllm, pytest.mark.ascend]

SELECTOR = "select_experts"
WRAPPED = "_vllm_ascend_routing_inner"


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


def call_sites() -> Iterator[tuple[str, types.FunctionType]]:
    """Every function defined in an imported vllm-ascend module that reads the global ``select_experts``
    (methods, nested functions and module functions), except where ``select_experts`` is defined."""
    for name, module in list(sys.modules.items()):
        if not name.startswith(f"{moe_methods.PACKAGE}.") or module is None:
            continue
        selector = vars(module).get(SELECTOR)
        if selector is None or getattr(selector, "__module__", None) == name:
            continue  # no such global, or the module that defines it
        for function in _functions(module):
            if SELECTOR in ascend.global_names(function.__code__):
                yield f"{name}:{function.__qualname__}", function


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
def test_every_call_site_reads_the_wrapper(monkeypatch: pytest.MonkeyPatch) -> None:
    bind_every_method(monkeypatch)
    sites = dict(call_sites())
    assert sites, "no select_experts call site found: the source layout changed, update this test"
    unwrapped = sorted(site for site, fn in sites.items() if not hasattr(fn.__globals__[SELECTOR], WRAPPED))
    assert unwrapped == []
    # The gate path: the select_experts that AscendFusedMoE.forward_impl really calls (0.23.x defines it in
    # fused_moe_0_23_0 and renames the class's __module__, which is what hid it before).
    fused_moe = importlib.import_module(real_moe.FUSED_MOE)
    assert hasattr(fused_moe.AscendFusedMoE.forward_impl.__globals__[SELECTOR], WRAPPED)


@pytest.mark.usefixtures("every_module_imported")
def test_an_unwrapped_gate_call_site_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    """The broken wiring on purpose (the gate path's select_experts left unwrapped, as patching by
    ``cls.__module__`` did on 0.23.x): a gate-on quantized layer raises instead of returning zeros."""
    w8a8 = importlib.import_module("vllm_ascend.quantization.methods.w8a8_dynamic")
    moe = real_moe.build(monkeypatch, moe_methods.method_instance(w8a8.AscendW8A8DynamicFusedMoEMethod), gate=True)
    buffer = new_capture_buffer(6, 4, real_moe.TOP_K, real_moe.NUM_EXPERTS, "cpu")
    ascend.bind(moe.layer, LayerCapture(buffer, moe.layer_id, real_moe.NUM_EXPERTS, new_error_counter("cpu")), "l")
    gate_namespace: dict[str, Any] = type(moe.layer).forward_impl.__globals__
    monkeypatch.setitem(gate_namespace, SELECTOR, getattr(gate_namespace[SELECTOR], WRAPPED))
    generator = torch.Generator().manual_seed(3)
    with pytest.raises(ascend.RoutingNotRecordedError, match="without calling select_experts"):
        moe.forward(
            torch.randn(6, real_moe.HIDDEN, generator=generator),
            torch.randn(6, real_moe.NUM_EXPERTS, generator=generator),
        )
    assert (buffer == 0).all()
