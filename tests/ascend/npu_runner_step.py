# SPDX-License-Identifier: Apache-2.0
"""Steps of vllm-ascend's real NPU model runner with the plugin on, in a fresh process (run by
``test_npu_runner.py``):

    python -m tests.ascend.npu_runner_step v1|v2 [--async] [--hybrid]

The plugin is registered on the NPU platform before anything imports the runner module; the worker's import
of it (the V1 ``NPUModelRunner`` or, ``v2``, the Model Runner V2 one) triggers the plugin's post-import patch.
Then, through the methods installed on the runner class itself:

* ``load_model`` (the plugin's hook): binds a model of real vllm-ascend MoE layers (``real_moe``, this
  release's design); the hook's original (vllm-ascend's loader, which needs an NPU) is swapped for one that
  sets the model;
* ``init_routed_experts_capturer``: vLLM's real method (inherited), which creates vLLM's capturer and binds it
  (the runner's bind method, 0.20-0.27, or vLLM's module function, 0.28+: both the plugin's);
* each step, ``execute_model`` then ``sample_tokens`` (the plugin's hooks, as installed on the class): their
  originals swapped for stand-ins that run, around real MoE forwards, every statement of the runner's source
  that handles routed experts, as written there: found by the AST (each ``if`` block whose condition names
  ``routed_experts``) of vllm-ascend's V1 runner (step-start clear, slot-mapping snapshot, device-to-host
  copy, and the hand-off: ``RoutedExpertsLists`` when synchronous, the ``RoutedExpertsTensors`` snapshot the
  async output copies when ``--async``) or of vLLM's Model Runner V2 (``get_routed_experts``, which the NPU V2
  runner inherits). The async output's copy and conversion are vLLM's own ``RoutedExpertsTensors`` methods.

``--hybrid``: the KV cache holds a linear-attention (Mamba) group before the full-attention one, as Qwen3.5 /
Qwen3-Next do; the scheduler files rows by the attention group's slots.

Prints one JSON line (prefixed ``RESULT``) with what the test asserts on. The V1 runner's steps are here; Model
Runner V2's in ``npu_runner_v2``, vLLM 0.21.0's device-cache ones in ``npu_runner_device_cache``.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import inspect
import json
import os
import sys
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

RUNNER_MODULES = {"v1": "vllm_ascend.worker.model_runner_v1", "v2": "vllm_ascend.worker.v2.model_runner"}
VLLM_V2_RUNNER = "vllm.v1.worker.gpu.model_runner"
NUM_LAYERS, MAX_TOKENS, NUM_KV_BLOCKS, BLOCK_SIZE = 4, 16, 8, 4
STEPS = ((5, [9, 3, 17, 4, 30]), (3, [10, 18, 31]))  # (tokens, KV slot of each token in the attention group)
MAMBA_SLOT = 1000  # a linear-attention group's slots: none of them is an attention slot


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
    code = compile(ast.Module(body=[block.node], type_ignores=[]), f"<{module.__name__}.{block.method}>", "exec")
    exec(code, vars(module), scope)  # noqa: S102 (the runner's own statements, as written in its source)


@contextlib.contextmanager
def original_replaced(hooked: Callable[..., Any], stand_in: Callable[..., Any]) -> Iterator[Callable[..., Any]]:
    """Run the hook installed on the runner class with ``stand_in`` as the original it wraps; yields the real
    original (vllm-ascend's or vLLM's method) so the caller can check what the hook wraps."""
    cells = dict(zip(hooked.__code__.co_freevars, hooked.__closure__ or (), strict=True))
    cell = cells["original"]  # runner_mixin._hook's closure
    real = cell.cell_contents
    cell.cell_contents = stand_in
    try:
        yield real
    finally:
        cell.cell_contents = real


def is_hooked(method: Any) -> bool:
    """Whether ``method`` is a runner hook the plugin installed (imported late: the plugin registers mid-run)."""
    from vllm_ascend_routing.runner_mixin import is_hooked as plugin_hooked

    return plugin_hooked(method)


def call_through_class(runner: Any, name: str, stand_in: Callable[..., Any], *args: Any) -> str:
    """Call ``runner.<name>`` as installed on its class, with ``stand_in`` as the original the plugin's hook
    wraps; a method the plugin does not hook (``sample_tokens`` before vLLM 0.31) is the stand-in itself.
    Returns what the class's method wraps (vllm-ascend's or vLLM's method), or ``"not hooked"``."""
    method = getattr(type(runner), name)
    if not is_hooked(method):
        stand_in(runner, *args)
        return "not hooked"
    with original_replaced(method, stand_in) as real:
        getattr(runner, name)(*args)
    return str(real.__qualname__)


