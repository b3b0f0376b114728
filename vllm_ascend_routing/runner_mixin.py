# SPDX-License-Identifier: Apache-2.0
"""``RoutingCaptureRunnerMixin``: the model-runner hooks, written once for every vLLM generation.

Two moments matter:
  * ``load_model``: right after the model exists and before its first forward, the target model's MoE
    layers are bound to a static capture buffer. It must be this early: vLLM compiles (and captures
    graphs of) the model during memory profiling, before it creates its capturer, and a compiled graph
    keeps only the code present when it was traced. Binding later (upstream's moment) records nothing
    where the MoE forward is traced (vLLM's CPU path: all-zero routing under ``torch.compile``).
  * ``init_routed_experts_capturer`` / ``_bind_routed_experts_capturer``: vLLM's own capturer is created
    as usual and is handed the static buffer instead of binding layers itself.
Where the runner has no routed-experts code of its own (vLLM 0.31+'s V1 runner, which the CPU and Ascend
runners build on), ``initialize_kv_cache`` / ``execute_model`` / ``sample_tokens`` let the generation drive
vLLM's connector itself. Each generation module declares the hooks it needs and the runner classes it hooks
them on (``ADAPTER.runner_hooks`` / ``runner_classes``); ``apply_mixin(runner_cls, api)`` installs those,
calling that adapter.

The mixin is never inherited: vLLM (and vllm-ascend) instantiate their own runner classes, so each hook is
installed on those classes in place, through ``patching.wrap``, around the class's own method.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vllm_ascend_routing import patching, peers, runner_state, sentinel
from vllm_ascend_routing.compat.base import RunnerClass, RunnerHook
from vllm_ascend_routing.output import weights
from vllm_ascend_routing.patching import RELY, Patch
from vllm_ascend_routing.releases import Generation

if TYPE_CHECKING:
    from vllm_ascend_routing.compat.base import CaptureAPI

_SAMPLING = "_vllm_ascend_routing_sampling"


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


class RoutingCaptureRunnerMixin:
    """Hooks; each receives the generation adapter and the patched class's ``original`` method (``None``
    if it has none)."""

    model: Any
    vllm_config: Any
    device: Any

    def load_model(self, api: CaptureAPI, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        if not runner_state.has_prepared(self):  # once per model, even if a subclass nests calls
            prepared = api.prepare(self.model, self.vllm_config, self.device)
            runner_state.set_prepared(self, prepared)
            if prepared is not None:
                weights.track(self)  # the weight version each step's rows are written under
        return result

    def execute_model(
        self, api: CaptureAPI, original: Callable[..., Any], scheduler_output: Any, *args: Any, **kwargs: Any
    ) -> Any:
        prepared = runner_state.prepared_capture(self)
        if prepared is None:
            return original(self, scheduler_output, *args, **kwargs)
        num_tokens = int(scheduler_output.total_num_scheduled_tokens)
        api.step_started(self, prepared, scheduler_output)
        prepared.sentinel.clear(num_tokens)
        result = original(self, scheduler_output, *args, **kwargs)
        # The forward is enqueued: start moving its rows off the device, then check them (no synchronisation).
        api.after_forward(self, prepared, num_tokens)
        prepared.sentinel.after_forward(num_tokens, lambda: sentinel.step_requests(self, scheduler_output))
        return result

    def sample_tokens(self, api: CaptureAPI, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        prepared = runner_state.prepared_capture(self)
        if prepared is None or getattr(self, _SAMPLING, False):  # a subclass calling super(): hook once
            return original(self, *args, **kwargs)
        setattr(self, _SAMPLING, True)
        try:
            return api.sample(self, prepared, lambda: original(self, *args, **kwargs))
        finally:
            setattr(self, _SAMPLING, False)

    def initialize_kv_cache(
        self, api: CaptureAPI, original: Callable[..., Any], kv_cache_config: Any, *args: Any, **kwargs: Any
    ) -> Any:
        with runner_state.as_binding_runner(self):  # Model Runner V2 creates vLLM's connector (and binder) here
            result = original(self, kv_cache_config, *args, **kwargs)
        prepared = runner_state.prepared_capture(self)
        if prepared is not None:
            profiling = bool(kwargs.get("is_profiling", args[0] if args else False))
            api.kv_cache_ready(self, prepared, kv_cache_config, profiling)
            if not profiling:
                peers.worker_ready(self, api.rows_read_in_front_end)
        return result

    def init_routed_experts_capturer(self, api: CaptureAPI, original: Callable[..., Any]) -> None:
        peers.worker_ready(self, api.rows_read_in_front_end)  # the engine core has asked its workers by now
        with runner_state.as_binding_runner(self):
            original(self)  # vLLM's own init: capturer, pinned host buffers, slot-mapping snapshot

    def _bind_routed_experts_capturer(
        self, api: CaptureAPI, original: Callable[..., Any] | None, capturer: Any
    ) -> None:
        prepared = runner_state.prepared_capture(self)
        if prepared is None:
            raise RuntimeError(
                "vllm-ascend-routing: the runner's load_model hook did not run, so routed-experts "
                f"capture was never bound before compilation ({type(self).__name__} is not supported)."
            )
        api.attach(self, prepared, capturer)


def _hook(name: str, original: Callable[..., Any] | None, api: CaptureAPI) -> Callable[..., Any]:
    hook = getattr(RoutingCaptureRunnerMixin, name)

    @functools.wraps(original or hook)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return hook(self, api, original, *args, **kwargs)

    return method


def is_hooked(method: Any) -> bool:
    """Whether ``method`` is one of the hooks ``apply_mixin`` installed (or another of the plugin's replacements)."""
    return patching.is_wrapped(method)


def apply_mixin(runner_cls: type, api: CaptureAPI) -> None:
    """Install ``api``'s runner hooks on ``runner_cls`` (idempotent), each through ``patching.wrap`` around that
    class's own original. A method the class inherits from an already hooked base is left alone: wrapping it
    again would run the hook twice."""
    for spec in api.runner_hooks:
        patching.wrap(
            runner_cls,
            spec.name,
            functools.partial(_hook, spec.name, api=api),
            add=spec.added_if_absent,
        )
