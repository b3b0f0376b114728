# SPDX-License-Identifier: Apache-2.0
"""What every vLLM API generation module provides: the ``CaptureAPI`` adapter and the runner hooks and runner
classes it declares.

A generation module (``compat/shm.py``, ``runner_output.py``, ``aux_output.py``) defines ``ADAPTER`` (its
``CaptureAPI`` class, whose ``runner_hooks`` and ``runner_classes`` say which methods of which runner classes
it hooks) and ``PATCHES`` (every other symbol it replaces or relies on); the release table
(``vllm_ascend_routing/releases.py``) names the module in its ``GenerationReleases`` row. ``get_api``, the
manifest, ``integration``, ``envs`` and ``doctor`` read both from there; nothing else lists generations.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from vllm_ascend_routing.capture import PreparedCapture

from vllm_ascend_routing.errors import UnsupportedVllmError
from vllm_ascend_routing.releases import Generation, supported_releases_text

__all__ = [
    "SUPPORTED_RELEASES",
    "CaptureAPI",
    "Generation",
    "RequestSelection",
    "RunnerClass",
    "RunnerHook",
    "StepHooksNotUsed",
    "UnsupportedVllmError",
]

SUPPORTED_RELEASES = supported_releases_text()


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


class RequestSelection(Protocol):
    """The per-request choices of the output feature (``output.engine``), which a generation's scheduler-side hooks
    act on (0.31+: the AuxOutput connector's emit start); handed to the adapter by that feature at install."""

    @property
    def selecting(self) -> set[str]:
        """Requests (by id) whose first row the engine moves or whose rows it drops."""

    @property
    def opted_out(self) -> set[str]:
        """Requests (by id) that opted out of their rows."""

    def first_scheduled(self, request: Any) -> int:
        """At the request's first scheduling (idempotent): decide its first row; returns that token."""


class CaptureAPI(Protocol):
    """What the runner mixin and ``integration`` need from one vLLM API generation."""

    generation: Generation
    # The runner methods this generation hooks, and the runner classes it hooks them on, per platform device type.
    runner_hooks: tuple[RunnerHook, ...]
    runner_classes: Mapping[str, tuple[RunnerClass, ...]]
    # True where the front-end reads the rows from the plugin's own store (not vLLM's transport): a worker
    # running the plugin under an engine without it must then refuse (``peers.worker_ready``).
    rows_read_in_front_end: bool
    # True where vLLM narrows this generation's array by the routed expert count (uint8 up to 256 experts): zero
    # experts' ids past it would wrap there (``_common.refuse_unrepresentable_ids``).
    narrowed_by_expert_count: bool
    # Where rows of tokens a KV connector loaded are kept for this generation (``None``: KV connectors refused).
    kv_rows: Any

    def routed_experts_requested(self, vllm_config: Any) -> bool:
        """Whether this engine was started with ``--enable-return-routed-experts`` (where this generation keeps it)."""

    def install(self) -> None:
        """Apply this generation's own ``PATCHES`` in vLLM (idempotent; ``integration`` installs the runner hooks)."""

    def install_ascend(self) -> None:
        """Patch this generation's call sites in vllm-ascend (idempotent; run when its worker imports them)."""

    def install_request_options(self, selection: RequestSelection) -> None:
        """Where this generation's transport needs them: scheduler-side hooks acting on ``selection`` (idempotent)."""

    def prepare(self, model: torch.nn.Module, vllm_config: Any, device: torch.device) -> PreparedCapture | None:
        """At model load, before any forward: check the config, allocate the static capture buffer and
        bind every MoE layer of the target ``model`` (never a draft/MTP model) to it.

        Returns:
            The prepared capture, or ``None`` when routed-experts return is off for this engine.

        Raises:
            UnsupportedVllmError: for a configuration the capture cannot serve exactly.
        """

    def attach(self, runner: Any, prepared: PreparedCapture, capturer: Any) -> None:
        """Make vLLM's own capturer (created later by ``runner``, in its ``init_routed_experts_capturer``)
        carry the prepared buffer; refuse (``UnsupportedVllmError``) what this runner cannot ship exactly."""

    def after_forward(self, runner: Any, prepared: PreparedCapture, num_tokens: int) -> None:
        """Called once per step after the forward is enqueued; must not synchronise the device."""

    def kv_cache_ready(self, runner: Any, prepared: PreparedCapture, kv_cache_config: Any, profiling: bool) -> None:
        """After the runner's ``initialize_kv_cache`` (where the KV layout first exists)."""

    def step_started(self, runner: Any, prepared: PreparedCapture, scheduler_output: Any) -> None:
        """At the top of ``execute_model``, before the runner updates its batch."""

    def sample(self, runner: Any, prepared: PreparedCapture, sample_tokens: Callable[[], Any]) -> Any:
        """Runs the runner's ``sample_tokens`` (``sample_tokens()``) and returns its output."""


class StepHooksNotUsed:
    """Default step hooks for generations whose vLLM runner moves the rows itself."""

    def kv_cache_ready(self, runner: Any, prepared: PreparedCapture, kv_cache_config: Any, profiling: bool) -> None:
        return None

    def step_started(self, runner: Any, prepared: PreparedCapture, scheduler_output: Any) -> None:
        return None

    def sample(self, runner: Any, prepared: PreparedCapture, sample_tokens: Callable[[], Any]) -> Any:
        return sample_tokens()
