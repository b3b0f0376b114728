# SPDX-License-Identifier: Apache-2.0
"""Building blocks the generation modules declare their runner hooks and runner classes from.

Each generation's adapter says which of these it hooks (``Adapter.runner_hooks`` / ``runner_classes``); this
module defines a hook and a runner class, the pieces several generations share, and their manifest rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from vllm_ascend_routing.patching import RELY, Patch
from vllm_ascend_routing.releases import BINDER_METHOD, Generation


@dataclass(frozen=True)
class RunnerHook:
    """One model-runner method a generation hooks (``runner_mixin.RoutingCaptureRunnerMixin`` has the hook)."""

    name: str
    params: tuple[str, ...]  # leading parameters of vLLM's method the hook relies on
    why: str
    # True: added where vLLM's runner lacks the method (the generation's module-level binder routes to it);
    # otherwise a method is hooked only where the runner class has it.
    added_if_absent: bool = False
    one_of: str = ""  # manifest group: this method or another target of the group must exist


@dataclass(frozen=True)
class RunnerClass:
    """One model-runner class a generation hooks (``"module:Class"``)."""

    path: str
    required: bool  # False: absent from some supported releases (then skipped)
    # True: a subclass of a hooked class. Its own overrides of the hooked methods are hooked too (a CPU runner
    # overrides load_model), but which ones it overrides varies by release: the manifest requires the class
    # only (one ``RELY`` row), not each hooked method on it.
    hooks_optional: bool = False
    # True: its routed-experts slot-mapping snapshot is KV cache group 0's where vLLM's runners take the first
    # full-attention group's (``_common.misplaced_slot_group``: re-taken, or refused where it cannot be).
    snapshots_kv_group_0: bool = False

    @property
    def in_vllm_ascend(self) -> bool:
        """vllm-ascend's runners are hooked (and verified) when its worker imports them, not at start-up."""
        return self.path.startswith("vllm_ascend")


def runner_patches(
    hooks: tuple[RunnerHook, ...], classes: tuple[RunnerClass, ...], generations: tuple[Generation, ...], platform: str
) -> list[Patch]:
    """The manifest rows of ``hooks`` on each of ``classes`` (one platform's runner classes)."""
    rows: list[Patch] = []
    for runner in classes:
        if runner.hooks_optional:
            rows.append(
                Patch(
                    runner.path,
                    "the platform's runner (hooks on its own overrides)",
                    "never",
                    generations,
                    platform=platform,
                    required=runner.required,
                    action=RELY,
                )
            )
            continue
        # A hooked method may be the class's own or inherited (vllm-ascend's runners define
        # _bind_routed_experts_capturer up to 0.26.0rc1 and inherit vLLM's binding from 0.27.1rc1). vllm-ascend's
        # rows are verified apart from vLLM's (when its runner module is imported), so they join no group of
        # vLLM's: vLLM's own rows already require one binder.
        for hook in hooks:
            rows.append(
                Patch(
                    f"{runner.path}.{hook.name}",
                    hook.why,
                    "never (the runner mixin's hook points)",
                    generations,
                    hook.params,
                    platform=platform,
                    required=runner.required and not hook.added_if_absent,
                    one_of=hook.one_of if runner.required and not runner.in_vllm_ascend else "",
                )
            )
    return rows


# The manifest group of vLLM's capturer binder (``releases.BINDER_METHOD`` / ``BINDER_FUNCTION``): where it is
# depends on the release, one of the group must exist.
CAPTURER_BINDER = "vLLM's capturer binder"

LOAD_MODEL = RunnerHook(
    "load_model", ("self",), "bind MoE layers to the static buffer before vLLM first compiles the model"
)
# Generations whose vLLM runner has its own routed-experts capturer: the hooks hand it the prepared buffer.
CAPTURER_HOOKS: tuple[RunnerHook, ...] = (
    LOAD_MODEL,
    RunnerHook("execute_model", ("self", "scheduler_output"), "start moving the step's rows off the device"),
    RunnerHook(
        "init_routed_experts_capturer",
        ("self",),
        "vLLM creates its capturer here; the runner is the binding runner meanwhile",
    ),
    RunnerHook(
        BINDER_METHOD,
        ("self", "capturer"),
        "hand vLLM's capturer the prepared buffer (added where vLLM binds through a module function)",
        added_if_absent=True,
        one_of=CAPTURER_BINDER,
    ),
)

_GPU = (
    RunnerClass("vllm.v1.worker.gpu_model_runner:GPUModelRunner", True),  # V1 runner
    RunnerClass("vllm.v1.worker.gpu.model_runner:GPUModelRunner", False),  # Model Runner V2 (0.26+)
)
# The model-runner classes hooked, per platform device type.
RUNNER_CLASSES: Mapping[str, tuple[RunnerClass, ...]] = {
    "cuda": _GPU,
    # The CPU runners subclass the GPU ones and override load_model, so they are hooked too.
    "cpu": (
        *_GPU,
        RunnerClass("vllm.v1.worker.cpu_model_runner:CPUModelRunner", True, hooks_optional=True),
        RunnerClass("vllm.v1.worker.cpu.model_runner:CPUModelRunner", False, hooks_optional=True),
    ),
    # vllm-ascend's runners override the hooked methods: hooked when the worker imports them.
    "npu": (
        *_GPU,
        # Its own _build_attention_metadata snapshots the routed-experts slot mapping of KV cache group 0.
        RunnerClass("vllm_ascend.worker.model_runner_v1:NPUModelRunner", True, snapshots_kv_group_0=True),
        RunnerClass("vllm_ascend.worker.v2.model_runner:NPUModelRunner", False),
    ),
}
# Modules of the runner classes whose routed-experts slot snapshot is KV cache group 0's, not the attention
# group's (``_common.misplaced_slot_group``).
GROUP_0_SNAPSHOT_MODULES = frozenset(
    runner.path.partition(":")[0]
    for runners in RUNNER_CLASSES.values()
    for runner in runners
    if runner.snapshots_kv_group_0
)
