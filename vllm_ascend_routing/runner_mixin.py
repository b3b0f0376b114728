# SPDX-License-Identifier: Apache-2.0
"""``RoutingCaptureRunnerMixin``: the model-runner hooks, written once for every vLLM generation.

The hooks call only ``compat.get_api()``; what a generation needs beyond them lives in its adapter.
``apply_mixin`` installs the hooks on a runner class that vLLM (or vllm-ascend) instantiates itself.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

from vllm_ascend_routing.compat import get_api

_PATCHED = "_vllm_ascend_routing_patched"
_ORIGINAL = "_vllm_ascend_routing_original_"

# The runner whose init_routed_experts_capturer() is running, for vLLM releases (0.28+) whose runner
# binds through a module-level function that is not given the runner.
_binding_runner: contextvars.ContextVar[Any] = contextvars.ContextVar("binding_runner", default=None)


def binding_runner() -> Any:
    """The runner currently creating its capturer, or ``None``."""
    return _binding_runner.get()


class RoutingCaptureRunnerMixin:
    """Model-runner hooks: create capture through vLLM's own path, bind it through ours."""

    model: Any
    vllm_config: Any

    def init_routed_experts_capturer(self) -> None:
        """vLLM's own initialisation (capturer, pinned buffers, slot mapping), with our binding."""
        token = _binding_runner.set(self)
        try:
            getattr(self, _ORIGINAL + "init_routed_experts_capturer")()
        finally:
            _binding_runner.reset(token)

    def _bind_routed_experts_capturer(self, capturer: Any) -> None:
        """Bind the target model's MoE layers (never draft/MTP layers) to ``capturer``."""
        get_api().bind(self.model, capturer, self.vllm_config)


def apply_mixin(runner_cls: type) -> None:
    """Install the mixin's hooks on ``runner_cls`` (idempotent); the originals stay reachable."""
    if runner_cls.__dict__.get(_PATCHED):
        return
    for name in ("init_routed_experts_capturer", "_bind_routed_experts_capturer"):
        original = getattr(runner_cls, name, None)
        if original is not None:
            setattr(runner_cls, _ORIGINAL + name, original)
        setattr(runner_cls, name, RoutingCaptureRunnerMixin.__dict__[name])
    setattr(runner_cls, _PATCHED, True)


@contextlib.contextmanager
def as_binding_runner(runner: Any) -> Iterator[None]:
    """Test helper: make ``runner`` the one ``binding_runner()`` returns."""
    token = _binding_runner.set(runner)
    try:
        yield
    finally:
        _binding_runner.reset(token)