def kv_cache_config(hybrid: bool) -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

    attention = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype=torch.float32)
    groups = [KVCacheGroupSpec(["model.layers.3.self_attn.attn"], attention)]
    if hybrid:  # the linear-attention layers come first (layer 0 is linear attention in Qwen3.5 / Qwen3-Next)
        mamba = MambaSpec(block_size=BLOCK_SIZE, shapes=((2,),), dtypes=(torch.float32,))
        groups.insert(0, KVCacheGroupSpec(["model.layers.0.linear_attn"], mamba))
    return KVCacheConfig(num_blocks=NUM_KV_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)


def vllm_config(v2: bool, kv_config: Any) -> Any:
    hf = SimpleNamespace(num_hidden_layers=NUM_LAYERS, num_experts_per_tok=2, num_experts=8, model_type="qwen3_moe")
    model_config = SimpleNamespace(
        enable_return_routed_experts=True,
        hf_text_config=hf,
        hf_config=hf,
        get_num_experts=lambda: 8,
        get_num_experts_per_tok=lambda: 2,
        get_total_num_hidden_layers=lambda: NUM_LAYERS,
    )
    return SimpleNamespace(
        model_config=model_config,
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
        additional_config={},
        use_v2_model_runner=v2,
        instance_id=f"npu-runner-test-{os.getpid()}",
        compilation_config=SimpleNamespace(
            pass_config=SimpleNamespace(enable_sequence_parallelism=False), static_forward_context={}
        ),
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=sorted(RUNNER_MODULES))
    parser.add_argument("--async", dest="use_async", action="store_true")
    parser.add_argument("--hybrid", action="store_true")
    # verl's order: with VERL_VLLM_ASCEND_GLM52_PATCH=1 its vLLM utilities import vllm-ascend's own capture
    # patch when imported, before vLLM loads any plugin.
    parser.add_argument("--capture-patch-first", action="store_true")
    args = parser.parse_args(argv)

    from tests.ascend import (
        conftest,  # noqa: F401 (vllm-ascend's source on sys.path, torch_npu stubbed)
        moe_methods,
        real_moe,
    )

    os.environ["VLLM_ASCEND_ROUTING"] = "1"
    from vllm.platforms import current_platform

    import vllm_ascend_routing
    from vllm_ascend_routing import peers
    from vllm_ascend_routing.compat.interface import UnsupportedVllmError

    runner_module = RUNNER_MODULES[args.kind]
    result: dict[str, Any] = {"imported_before_register": runner_module in sys.modules}
    if args.capture_patch_first:
        result["capture_patch_first"] = load_vllm_ascend_capture_patch()
    patch = pytest.MonkeyPatch()
    patch.setattr(current_platform, "device_type", "npu")
    vllm_ascend_routing.register()  # what vLLM's plugin loader runs in every process
    patch.setattr(current_platform, "device_type", "cpu")  # vLLM sizes its capturer on this (no NPU here)

    # vllm-ascend's worker module imports vllm_ascend.ops (its op registrations) before the runner; the
    # worker module itself needs ACL. Then the worker's import of the runner: the plugin's patch follows.
    importlib.import_module("vllm_ascend.ops")
    result["imported_before_register"] |= runner_module in sys.modules
    module = importlib.import_module(runner_module)
    runner_cls = module.NPUModelRunner
    hooks = ("load_model", "execute_model", "sample_tokens", "init_routed_experts_capturer")
    hooks += ("_bind_routed_experts_capturer", "initialize_kv_cache")
    result["hooked"] = sorted(name for name in hooks if is_hooked(getattr(runner_cls, name, None)))

    kv_config = kv_cache_config(args.hybrid)
    config = vllm_config(args.kind == "v2", kv_config)
    runner = object.__new__(runner_cls)
    for name, value in {
        "vllm_config": config,
        "model_config": config.model_config,
        "scheduler_config": config.scheduler_config,
        "compilation_config": config.compilation_config,
        "device": torch.device("cpu"),
        "pin_memory": False,
        "use_async_scheduling": args.use_async,
        "speculative_config": None,
        "max_num_tokens": MAX_TOKENS,
        "routed_experts_capturer": None,
        "routed_experts_initialized": False,
        "kv_cache_config": kv_config,
    }.items():
        object.__setattr__(runner, name, value)
    patch.setattr(importlib.import_module("vllm.distributed"), "get_tensor_model_parallel_rank", lambda: 0)

    result["vllm_ascend_capture_patch"] = load_vllm_ascend_capture_patch()
    fused_moe = importlib.import_module(real_moe.FUSED_MOE)
    w8a8 = next(cls for cls in moe_methods.method_classes() if cls.__name__ == "AscendW8A8DynamicFusedMoEMethod")
    unquantized = next(cls for cls in moe_methods.method_classes() if cls.__name__ == "AscendUnquantizedFusedMoEMethod")
    assert fused_moe is not None
    layers = {
        layer_id: real_moe.build(patch, moe_methods.method_instance(cls), layer_id=layer_id)
        for layer_id, cls in {0: unquantized, 2: w8a8}.items()
    }
    model = torch.nn.Module()
    model.moe = torch.nn.ModuleDict({str(i): moe.layer for i, moe in layers.items()})
    for moe in layers.values():
        if getattr(moe.layer, "router", None) is None:  # vLLM's layer owns one (the select_experts designs
            moe.layer.router = SimpleNamespace()  # route without it); what the plugin's layer walk looks for
        config.compilation_config.static_forward_context[moe.layer.layer_name] = moe.layer

    def npu_loader(self: Any, *a: Any, **k: Any) -> None:
        self.model = model

    # the hook installed on the class, around a loader that needs no NPU
    result["load_model_wraps"] = call_through_class(runner, "load_model", npu_loader)
    # The engine core's start-up question (peers), put to this worker as vLLM's executor does, before its KV cache.
    worker = SimpleNamespace(model_runner=runner, rank=0)
    workers = peers.verify_workers(SimpleNamespace(collective_rpc=lambda ask: [ask(worker)]))
    result["workers_bound_layers"] = [answer.bound_layers for answer in workers]
    result["moe_layers"] = len(layers)
    from vllm_ascend_routing.compat import adapter as get_adapter
    from vllm_ascend_routing.compat.interface import Generation

    if get_adapter().generation is Generation.DEVICE_CACHE:
        from tests.ascend.npu_runner_device_cache import device_cache_steps

        result["steps"] = device_cache_steps(runner, module, layers, kv_config, args, result, patch)
        from vllm_ascend_routing import sentinel

        result["sentinel"] = sentinel.stats().as_dict()
        print("RESULT " + json.dumps(result), flush=True)
        return
    try:
        runner.init_routed_experts_capturer()  # vLLM's real method, through the plugin's hook
    except UnsupportedVllmError as refused:
        result["refused"] = str(refused)
        print("RESULT " + json.dumps(result), flush=True)
        return
    capturer = getattr(runner, "routed_experts_capturer", None)  # 0.22+: per runner
    if capturer is None:  # 0.20.x: the process singleton, by the name vllm-ascend's runner uses
        capturer = module.RoutedExpertsCapturer.get_instance()
    result["capturer"] = type(capturer).__name__
    result["buffer_is_plugins"] = _buffer(capturer) is _prepared_buffer(runner)
    result["vllm_ascend_binder_ran"] = any(
        "_ascend_routed_experts_capturer" in vars(part) for moe in layers.values() for part in (moe.layer, moe.experts)
    )
    routers = [moe.router for moe in layers.values() if real_moe.design() == "router"]
    result["router_hooks"] = sorted({type(getattr(router, "capture_fn", None)).__name__ for router in routers})
    own = getattr(fused_moe, "RoutedExpertsCapturer", None)  # 0.20.x: vllm-ascend's own capture asks this
    result["vllm_ascend_own_capturer"] = None if own is None else repr(own.get_instance())
    result["capturer_capture_module"] = getattr(getattr(capturer, "capture", None), "__module__", "")
    result["vllm_ascend_capture_calls"] = _watch_vllm_ascend_capture(patch)

    if args.kind == "v2":
        from tests.ascend.npu_runner_v2 import v2_steps

        steps = v2_steps(runner, layers, config, args.hybrid, result)
    else:
        steps = v1_steps(runner, module, layers, config, args, result)
    result["steps"] = steps
    result["vllm_ascend_capture_calls"] = result["vllm_ascend_capture_calls"]()
    from vllm_ascend_routing import sentinel

    result["sentinel"] = sentinel.stats().as_dict()  # the always-on check, run by the runner hook each step
    print("RESULT " + json.dumps(result), flush=True)


