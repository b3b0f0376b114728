# SPDX-License-Identifier: Apache-2.0
"""Two steps of vllm-ascend's real ``NPUModelRunner`` with the plugin on, in a fresh process (run by
``test_npu_runner.py``): the plugin is registered on the NPU platform before anything imports the runner
module, the worker's import of it triggers the plugin's post-import patch, and then:

* ``load_model``: the plugin's hook binds a model of real ``AscendFusedMoE`` layers (``real_moe``); the
  real NPU loader is not run (it needs an NPU), the hook is given one that sets the model;
* ``init_routed_experts_capturer``: the real method (vLLM's, inherited), which creates vLLM's capturer and
  calls the runner's ``_bind_routed_experts_capturer`` (the plugin's hook in place of vllm-ascend's);
* each step: every statement of vllm-ascend's runner that handles routed experts (each ``if`` block whose
  condition names ``routed_experts``, found in the runner's real source by its AST and executed as it is
  written there) around real MoE forwards: the step-start clear, the slot-mapping snapshot, the
  device-to-host copy and the hand-off (``RoutedExpertsLists`` on 0.22+, ``save_captured_experts`` into
  shared memory on 0.20.x). The async-scheduling snapshot is left out (async scheduling is off).

Prints one JSON line (prefixed ``RESULT``) with what the test asserts on.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import sys
import textwrap
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

RUNNER_MODULE = "vllm_ascend.worker.model_runner_v1"
NUM_LAYERS, MAX_TOKENS, NUM_KV_BLOCKS, BLOCK_SIZE = 4, 16, 8, 4
MOE_LAYERS = {0: "unquantized", 2: "w8a8_dynamic"}
STEPS = ((5, [9, 3, 17, 4, 30]), (3, [10, 18, 31]))  # (tokens, KV slot of each token)


@dataclass
class Block:
    method: str
    node: ast.If
    text: str


def routed_experts_blocks(cls: type) -> list[Block]:
    """Outermost ``if`` blocks of ``cls``'s methods whose condition names ``routed_experts``."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    (class_def,) = tree.body
    blocks: list[Block] = []

    def visit(node: ast.AST, method: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "routed_experts" in ast.unparse(child.test):
                blocks.append(Block(method, child, ast.unparse(child)))
            else:
                visit(child, method)

    for item in class_def.body:  # type: ignore[attr-defined]
        if isinstance(item, ast.FunctionDef):
            visit(item, item.name)
    return blocks


def run_block(block: Block, module: Any, scope: dict[str, Any]) -> None:
    code = compile(ast.Module(body=[block.node], type_ignores=[]), f"<{RUNNER_MODULE}.{block.method}>", "exec")
    exec(code, vars(module), scope)  # noqa: S102 (vllm-ascend's own statements, as written in its source)


def vllm_config() -> Any:
    hf = SimpleNamespace(num_hidden_layers=NUM_LAYERS, num_experts_per_tok=2, num_experts=8)
    return SimpleNamespace(
        model_config=SimpleNamespace(enable_return_routed_experts=True, hf_text_config=hf, get_num_experts=lambda: 8),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=MAX_TOKENS),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=1,
            pipeline_parallel_size=1,
            data_parallel_size=1,
            data_parallel_rank=0,
            enable_expert_parallel=False,
            decode_context_parallel_size=1,
            prefill_context_parallel_size=1,
        ),
        kv_transfer_config=None,
        speculative_config=None,
        instance_id=f"npu-runner-test-{os.getpid()}",
        compilation_config=SimpleNamespace(
            pass_config=SimpleNamespace(enable_sequence_parallelism=False), static_forward_context={}
        ),
    )


