# SPDX-License-Identifier: Apache-2.0
"""Building blocks the generation modules declare their runner hooks and runner classes from.

Each generation module says which of these it hooks (``ADAPTER.runner_hooks`` / ``runner_classes``); this
module only names the pieces several of them share.
"""

from __future__ import annotations

from collections.abc import Mapping

from vllm_ascend_routing.compat.base import RunnerClass, RunnerHook
from vllm_ascend_routing.releases import BINDER_METHOD

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
