# SPDX-License-Identifier: Apache-2.0
"""The plugin's hooks on vllm-ascend's real ``NPUModelRunner``, driven through one fake step: load the
model (bind), create vLLM's capturer (attach), run a forward (record) — and vllm-ascend's own binder and
capture stay out of the way."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.ascend.conftest import RoutingDone, no_forward_context
from tests.ascend.test_select_experts_capture import FakeAscendMoE, probe_instance
from vllm_ascend_routing import integration
from vllm_ascend_routing.compat import get_api
from vllm_ascend_routing.compat.base import Generation
from vllm_ascend_routing.compat.shm import ShmRoutedExpertsCapturer
from vllm_ascend_routing.runner_mixin import apply_mixin

pytestmark = [pytest.mark.vllm, pytest.mark.ascend]

RUNNER_MODULE = "vllm_ascend.worker.model_runner_v1"
NUM_LAYERS, TOP_K, NUM_EXPERTS, MAX_TOKENS, HIDDEN = 4, 2, 8, 16, 16


class TinyAscendModel(torch.nn.Module):
    """Layers 0 and 2 are MoE (vllm-ascend's real unquantized and W8A8 methods); 1 and 3 are dense."""

    def __init__(self) -> None:
        super().__init__()
        fused_moe = importlib.import_module("vllm_ascend.ops.fused_moe.fused_moe")
        w8a8 = importlib.import_module("vllm_ascend.quantization.methods.w8a8_dynamic")
        methods = {0: fused_moe.AscendUnquantizedFusedMoEMethod, 2: w8a8.AscendW8A8DynamicFusedMoEMethod}
        self.moe = torch.nn.ModuleDict()
        for layer_id, cls in methods.items():
            layer = FakeAscendMoE(probe_instance(cls))
            layer.layer_id, layer.layer_name = layer_id, f"model.layers.{layer_id}.mlp.experts"
            layer.router = object()  # vLLM's FusedMoE owns a router (unused by vllm-ascend's routing)
            self.moe[str(layer_id)] = layer


def vllm_config() -> Any:
    hf = SimpleNamespace(num_hidden_layers=NUM_LAYERS, num_experts_per_tok=TOP_K, num_experts=NUM_EXPERTS)
    return SimpleNamespace(
        model_config=SimpleNamespace(
            enable_return_routed_experts=True, hf_text_config=hf, get_num_experts=lambda: NUM_EXPERTS
        ),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=MAX_TOKENS),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, enable_expert_parallel=False),
        kv_transfer_config=None,
        compilation_config=SimpleNamespace(pass_config=SimpleNamespace(enable_sequence_parallelism=False)),
    )


@pytest.fixture
def patched_runner_module() -> Iterator[Any]:
    """What happens when the worker imports vllm-ascend's runner with the plugin on."""
    module = importlib.import_module(RUNNER_MODULE)
    api = get_api()
    api.install()
    integration._patch_npu_runner(module, attr="NPUModelRunner", api=api)
    yield module
    ShmRoutedExpertsCapturer._instance = None


def make_step_runner(module: Any, calls: list[str]) -> type:
    """The real ``NPUModelRunner`` with only what needs an NPU replaced (loading, capturer sizing, forward)."""

    class StepRunner(module.NPUModelRunner):  # type: ignore[name-defined,misc]
        def __init__(self) -> None:  # the real one allocates NPU buffers
            self.vllm_config = vllm_config()
            self.device = torch.device("cpu")

        def load_model(self, *args: Any, **kwargs: Any) -> None:
            calls.append("load_model")
            self.model = TinyAscendModel()

        def init_routed_experts_capturer(self) -> None:
            calls.append("init_routed_experts_capturer")
            if get_api().generation is Generation.SHM:  # 0.20.x: the singleton, by the runner's own name
                capturer = module.RoutedExpertsCapturer.create()
            else:  # 0.22+: vLLM's per-runner capturer with its int32 device buffer
                capturer = SimpleNamespace(device_buffer=torch.zeros(MAX_TOKENS, NUM_LAYERS, TOP_K, dtype=torch.int32))
            self.routed_experts_capturer = capturer
            self._bind_routed_experts_capturer(capturer)  # vLLM's call: the plugin's hook answers it

        def execute_model(self, scheduler_output: Any, intermediate_tensors: Any = None) -> None:
            calls.append("execute_model")
            generator = torch.Generator().manual_seed(3)
            n = scheduler_output.total_num_scheduled_tokens
            for layer in self.model.moe.values():
                hidden = torch.randn(n, HIDDEN, generator=generator)
                logits = torch.randn(n, NUM_EXPERTS, generator=generator)
                with contextlib.suppress(RoutingDone):  # raised right after routing: the rest needs an NPU
                    layer.forward_impl(hidden, logits)

    apply_mixin(StepRunner)
    return StepRunner


