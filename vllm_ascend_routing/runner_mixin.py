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
vLLM's connector itself. The hooks call only ``compat.get_api()``; ``apply_mixin`` installs them on runner
classes vLLM creates.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import Any

from vllm_ascend_routing.compat import get_api

_PATCHED = "_vllm_ascend_routing_patched"
PREPARED = "_vllm_ascend_routing_capture"
_SAMPLING = "_vllm_ascend_routing_sampling"

# The runner whose init_routed_experts_capturer() is running, for vLLM releases (0.28+) whose runner
# binds through a module-level function that is not given the runner.
_binding_runner: contextvars.ContextVar[Any] = contextvars.ContextVar("binding_runner", default=None)


def binding_runner() -> Any:
    """The runner currently creating its capturer, or ``None``."""
    return _binding_runner.get()


class RoutingCaptureRunnerMixin:
    """Hooks; each receives the patched class's ``original`` method (``None`` if it has none)."""

    model: Any
    vllm_config: Any
    device: Any

    def load_model(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        done = getattr(self, PREPARED, None)
        if done is None or done[0] is not self.model:  # once per model, even if a subclass nests calls
            setattr(self, PREPARED, (self.model, get_api().prepare(self.model, self.vllm_config, self.device)))
        return result

    def execute_model(self, original: Callable[..., Any], scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        _, prepared = getattr(self, PREPARED, (None, None))
        if prepared is not None:
            get_api().step_started(self, prepared, scheduler_output)
        result = original(self, scheduler_output, *args, **kwargs)
        if prepared is not None:  # the forward is enqueued: start moving its rows off the device
            get_api().after_forward(prepared, scheduler_output.total_num_scheduled_tokens)
        return result

    def sample_tokens(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        _, prepared = getattr(self, PREPARED, (None, None))
        if prepared is None or getattr(self, _SAMPLING, False):  # a subclass calling super(): hook once
            return original(self, *args, **kwargs)
        setattr(self, _SAMPLING, True)
        try:
            return get_api().sample(self, prepared, lambda: original(self, *args, **kwargs))
        finally:
            setattr(self, _SAMPLING, False)

    def initialize_kv_cache(self, original: Callable[..., Any], kv_cache_config: Any, *args: Any,
                            **kwargs: Any) -> Any:
        token = _binding_runner.set(self)  # Model Runner V2 creates vLLM's connector (and binder) in here
        try:
            result = original(self, kv_cache_config, *args, **kwargs)
        finally:
            _binding_runner.reset(token)
        _, prepared = getattr(self, PREPARED, (None, None))
        if prepared is not None:
            profiling = bool(kwargs.get("is_profiling", args[0] if args else False))
            get_api().kv_cache_ready(self, prepared, kv_cache_config, profiling)
        return result

    def init_routed_experts_capturer(self, original: Callable[..., Any]) -> None:
        token = _binding_runner.set(self)
        try:
            original(self)  # vLLM's own init: capturer, pinned host buffers, slot-mapping snapshot
        finally:
            _binding_runner.reset(token)

    def _bind_routed_experts_capturer(self, original: Callable[..., Any] | None, capturer: Any) -> None:
        _, prepared = getattr(self, PREPARED, (None, None))
        if prepared is None:
            raise RuntimeError(
                "vllm-ascend-routing: the runner's load_model hook did not run, so routed-experts "
                f"capture was never bound before compilation ({type(self).__name__} is not supported)."
            )
        get_api().attach(prepared, capturer)


_HOOKS = ("load_model", "execute_model", "init_routed_experts_capturer", "_bind_routed_experts_capturer")
# Wrapped only where the class has them: a runner without these is not given new methods.
_OPTIONAL_HOOKS = ("sample_tokens", "initialize_kv_cache")
_HOOK_MARK = "_vllm_ascend_routing_hook"


def _hook(name: str, original: Callable[..., Any] | None) -> Callable[..., Any]:
    hook = getattr(RoutingCaptureRunnerMixin, name)

    @functools.wraps(original or hook)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return hook(self, original, *args, **kwargs)

    setattr(method, _HOOK_MARK, True)
    return method


def apply_mixin(runner_cls: type) -> None:
    """Install the hooks on ``runner_cls`` (idempotent); each wraps that class's own original."""
    if runner_cls.__dict__.get(_PATCHED):
        return
    for name in (*_HOOKS, *_OPTIONAL_HOOKS):
        current = getattr(runner_cls, name, None)
        if current is None and name in _OPTIONAL_HOOKS:
            continue
        if getattr(current, _HOOK_MARK, False):
            continue  # inherited from a patched base class: wrapping it again would run the hook twice
        setattr(runner_cls, name, _hook(name, current))
    setattr(runner_cls, _PATCHED, True)


@contextlib.contextmanager
def as_binding_runner(runner: Any) -> Iterator[None]:
    """Test helper: make ``runner`` the one ``binding_runner()`` returns."""
    token = _binding_runner.set(runner)
    try:
        yield
    finally:
        _binding_runner.reset(token)
