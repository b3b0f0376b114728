# SPDX-License-Identifier: Apache-2.0
"""What the runner hooks leave on a model runner, readable by every generation adapter.

A leaf module: the hooks (``runner_mixin``) write this state and the adapters read it, without either
importing the other.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_ascend_routing.capture import PreparedCapture

_PREPARED = "_vllm_ascend_routing_capture"  # runner attribute: (model, PreparedCapture | None)
# Every capture prepared in this process (doctor's self-check runs its engine in-process and reads them).
_CAPTURES: weakref.WeakSet[PreparedCapture] = weakref.WeakSet()

# The runner creating its capturer or connector, for vLLM releases whose binder is a module-level function
# that is not given the runner (0.28+).
_binding_runner: contextvars.ContextVar[Any] = contextvars.ContextVar("binding_runner", default=None)


def prepared_capture(runner: Any) -> PreparedCapture | None:
    """The capture the runner's ``load_model`` hook prepared, or ``None`` (capture off, or not loaded)."""
    _, prepared = getattr(runner, _PREPARED, (None, None))
    return prepared


def has_prepared(runner: Any) -> bool:
    """Whether ``load_model``'s hook already ran for the runner's current model (capture on or off)."""
    model, _ = getattr(runner, _PREPARED, (None, None))
    return model is not None and model is getattr(runner, "model", None)


def set_prepared(runner: Any, prepared: PreparedCapture | None) -> None:
    setattr(runner, _PREPARED, (runner.model, prepared))
    if prepared is not None:
        with contextlib.suppress(TypeError):  # a test double that cannot be weakly referenced
            _CAPTURES.add(prepared)


def captures_in_process() -> list[PreparedCapture]:
    """The captures prepared by runners of this process (empty where the workers are other processes)."""
    return list(_CAPTURES)


def binding_runner() -> Any:
    """The runner currently creating its capturer (or, 0.31+, its connector), or ``None``."""
    return _binding_runner.get()


@contextlib.contextmanager
def as_binding_runner(runner: Any) -> Iterator[None]:
    """Make ``runner`` the one ``binding_runner()`` returns while vLLM creates its capturer."""
    token = _binding_runner.set(runner)
    try:
        yield
    finally:
        _binding_runner.reset(token)
