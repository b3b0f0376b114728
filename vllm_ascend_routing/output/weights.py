# SPDX-License-Identifier: Apache-2.0
"""The weight version, counted in the worker: how many times the target model's weights were loaded or updated.

Every RL framework's weight sync ends in the model's own ``load_weights`` in the worker (verl, NeMo RL, SkyRL and
prime-rl through ``collective_rpc`` or a worker extension, vLLM's ``reload_weights``, a colocated trainer calling it
directly). The runner hook wraps that method on the loaded model: the version is 1 for the weights loaded at
start-up (any load format) and grows by one with each completed call (a framework that loads one sync in N
buckets moves it by N). Each step's ``ModelRunnerOutput`` carries the version its forward ran with (an attribute
set on the host when the worker returns it: no device work), which the scheduler reads (``output.engine``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

from vllm_ascend_routing import patching
from vllm_ascend_routing.context import InstallContext
from vllm_ascend_routing.patching import Patch

VERSION = "_vllm_ascend_routing_weight_version"  # on the runner (its model's count) and on each step's output
_STEP = "_vllm_ascend_routing_step_weight_version"  # on the worker: the version of the step being executed
_NEEDS = "per_request_output"  # the scheduler reads the version where it sends records per request
_WHY = "stamp each step's ModelRunnerOutput with the weight version its forward ran with"
_KEEP = "never while routed_experts_info reports weight versions"
EXECUTE_MODEL = Patch(
    "vllm.v1.worker.gpu_worker:Worker.execute_model", _WHY, _KEEP, params=("self", "scheduler_output"), needs=_NEEDS
)
SAMPLE_TOKENS = Patch("vllm.v1.worker.gpu_worker:Worker.sample_tokens", _WHY, _KEEP, params=("self",), needs=_NEEDS)
PATCHES = (EXECUTE_MODEL, SAMPLE_TOKENS)
NEEDS = (_NEEDS,)


def install(ctx: InstallContext | None = None) -> None:
    """Stamp every step's output (idempotent). The CPU worker inherits both methods."""
    patching.replace(EXECUTE_MODEL, _executing)
    patching.replace(SAMPLE_TOKENS, _sampling)


def track(runner: Any) -> None:
    """Count ``load_weights`` calls on ``runner``'s target model from now on (version 1: the weights just loaded)."""
    get_model = getattr(runner, "get_model", None)
    model = get_model() if callable(get_model) else runner.model
    setattr(runner, VERSION, 1)

    def counting(load_weights: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(load_weights)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            result = load_weights(*args, **kwargs)
            setattr(runner, VERSION, getattr(runner, VERSION, 1) + 1)  # counted once the weights are in place
            return result

        return wrapper

    patching.wrap(model, "load_weights", counting, rebind=True)


def current(runner: Any) -> int | None:
    """The weight version of ``runner``'s model, or ``None`` where it is not tracked (routed experts off)."""
    version = getattr(runner, VERSION, None)
    return None if version is None else int(version)


def stamp(output: Any, version: int | None) -> Any:
    """Put ``version`` on a step's output (on the one an asynchronous output resolves to, when it does)."""
    if output is None or version is None:
        return output
    get_output = getattr(output, "get_output", None)
    if callable(get_output):  # AsyncModelRunnerOutput: the ModelRunnerOutput exists once the copy finished

        def resolved(get: Callable[[], Any]) -> Callable[[], Any]:
            def get_stamped() -> Any:
                return stamp(get(), version)

            return get_stamped

        patching.wrap(output, "get_output", resolved)
        return output
    with contextlib.suppress(AttributeError):  # an output type that takes no attributes: its version is unknown
        setattr(output, VERSION, version)
    return output


def _executing(execute_model: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(execute_model)
    def wrapper(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        version = current(getattr(self, "model_runner", None))
        setattr(self, _STEP, version)
        return stamp(execute_model(self, scheduler_output, *args, **kwargs), version)

    return wrapper


def _sampling(sample_tokens: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(sample_tokens)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        return stamp(sample_tokens(self, *args, **kwargs), getattr(self, _STEP, None))

    return wrapper
