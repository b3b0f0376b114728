# SPDX-License-Identifier: Apache-2.0
"""The one adapter type: what a vLLM API generation provides (``Adapter``), and what features hand it.

Each generation is one folder of ``compat/`` whose adapter subclasses ``Adapter`` and states, as class attributes:
its patch rows (``patches``), the runner hooks and runner classes it hooks them on, and its capabilities, which
features ask instead of a generation's name (``context.satisfied``): ``per_request_output`` (its transport starts a
request's rows at ``routed_experts_prompt_start`` and sends them per request through the engine core, so the
per-request options, the provenance record and the HTTP fields can be served), ``kv_rows`` (its store of rows of
tokens a KV connector loaded; ``None``: KV connectors are refused), ``rows_read_in_front_end`` and
``narrowed_by_expert_count``. The release table (``releases.py``) names the class in its ``GenerationReleases`` row;
``compat.adapter()`` returns the detected one's instance. A generation defines only what differs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from vllm_ascend_routing.compat import _common
from vllm_ascend_routing.compat._runners import RunnerClass, RunnerHook, runner_patches
from vllm_ascend_routing.errors import UnsupportedVllmError
from vllm_ascend_routing.releases import Generation, supported_releases_text

if TYPE_CHECKING:
    import torch

    from vllm_ascend_routing.capture import PreparedCapture
    from vllm_ascend_routing.kv import KvRows
    from vllm_ascend_routing.patching import Patch

__all__ = [
    "SUPPORTED_RELEASES",
    "Adapter",
    "Generation",
    "RequestSelection",
    "RunnerClass",
    "RunnerHook",
    "UnsupportedVllmError",
]

SUPPORTED_RELEASES = supported_releases_text()


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


class Adapter:
    """One vLLM API generation, as the runner hooks, the features and the manifest use it."""

    generation: Generation
    patches: tuple[Patch, ...] = ()  # every symbol this generation replaces or relies on, besides its runner hooks
    # The runner methods this generation hooks, and the runner classes it hooks them on, per platform device type.
    runner_hooks: tuple[RunnerHook, ...] = ()
    runner_classes: Mapping[str, tuple[RunnerClass, ...]] = {}
    # ---- capabilities ----
    # The transport starts a request's rows at ``routed_experts_prompt_start`` and sends them per request through the
    # engine core: per-request options, the provenance record and the HTTP fields are served (features ``output``).
    per_request_output: bool = False
    # Where rows of tokens a KV connector loaded are kept (``None``: KV connectors are refused at model load).
    kv_rows: KvRows | None = None
    # The front end reads the rows from the plugin's own store (not vLLM's transport): a worker running the plugin
    # under an engine without it must then refuse (``peers.worker_ready``).
    rows_read_in_front_end: bool = False
    # vLLM narrows this generation's array by the routed expert count (uint8 up to 256 experts): zero experts' ids
    # past it would wrap there (``_common.refuse_unrepresentable_ids``).
    narrowed_by_expert_count: bool = False

    @classmethod
    def rows(cls, platform: str) -> list[Patch]:
        """The manifest rows of this generation on ``platform``: its runner hooks on that platform's runner classes,
        then its own ``patches``."""
        hooks = runner_patches(cls.runner_hooks, cls.runner_classes.get(platform, ()), (cls.generation,), platform)
        own = [patch for patch in cls.patches if patch.platform in ("any", platform)]
        return hooks + own

    def routed_experts_requested(self, vllm_config: Any) -> bool:
        """``--enable-return-routed-experts``, on the model config (where every generation but aux-output keeps it)."""
        return bool(vllm_config.model_config.enable_return_routed_experts)

    def install(self) -> None:
        """Apply this generation's own ``patches`` in vLLM (idempotent; the capture feature installs the runner
        hooks)."""
        raise NotImplementedError

    def install_ascend(self) -> None:
        """Patch this generation's call sites in vllm-ascend (idempotent; run when its worker imports them)."""

    def install_request_options(self, selection: RequestSelection) -> None:
        """Where this generation's transport needs them: scheduler-side hooks acting on ``selection`` (idempotent).
        None here: the transport reads the request's parameters as the output feature leaves them."""

    # ---- model load ----

    def routing_shape(self, vllm_config: Any) -> tuple[int, int, int]:
        """``(num_hidden_layers, top_k, num_experts)`` exactly as this generation's capturer sizes them."""
        raise NotImplementedError

    def refuse_before_binding(self, vllm_config: Any) -> None:
        """This generation's own refusals, before the shared ones (``_common.refuse_unsupported_config``)."""

    def prepare(self, model: torch.nn.Module, vllm_config: Any, device: torch.device) -> PreparedCapture | None:
        """At model load, before any forward: check the config, allocate the static capture buffer and bind every
        MoE layer of the target ``model`` (never a draft/MTP model) to it.

        Returns:
            The prepared capture, or ``None`` when routed-experts return is off for this engine.

        Raises:
            UnsupportedVllmError: for a configuration the capture cannot serve exactly.
        """
        if not self.routed_experts_requested(vllm_config):
            return None
        self.refuse_before_binding(vllm_config)
        return _common.prepare_capture(
            model,
            vllm_config,
            device,
            self.routing_shape(vllm_config),
            generation=self.generation.value,
            narrowed_by_expert_count=self.narrowed_by_expert_count,
            kv_rows=self.kv_rows,
        )

    def attach(self, runner: Any, prepared: PreparedCapture, capturer: Any) -> None:
        """Make vLLM's own capturer (created later by ``runner``, in its ``init_routed_experts_capturer``) carry the
        prepared buffer; refuse (``UnsupportedVllmError``) what this runner cannot ship exactly."""
        raise NotImplementedError

    # ---- every step (none may synchronise the device) ----

    def after_forward(self, runner: Any, prepared: PreparedCapture, num_tokens: int) -> None:
        """Called once per step after the forward is enqueued."""
        raise NotImplementedError

    def kv_cache_ready(self, runner: Any, prepared: PreparedCapture, kv_cache_config: Any, profiling: bool) -> None:
        """After the runner's ``initialize_kv_cache`` (where the KV layout first exists). Nothing here: vLLM's
        runner moves the rows itself."""

    def step_started(self, runner: Any, prepared: PreparedCapture, scheduler_output: Any) -> None:
        """At the top of ``execute_model``, before the runner updates its batch. Nothing here."""

    def sample(self, runner: Any, prepared: PreparedCapture, sample_tokens: Callable[[], Any]) -> Any:
        """Runs the runner's ``sample_tokens`` (``sample_tokens()``) and returns its output."""
        return sample_tokens()