def main() -> None:
    from tests.ascend import (
        conftest,  # noqa: F401 (vllm-ascend's source on sys.path, torch_npu stubbed)
        moe_methods,
        real_moe,
    )

    os.environ["VLLM_ASCEND_ROUTING"] = "1"
    from vllm.platforms import current_platform

    import vllm_ascend_routing
    from vllm_ascend_routing.compat import get_api
    from vllm_ascend_routing.runner_mixin import RoutingCaptureRunnerMixin

    result: dict[str, Any] = {"imported_before_register": RUNNER_MODULE in sys.modules}
    patch = pytest.MonkeyPatch()
    patch.setattr(current_platform, "device_type", "npu")
    vllm_ascend_routing.register()  # what vLLM's plugin loader runs in every process
    patch.setattr(current_platform, "device_type", "cpu")  # vLLM sizes its capturer on this (no NPU here)
    import importlib

    # vllm-ascend's worker module imports vllm_ascend.ops (its op registrations) before the runner; the
    # worker module itself needs ACL. Then the worker's import of the runner: the plugin's patch follows.
    importlib.import_module("vllm_ascend.ops")
    result["imported_before_register"] |= RUNNER_MODULE in sys.modules
    module = importlib.import_module(RUNNER_MODULE)
    runner_cls = module.NPUModelRunner
    hooks = ("load_model", "execute_model", "init_routed_experts_capturer", "_bind_routed_experts_capturer")
    result["hooked"] = sorted(
        name for name in hooks if getattr(getattr(runner_cls, name, None), "_vllm_ascend_routing_hook", False)
    )

    config = vllm_config()
    runner = object.__new__(runner_cls)
    for name, value in {
        "vllm_config": config,
        "model_config": config.model_config,
        "scheduler_config": config.scheduler_config,
        "compilation_config": config.compilation_config,
        "device": torch.device("cpu"),
        "pin_memory": False,
        "use_async_scheduling": False,
        "speculative_config": None,
        "kv_cache_config": SimpleNamespace(
            num_blocks=NUM_KV_BLOCKS,
            kv_cache_groups=[SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=BLOCK_SIZE))],
        ),
    }.items():
        object.__setattr__(runner, name, value)
    patch.setattr(importlib.import_module("vllm.distributed"), "get_tensor_model_parallel_rank", lambda: 0)

    fused_moe = importlib.import_module(real_moe.FUSED_MOE)
    w8a8 = importlib.import_module("vllm_ascend.quantization.methods.w8a8_dynamic")
    methods = {0: fused_moe.AscendUnquantizedFusedMoEMethod, 2: w8a8.AscendW8A8DynamicFusedMoEMethod}
    layers = {
        layer_id: real_moe.build(patch, moe_methods.method_instance(cls), layer_id=layer_id)
        for layer_id, cls in methods.items()
    }
    model = torch.nn.Module()
    model.moe = torch.nn.ModuleDict({str(i): moe.layer for i, moe in layers.items()})
    for moe in layers.values():
        moe.layer.router = SimpleNamespace()  # vLLM's FusedMoE owns one (vllm-ascend routes without it)
        config.compilation_config.static_forward_context[moe.layer.layer_name] = moe.layer

    def npu_loader(self: Any, *args: Any, **kwargs: Any) -> None:
        self.model = model

    RoutingCaptureRunnerMixin.load_model(runner, get_api(), npu_loader)  # the hook, around a loader that needs no NPU
    runner.init_routed_experts_capturer()  # the real method, through the plugin's hook
    capturer = getattr(runner, "routed_experts_capturer", None)  # 0.22+: per runner
    if capturer is None:  # 0.20.x: the process singleton, by the name vllm-ascend's runner uses
        capturer = module.RoutedExpertsCapturer.get_instance()
    result["capturer"] = type(capturer).__name__
    result["vllm_ascend_binder_ran"] = any(
        "_ascend_routed_experts_capturer" in vars(moe.layer) for moe in layers.values()
    )
    own = getattr(fused_moe, "RoutedExpertsCapturer", None)  # 0.20.x: vllm-ascend's own capture asks this
    result["vllm_ascend_own_capturer"] = None if own is None else repr(own.get_instance())

    blocks = [
        b
        for b in routed_experts_blocks(runner_cls)
        if "init_routed_experts_capturer()" not in b.text and "RoutedExpertsTensors(" not in b.text
    ]
    start = [b for b in blocks if "clear_buffer" in b.text]
    slots_snapshot = [b for b in blocks if "slot_mapping_device[:n]" in b.text]
    # The device-to-host copy (or the 0.20.x shared-memory save) before the hand-off that reads it.
    after = sorted(
        (b for b in blocks if b not in start and b not in slots_snapshot),
        key=lambda b: "RoutedExpertsLists(" in b.text and ".copy_(" not in b.text,
    )
    result["blocks"] = {
        "start": [b.method for b in start],
        "slots": [b.method for b in slots_snapshot],
        "after": [b.method for b in after],
    }

    steps = [run_step(runner, module, layers, start + slots_snapshot, after, config, *step) for step in STEPS]
    result["steps"] = steps
    print("RESULT " + json.dumps(result), flush=True)


