# SPDX-License-Identifier: Apache-2.0
"""Patch manifest: every symbol the plugin patches in vLLM and vllm-ascend, why, for which releases, and
when to remove it. ``verify`` checks the targets exist with the parameters the plugin relies on, so a
release that renames one is refused at start-up with the target named, instead of capturing zeros.

Every patch is idempotent (a marker attribute on the patched object) and nothing is patched while the
plugin is off.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any

from vllm_ascend_routing.compat.base import Generation, UnsupportedVllmError

_RUNNER_HOOKS = (
    ("load_model", ("self",), "bind MoE layers to the static buffer before vLLM first compiles the model"),
    ("execute_model", ("self", "scheduler_output"), "start moving the step's rows off the device"),
    ("init_routed_experts_capturer", ("self",), "vLLM creates its capturer; the plugin's binding is used"),
    ("_bind_routed_experts_capturer", ("self", "capturer"), "hand vLLM's capturer the prepared buffer"),
)
_ALL = (Generation.SHM, Generation.RUNNER_OUTPUT)
_AUX = (Generation.AUX_OUTPUT,)
# Hooks through which the aux-output generation drives vLLM's connector from a runner without its own.
_AUX_RUNNER_HOOKS = (
    ("load_model", ("self",), "bind MoE layers to the static buffer before vLLM first compiles the model"),
    ("initialize_kv_cache", ("self", "kv_cache_config"), "create vLLM's AuxOutput worker connector"),
    ("execute_model", ("self", "scheduler_output"), "connector.begin_step before the batch is updated"),
    ("sample_tokens", ("self",), "prepare_output / process_output around sampling; set the output field"),
)


@dataclass(frozen=True)
class Patch:
    """One patched symbol. ``target`` is ``"module:Qualified.name"``."""

    target: str
    why: str
    releases: str
    remove_when: str
    params: tuple[str, ...] = ()  # leading parameter names the plugin calls or receives
    generations: tuple[Generation, ...] = _ALL
    platform: str = "any"  # "any", "cpu", "npu"
    required: bool = True  # False: absent in some supported releases (e.g. Model Runner V2 before 0.31)


def _runner_patches(cls_path: str, platform: str, releases: str, required: bool) -> list[Patch]:
    return [
        Patch(f"{cls_path}.{name}", why, releases, "never (the mixin's hook points)", params, _ALL, platform, required)
        for name, params, why in _RUNNER_HOOKS
    ]


def _aux_runner_patches(cls_path: str, platform: str, releases: str, required: bool) -> list[Patch]:
    return [
        Patch(f"{cls_path}.{name}", why, releases, "the runner drives vLLM's AuxOutput connector itself", params,
              _AUX, platform, required)
        for name, params, why in _AUX_RUNNER_HOOKS
    ]


PATCHES: tuple[Patch, ...] = (
    *_runner_patches("vllm.v1.worker.gpu_model_runner:GPUModelRunner", "any", "vLLM 0.20-0.30", True),
    *_runner_patches("vllm.v1.worker.gpu.model_runner:GPUModelRunner", "any", "vLLM 0.26-0.30 (MRV2)", False),
    Patch(
        "vllm.v1.worker.gpu_model_runner:bind_routed_experts_capturer",
        "vLLM's module-level binder, as the runner imported it, routes to the runner's hook",
        "vLLM 0.28-0.30",
        "lowest supported vLLM >= 0.31",
        ("model", "capturer"),
        (Generation.RUNNER_OUTPUT,),
        required=False,
    ),
    Patch(
        "vllm.v1.worker.gpu_model_runner:RoutedExpertsCapturer",
        "substituted by the narrow shared-memory capturer (same call sites)",
        "vLLM 0.20.x",
        "lowest supported vLLM >= 0.22",
        generations=(Generation.SHM,),
    ),
    Patch(
        "vllm.v1.core.sched.scheduler:RoutedExpertsReader",
        "substituted by the narrow shared-memory reader (same call sites)",
        "vLLM 0.20.x",
        "lowest supported vLLM >= 0.22",
        generations=(Generation.SHM,),
    ),
    Patch(
        "vllm.model_executor.layers.fused_moe.cpu_fused_moe:CPUFusedMOE",
        "per bound layer, the instance's forward_method records the ids the CPU MoE computed itself",
        "vLLM 0.20-0.27",
        "lowest supported vLLM >= 0.28 (CPU MoE routes through BaseRouter)",
        platform="cpu",
        required=False,
    ),
    Patch(
        "vllm.model_executor.layers.fused_moe.cpu_fused_moe:_CPU_MOE_ACT_FN",
        "CPU compat fix: SiluAndMul built at forward time outside the config context (_cpu_compat)",
        "vLLM 0.20-0.27",
        "lowest supported vLLM >= 0.28",
        platform="cpu",
        required=False,
    ),
    Patch(
        "vllm.v1.engine.output_processor:RequestState._new_completion_output",
        "validation mode (VLLM_ASCEND_ROUTING_VALIDATE): check each finished request's array",
        "vLLM 0.20-0.30",
        "never while validation mode exists",
        ("self", "token_ids", "finish_reason"),
    ),
    Patch(
        "vllm.v1.engine.output_processor:RequestState.from_new_request",
        "validation mode: remember the request's routed_experts_prompt_start",
        "vLLM 0.20-0.30",
        "never while validation mode exists",
        ("tokenizer", "request"),
    ),
    Patch(
        "vllm.v1.engine.llm_engine:LLMEngine.__init__",
        "validation mode: remember the engine's model (experts, MoE layers)",
        "vLLM 0.20-0.30",
        "never while validation mode exists",
        ("self", "vllm_config"),
    ),
    Patch(
        "vllm.v1.engine.async_llm:AsyncLLM.__init__",
        "validation mode: remember the engine's model (experts, MoE layers)",
        "vLLM 0.20-0.30",
        "never while validation mode exists",
        ("self", "vllm_config"),
    ),
    # ---- vLLM 0.31+ (aux-output) ----
    *_aux_runner_patches("vllm.v1.worker.gpu_model_runner:GPUModelRunner", "any", "vLLM 0.31-0.32 (V1 runner)", True),
    Patch(
        "vllm.distributed.aux_output_connector.worker:bind_routed_experts_capturer",
        "the connector's capturer is handed the buffer bound at load (vLLM would bind after compiling)",
        "vLLM 0.31-0.32",
        "vLLM binds before its first compile on every platform",
        ("model", "capturer"),
        _AUX,
    ),
    Patch(
        "vllm.config.vllm:VllmConfig._verify_aux_output_compatibility",
        "CPU only: accept the V1 runner the plugin drives (vLLM exempts out-of-tree platforms the same way)",
        "vLLM 0.31-0.32",
        "vLLM's CPU build runs Model Runner V2",
        ("self",),
        _AUX,
        platform="cpu",
    ),
    # ---- vllm-ascend ----
    *_runner_patches("vllm_ascend.worker.model_runner_v1:NPUModelRunner", "npu", "vllm-ascend 0.20.2rc1-0.25", True),
    *_runner_patches("vllm_ascend.worker.v2.model_runner:NPUModelRunner", "npu", "vllm-ascend MRV2", False),
    Patch(
        "vllm_ascend.ops.fused_moe.experts_selector:select_experts",
        "in the global namespace of every function that calls it (found through __globals__ of the "
        "functions of the layer's class, its MoE runner's and its quant method's, MROs included, not by "
        "__module__, which 0.23.x renames): records the logical ids it returns (every quant method and "
        "the multistream gate path call it; none goes through BaseRouter)",
        "vllm-ascend 0.20.2rc1-0.25",
        "vllm-ascend routes every method through BaseRouter (its routers, 0.26+): use backend 'router'",
        ("hidden_states", "router_logits", "top_k"),
        platform="npu",
    ),
    Patch(
        "vllm_ascend.ops.fused_moe.fused_moe:AscendFusedMoE.forward_impl",
        "per bound layer (instance attribute): marks the layer active so select_experts knows its layer id",
        "vllm-ascend 0.20.2rc1-0.25",
        "as select_experts",
        ("self", "hidden_states", "router_logits"),
        platform="npu",
    ),
    Patch(
        "vllm_ascend.worker.model_runner_v1:RoutedExpertsCapturer",
        "the NPU runner's clear/save call sites reach the narrow shared-memory capturer",
        "vllm-ascend 0.20.2rc1 (vLLM 0.20.2)",
        "lowest supported vLLM >= 0.22",
        generations=(Generation.SHM,),
        platform="npu",
    ),
    Patch(
        "vllm_ascend.ops.fused_moe.fused_moe:RoutedExpertsCapturer",
        "vllm-ascend's own capture (unquantized method only) is turned off: the plugin records every method",
        "vllm-ascend 0.20.2rc1 (vLLM 0.20.2)",
        "lowest supported vLLM >= 0.22",
        generations=(Generation.SHM,),
        platform="npu",
    ),
)


def patches_for(generation: Generation, platform: str) -> list[Patch]:
    return [p for p in PATCHES if generation in p.generations and p.platform in ("any", platform)]


def resolve(target: str) -> Any:
    """The object ``"module:Qualified.name"`` names; raises ``LookupError`` saying what is missing."""
    module_name, _, qualname = target.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise LookupError(f"module {module_name} cannot be imported ({exc})") from exc
    for part in qualname.split("."):
        if not hasattr(obj, part):
            raise LookupError(f"{module_name} has no {qualname}")
        obj = getattr(obj, part)
    return obj


def problem(patch: Patch) -> str | None:
    """What is wrong with ``patch``'s target in the installed release, or ``None``."""
    try:
        obj = resolve(patch.target)
    except LookupError as exc:
        return None if not patch.required else str(exc)
    if not patch.params:
        return None
    try:
        names = list(inspect.signature(obj).parameters)
    except (TypeError, ValueError):
        return f"{patch.target} has no inspectable signature"
    missing = [name for name in patch.params if name not in names]
    if missing:
        return f"{patch.target}{inspect.signature(obj)} lacks parameter(s) {', '.join(missing)}"
    return None


def verify(generation: Generation, platform: str, package: str = "vllm_ascend") -> None:
    """Refuse to start if a patch target of ``package`` is missing or changed in the installed release."""
    problems = [
        found
        for patch in patches_for(generation, platform)
        if patch.target.split(".")[0] == package and (found := problem(patch)) is not None
    ]
    if problems:
        raise UnsupportedVllmError(
            f"vllm-ascend-routing: {package} {_version(package)} changed what the plugin patches:\n  - "
            + "\n  - ".join(problems)
            + "\nThis release is not supported yet: pin a supported one (README, 'Ascend') or unset "
            "VLLM_ASCEND_ROUTING."
        )


def _version(package: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(package.replace("_", "-"))
    except metadata.PackageNotFoundError:
        module = importlib.import_module(package)
        return str(getattr(module, "__version__", "(unknown version)"))
