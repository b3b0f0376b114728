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
vLLM's connector itself. Each generation's adapter declares the hooks it needs and the runner classes it hooks
them on (``Adapter.runner_hooks`` / ``runner_classes``); ``apply_mixin(runner_cls, adapter)`` installs those,
calling that adapter.

The mixin is never inherited: vLLM (and vllm-ascend) instantiate their own runner classes, so each hook is
installed on those classes in place, through ``patching.wrap``, around the class's own method.

This module is the capture feature of the registry (``features.FEATURES``, first): its ``install`` hooks the
platform's runner classes and applies the generation's own patches (the adapter's ``patches``, which the manifest
reads with the runner rows from the adapter: ``Adapter.rows``); vllm-ascend's runners are hooked when its worker
imports them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

from vllm_ascend_routing import patching, peers, runner_state, sentinel
from vllm_ascend_routing._post_import import when_imported
from vllm_ascend_routing.context import InstallContext
from vllm_ascend_routing.output import weights
from vllm_ascend_routing.patching import Patch

if TYPE_CHECKING:
    from vllm_ascend_routing.compat.interface import Adapter

PATCHES: tuple[Patch, ...] = ()  # the runner hooks' rows and the generation's own are the adapter's (Adapter.rows)
NEEDS: tuple[str, ...] = ()

_SAMPLING = "_vllm_ascend_routing_sampling"


class RoutingCaptureRunnerMixin:
    """Hooks; each receives the generation adapter and the patched class's ``original`` method (``None``
    if it has none)."""

    model: Any
    vllm_config: Any
    device: Any

    def load_model(self, adapter: Adapter, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        if not runner_state.has_prepared(self):  # once per model, even if a subclass nests calls
            prepared = adapter.prepare(self.model, self.vllm_config, self.device)
            runner_state.set_prepared(self, prepared)
            if prepared is not None:
                weights.track(self)  # the weight version each step's rows are written under
        return result

    def execute_model(
        self, adapter: Adapter, original: Callable[..., Any], scheduler_output: Any, *args: Any, **kwargs: Any
    ) -> Any:
        prepared = runner_state.prepared_capture(self)
        if prepared is None:
            return original(self, scheduler_output, *args, **kwargs)
        num_tokens = int(scheduler_output.total_num_scheduled_tokens)
        adapter.step_started(self, prepared, scheduler_output)
        prepared.sentinel.clear(num_tokens)
        result = original(self, scheduler_output, *args, **kwargs)
        # The forward is enqueued: start moving its rows off the device, then check them (no synchronisation).
        adapter.after_forward(self, prepared, num_tokens)
        prepared.sentinel.after_forward(num_tokens, lambda: sentinel.step_requests(self, scheduler_output))
        return result

    def sample_tokens(self, adapter: Adapter, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        prepared = runner_state.prepared_capture(self)
        if prepared is None or getattr(self, _SAMPLING, False):  # a subclass calling super(): hook once
            return original(self, *args, **kwargs)
        setattr(self, _SAMPLING, True)
        try:
            return adapter.sample(self, prepared, lambda: original(self, *args, **kwargs))
        finally:
            setattr(self, _SAMPLING, False)

    def initialize_kv_cache(
        self, adapter: Adapter, original: Callable[..., Any], kv_cache_config: Any, *args: Any, **kwargs: Any
    ) -> Any:
        with runner_state.as_binding_runner(self):  # Model Runner V2 creates vLLM's connector (and binder) here
            result = original(self, kv_cache_config, *args, **kwargs)
        prepared = runner_state.prepared_capture(self)
        if prepared is not None:
            profiling = bool(kwargs.get("is_profiling", args[0] if args else False))
            adapter.kv_cache_ready(self, prepared, kv_cache_config, profiling)
            if not profiling:
                peers.worker_ready(self, adapter.rows_read_in_front_end)
        return result

    def init_routed_experts_capturer(self, adapter: Adapter, original: Callable[..., Any]) -> None:
        peers.worker_ready(self, adapter.rows_read_in_front_end)  # the engine core has asked its workers by now
        with runner_state.as_binding_runner(self):
            original(self)  # vLLM's own init: capturer, pinned host buffers, slot-mapping snapshot

    def _bind_routed_experts_capturer(
        self, adapter: Adapter, original: Callable[..., Any] | None, capturer: Any
    ) -> None:
        prepared = runner_state.prepared_capture(self)
        if prepared is None:
            raise RuntimeError(
                "vllm-ascend-routing: the runner's load_model hook did not run, so routed-experts "
                f"capture was never bound before compilation ({type(self).__name__} is not supported)."
            )
        adapter.attach(self, prepared, capturer)


def _hook(name: str, original: Callable[..., Any] | None, adapter: Adapter) -> Callable[..., Any]:
    hook = getattr(RoutingCaptureRunnerMixin, name)

    @functools.wraps(original or hook)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return hook(self, adapter, original, *args, **kwargs)

    return method


def is_hooked(method: Any) -> bool:
    """Whether ``method`` is one of the hooks ``apply_mixin`` installed (or another of the plugin's replacements)."""
    return patching.is_wrapped(method)


def apply_mixin(runner_cls: type, adapter: Adapter) -> None:
    """Install ``adapter``'s runner hooks on ``runner_cls`` (idempotent), each through ``patching.wrap`` around that
    class's own original. A method the class inherits from an already hooked base is left alone: wrapping it
    again would run the hook twice."""
    for spec in adapter.runner_hooks:
        patching.wrap(
            runner_cls,
            spec.name,
            functools.partial(_hook, spec.name, adapter=adapter),
            add=spec.added_if_absent,
        )


def install(ctx: InstallContext) -> None:
    """Hook the platform's runner classes (vllm-ascend's when its worker imports them), then apply the generation's
    own patches (idempotent)."""
    adapter = ctx.adapter
    runners = adapter.runner_classes[ctx.platform]
    for cls in filter(None, (_load(runner.path) for runner in runners if not runner.in_vllm_ascend)):
        apply_mixin(cls, adapter)
    adapter.install()
    for runner in runners:
        if runner.in_vllm_ascend:
            module_name, _, attr = runner.path.partition(":")
            when_imported(module_name, functools.partial(_patch_npu_runner, attr=attr, ctx=ctx))


def _load(path: str) -> type | None:
    try:
        cls = patching.resolve(path)
    except LookupError:
        return None
    return cls if isinstance(cls, type) else None


def _patch_npu_runner(module: ModuleType, *, attr: str, ctx: InstallContext) -> None:
    """Runs right after the worker imports a vllm-ascend runner module: verify vllm-ascend's targets, then patch."""
    ctx.verify("vllm_ascend")
    cls = getattr(module, attr, None)
    if isinstance(cls, type):
        apply_mixin(cls, ctx.adapter)
    ctx.adapter.install_ascend()
