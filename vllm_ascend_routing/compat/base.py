# SPDX-License-Identifier: Apache-2.0
"""The small interface every vLLM API generation implements, and the generation names."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from vllm_ascend_routing.capture import PreparedCapture
    from vllm_ascend_routing.runner_state import RunnerHook

from vllm_ascend_routing.releases import Generation, supported_releases_text

__all__ = ["SUPPORTED_RELEASES", "CaptureAPI", "Generation", "StepHooksNotUsed", "UnsupportedVllmError"]

SUPPORTED_RELEASES = supported_releases_text()


class UnsupportedVllmError(RuntimeError):
    """Raised at start-up for a vLLM release or configuration the plugin refuses."""


class CaptureAPI(Protocol):
    """What the runner mixin and ``integration`` need from one vLLM API generation."""

    generation: Generation
    # The runner methods this generation hooks (``runner_mixin.CAPTURER_HOOKS`` / ``CONNECTOR_HOOKS``).
    runner_hooks: tuple[RunnerHook, ...]
    # True where the front-end reads the rows from the plugin's own store (not vLLM's transport): a worker
    # running the plugin under an engine without it must then refuse (``peers.worker_ready``).
    rows_read_in_front_end: bool

    def routed_experts_requested(self, vllm_config: Any) -> bool:
        """Whether this engine was started with ``--enable-return-routed-experts`` (where this generation keeps it)."""

    def install(self) -> None:
        """Patch this generation's runner hooks into vLLM (idempotent)."""

    def install_ascend(self) -> None:
        """Patch this generation's call sites in vllm-ascend (idempotent; run when its worker imports them)."""

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