def _buffer(capturer: Any) -> Any:
    return getattr(capturer, "device_buffer", None) if capturer is not None else None


def _prepared_buffer(runner: Any) -> Any:
    from vllm_ascend_routing import runner_state

    prepared = runner_state.prepared_capture(runner)
    return None if prepared is None else prepared.buffer


VLLM_ASCEND_CAPTURE_PATCH = "vllm_ascend.patch.worker.patch_routed_experts_capture"


def load_vllm_ascend_capture_patch() -> bool:
    """vllm-ascend's own capture patch (0.23.0+: replaces vLLM's ``RoutedExpertsCapturer.capture`` with its
    DP/SP/MC2 handling), loaded from its file as vllm-ascend's worker loads it (the worker patch package also
    imports NPU-only modules, so the one module is loaded by path). Returns whether the release has it."""
    import importlib.util

    if VLLM_ASCEND_CAPTURE_PATCH in sys.modules:
        return True
    package = importlib.util.find_spec("vllm_ascend")
    assert package is not None and package.submodule_search_locations
    path = os.path.join(list(package.submodule_search_locations)[0], *VLLM_ASCEND_CAPTURE_PATCH.split(".")[1:])
    if not os.path.exists(path + ".py"):
        return False
    spec = importlib.util.spec_from_file_location(VLLM_ASCEND_CAPTURE_PATCH, path + ".py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[VLLM_ASCEND_CAPTURE_PATCH] = module
    spec.loader.exec_module(module)
    return True


def _watch_vllm_ascend_capture(patch: pytest.MonkeyPatch) -> Callable[[], int]:
    """Count calls of vLLM's capturer ``capture`` as vllm-ascend's patch left it: with the plugin on, nothing
    may call it (the plugin's captures write the buffer; vLLM's binder, which would hand routers this
    ``capture``, is the plugin's)."""
    capturer_module = importlib.import_module("vllm.model_executor.layers.fused_moe.routed_experts_capturer")
    cls = getattr(capturer_module, "RoutedExpertsCapturer", None)
    calls = [0]
    if cls is None or not hasattr(cls, "capture"):
        return lambda: calls[0]
    original = cls.capture

    def capture(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(self, *args, **kwargs)

    patch.setattr(cls, "capture", capture)
    return lambda: calls[0]


def forward_layers(layers: dict[int, Any], num_tokens: int, generator: torch.Generator) -> np.ndarray:
    """Real MoE forwards of every layer; the reference top-k of each."""
    from tests.ascend import real_moe

    expected = np.zeros((num_tokens, NUM_LAYERS, 2), dtype=np.int64)
    for layer_id, moe in layers.items():
        hidden = torch.randn(num_tokens, real_moe.HIDDEN, generator=generator)
        logits = torch.randn(num_tokens, real_moe.NUM_EXPERTS, generator=generator)
        moe.forward(hidden, logits)
        expected[:, layer_id] = real_moe.reference_top_k(logits, real_moe.TOP_K).numpy()
    return expected


def group_slot_mappings(slots: list[int], num_tokens: int, hybrid: bool) -> list[torch.Tensor]:
    """Each KV group's slot mapping for the step (padded with -1 like vllm-ascend's): the attention group's are
    the given slots; a linear-attention group's are other numbers."""
    attention = torch.tensor(slots + [-1] * (MAX_TOKENS - num_tokens))
    if not hybrid:
        return [attention]
    mamba = torch.tensor([MAMBA_SLOT + i for i in range(num_tokens)] + [-1] * (MAX_TOKENS - num_tokens))
    return [mamba, attention]


def v1_steps(
    runner: Any, module: Any, layers: dict[int, Any], config: Any, args: Any, result: dict[str, Any]
) -> list[dict[str, Any]]:
    """vllm-ascend's V1 runner: its own routed-experts statements, sync or async branch."""
    blocks = [b for b in routed_experts_blocks(type(runner)) if "init_routed_experts_capturer()" not in b.text]
    start = [b for b in blocks if "clear_buffer" in b.text]
    slots_snapshot = [b for b in blocks if "slot_mapping_device[:n]" in b.text]
    async_snapshot = [b for b in blocks if "RoutedExpertsTensors(" in b.text]
    # The device-to-host copy (or the 0.20.x shared-memory save) before the hand-off that reads it.
    after = sorted(
        (b for b in blocks if b not in start + slots_snapshot + async_snapshot),
        key=lambda b: "RoutedExpertsLists(" in b.text and ".copy_(" not in b.text,
    )
    result["blocks"] = {
        "start": [b.method for b in start],
        "slots": [b.method for b in slots_snapshot],
        "after": [b.method for b in after],
        "async": [b.method for b in async_snapshot],
        # the copy completes before the output is built (a stream synchronize): safe under either scheduling
        "after_synchronises": any(".synchronize()" in b.text for b in after),
    }
    # 0.20.x's runner has no async branch: its shared-memory save runs in sample_tokens either way.
    hand_off = async_snapshot if args.use_async and async_snapshot else after
    runner.input_batch = SimpleNamespace(block_table=[])  # the attention group's slots, as vllm-ascend keeps them
    return [step_v1(runner, module, layers, start + slots_snapshot, hand_off, args, *step) for step in STEPS]


def step_v1(
    runner: Any,
    module: Any,
    layers: dict[int, Any],
    before: list[Block],
    after: list[Block],
    args: Any,
    num_tokens: int,
    slots: list[int],
) -> dict[str, Any]:
    groups = group_slot_mappings(slots, num_tokens, args.hybrid)
    runner.input_batch.block_table = [SimpleNamespace(slot_mapping=SimpleNamespace(gpu=g)) for g in groups]
    runner.cpu_slot_mapping = groups[0].numpy()  # 0.20.x: vllm-ascend's own host copy of group 0's
    scheduler_output = SimpleNamespace(total_num_scheduled_tokens=num_tokens)
    scope = {
        "self": runner,
        "scheduler_output": scheduler_output,
        "slot_mapping": groups[0],  # vllm-ascend's snapshot statement runs for kv_cache_gid == 0
        "kv_cache_gid": 0,
        "model_runner_output": SimpleNamespace(routed_experts=None),
    }
    generator = torch.Generator().manual_seed(num_tokens)
    expected: list[Any] = []

    def execute_model(self: Any, output: Any, *a: Any, **k: Any) -> None:
        for block in before:
            run_block(block, module, scope)
        expected.append(forward_layers(layers, num_tokens, generator))

    def sample_tokens(self: Any, *a: Any, **k: Any) -> None:
        for block in after:
            run_block(block, module, scope)

    wraps = [
        call_through_class(runner, "execute_model", execute_model, scheduler_output),
        call_through_class(runner, "sample_tokens", sample_tokens, None),
    ]
    step: dict[str, Any] = {"expected": expected[0].tolist(), "slots": slots, "wraps": wraps}
    snapshot = scope.get("routed_experts_snapshot")
    shipped = scope.get("routed_experts_lists") or scope["model_runner_output"].routed_experts
    if snapshot is not None:  # async: what AsyncGPUModelRunnerOutput does with it, with vLLM's own methods
        shipped = snapshot.to_cpu_nonblocking().tolists()
    if shipped is not None:  # 0.22+: the rows vLLM's scheduler receives, by slot
        step["shipped_rows"] = np.asarray(shipped.routing_data).astype(np.int64).tolist()
        step["shipped_dtype"] = str(np.asarray(shipped.routing_data).dtype)
        step["shipped_slots"] = np.asarray(shipped.slot_mapping).astype(np.int64).tolist()
    else:  # 0.20.x: the rows the scheduler's reader finds in shared memory at those slots
        from vllm_ascend_routing.compat.shm.adapter import ShmRoutedExpertsReader

        reader = ShmRoutedExpertsReader.get_instance() or ShmRoutedExpertsReader.create()
        reader.attach_buffer(NUM_KV_BLOCKS * BLOCK_SIZE, runner.vllm_config)
        step["stored_rows"] = reader.get_routed_experts(np.array(slots)).astype(np.int64).tolist()
    return step


if __name__ == "__main__":
    main()