def run_step(
    runner: Any,
    module: Any,
    layers: dict[int, Any],
    before: list[Block],
    after: list[Block],
    config: Any,
    num_tokens: int,
    slots: list[int],
) -> dict[str, Any]:
    """One step: the runner's statements before the forward, real MoE forwards, the hand-off."""
    from tests.ascend import real_moe
    from vllm_ascend_routing.compat import get_api
    from vllm_ascend_routing.runner_mixin import RoutingCaptureRunnerMixin

    slot_mapping = torch.tensor(slots + [-1] * (MAX_TOKENS - num_tokens))  # padded, like vllm-ascend's
    runner.cpu_slot_mapping = slot_mapping.numpy()
    scheduler_output = SimpleNamespace(total_num_scheduled_tokens=num_tokens)
    scope = {
        "self": runner,
        "scheduler_output": scheduler_output,
        "slot_mapping": slot_mapping,
        "kv_cache_gid": 0,
        "model_runner_output": SimpleNamespace(routed_experts=None),
    }
    expected = np.zeros((num_tokens, NUM_LAYERS, 2), dtype=np.int64)
    generator = torch.Generator().manual_seed(num_tokens)

    def forward(self: Any, output: Any, *args: Any, **kwargs: Any) -> None:
        for block in before:
            run_block(block, module, scope)
        for layer_id, moe in layers.items():
            hidden = torch.randn(num_tokens, real_moe.HIDDEN, generator=generator)
            logits = torch.randn(num_tokens, real_moe.NUM_EXPERTS, generator=generator)
            moe.forward(hidden, logits)
            expected[:, layer_id] = real_moe.reference_top_k(logits, real_moe.TOP_K).numpy()

    def hand_off(self: Any, *args: Any, **kwargs: Any) -> None:
        for block in after:
            run_block(block, module, scope)

    RoutingCaptureRunnerMixin.execute_model(runner, get_api(), forward, scheduler_output)
    RoutingCaptureRunnerMixin.sample_tokens(runner, get_api(), hand_off)
    shipped = scope.get("routed_experts_lists") or scope["model_runner_output"].routed_experts
    step: dict[str, Any] = {"expected": expected.tolist(), "slots": slots}
    if shipped is not None:  # 0.22+: the rows vLLM's scheduler receives, by slot
        step["shipped_rows"] = np.asarray(shipped.routing_data).astype(np.int64).tolist()
        step["shipped_dtype"] = str(np.asarray(shipped.routing_data).dtype)
        step["shipped_slots"] = np.asarray(shipped.slot_mapping).astype(np.int64).tolist()
    else:  # 0.20.x: the rows the scheduler's reader finds in shared memory at those slots
        from vllm_ascend_routing.compat.shm import ShmRoutedExpertsReader

        reader = ShmRoutedExpertsReader.get_instance() or ShmRoutedExpertsReader.create()
        reader.attach_buffer(NUM_KV_BLOCKS * BLOCK_SIZE, config)
        step["stored_rows"] = reader.get_routed_experts(np.array(slots)).astype(np.int64).tolist()
    return step


if __name__ == "__main__":
    main()