def test_hooks_run_in_order_and_record_exact_ids(patched_runner_module: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    routed: list[torch.Tensor] = []
    runner = make_step_runner(patched_runner_module, calls)()
    runner.load_model()
    for layer in runner.model.moe.values():  # bound at load: observe the bound selectors from outside
        _spy(monkeypatch, type(layer.quant_method).__mro__[1].__module__, routed)
    runner.init_routed_experts_capturer()
    runner.execute_model(SimpleNamespace(total_num_scheduled_tokens=5))
    assert calls == ["load_model", "init_routed_experts_capturer", "execute_model"]

    buffer = runner.routed_experts_capturer.device_buffer
    assert buffer.dtype == torch.int16 and tuple(buffer.shape) == (MAX_TOKENS, NUM_LAYERS, TOP_K)
    layer0_ids, layer2_ids = routed
    assert torch.equal(buffer[:5, 0].to(torch.int32), layer0_ids)
    assert torch.equal(buffer[:5, 2].to(torch.int32), layer2_ids)
    assert (buffer[:, [1, 3]] == 0).all() and (buffer[5:] == 0).all()
    for layer in runner.model.moe.values():  # vllm-ascend's own binder (attribute capture) never ran
        assert not hasattr(layer, "_ascend_routed_experts_capturer")


def _spy(monkeypatch: pytest.MonkeyPatch, module_name: str, routed: list[torch.Tensor]) -> None:
    module = importlib.import_module(module_name)
    no_forward_context(monkeypatch, module)
    inner = module.select_experts

    def select_experts(*args: Any, **kwargs: Any) -> Any:
        topk_weights, topk_ids = inner(*args, **kwargs)
        routed.append(topk_ids.clone())
        raise RoutingDone

    monkeypatch.setattr(module, "select_experts", select_experts)


def test_npu_runner_is_patched_and_vllm_ascend_binder_replaced(patched_runner_module: Any) -> None:
    runner_cls = patched_runner_module.NPUModelRunner
    for name in ("load_model", "execute_model", "_bind_routed_experts_capturer"):
        assert getattr(getattr(runner_cls, name), "_vllm_ascend_routing_hook", False), name


def test_vllm_ascend_own_capture_is_off(patched_runner_module: Any) -> None:
    """Only the plugin records: vllm-ascend's own (unquantized-only) capture must not write as well."""
    if get_api().generation is Generation.SHM:  # 0.20.x: its MoE method asks the singleton by name
        fused_moe = importlib.import_module("vllm_ascend.ops.fused_moe.fused_moe")
        assert patched_runner_module.RoutedExpertsCapturer is ShmRoutedExpertsCapturer
        assert fused_moe.RoutedExpertsCapturer.get_instance() is None
    else:  # 0.22+: its binder sets a per-layer attribute; the plugin's hook replaces that binder
        bind = patched_runner_module.NPUModelRunner._bind_routed_experts_capturer
        assert getattr(bind, "_vllm_ascend_routing_hook", False)


def test_install_on_the_npu_platform_patches_vllm_ascend_runners(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.platforms import current_platform

    module = importlib.import_module(RUNNER_MODULE)
    patched: list[tuple[Any, str]] = []
    monkeypatch.setattr(integration, "_patch_npu_runner", lambda mod, *, attr, api: patched.append((mod, attr)))
    monkeypatch.setattr(current_platform, "device_type", "npu")
    integration.install()  # the runner module is imported already here, so its patch runs at once
    assert (module, "NPUModelRunner") in patched
    ShmRoutedExpertsCapturer._instance = None
