# SPDX-License-Identifier: Apache-2.0
"""Validation mode (``VLLM_ASCEND_ROUTING_VALIDATE=1`` or ``strict``): every returned array is checked.

Checks, per finished request, on the array the user receives (vLLM 0.21.0: its prompt and generated arrays
joined, on the decoder-layer axis, ``keep_whole_request``): row count = tokens - 1 - prompt_start;
in MoE layers every id in ``[0, num_experts)`` and no id twice in a row, and no MoE layer all zero
across the request; dense layers all zero. A violation is logged with request id, layer and row;
``strict`` raises ``RoutingValidationError`` instead. The rules and the MoE-layer reading are ``contract``'s,
the same the replay bridge (``vllm_ascend_routing.replay``) applies in the trainer.

Runs in the front-end process, where vLLM assembles ``CompletionOutput.routed_experts``: the engine's
``vllm_config`` is recorded when ``LLMEngine`` / ``AsyncLLM`` is created, the request's
``routed_experts_prompt_start`` when its state is created. Costs one vectorised pass per finished request.
A front-end whose engine was not created through those two classes leaves nothing to check against: the first
finished request with routed experts then raises ``ValidationUnavailableError`` instead of passing unchecked.
``checked_arrays()`` counts the arrays checked in this process (doctor and the e2e suite read it).
An array validation cannot place (a generation that returns rows on the MoE-layer axis, for a model whose config
names no MoE layers ``contract.moe_layers`` can read) is refused in ``strict`` mode (``ValidationUnavailableError``,
naming what to do) and, with ``1``, logged as an error and counted by ``unchecked_arrays()``: never passed silently.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_ascend_routing import contract, envs, patching
from vllm_ascend_routing._logging import get_logger
from vllm_ascend_routing.context import InstallContext
from vllm_ascend_routing.contract import Violation
from vllm_ascend_routing.patching import VALIDATION, Patch

logger = get_logger(__name__)

_PROMPT_START = "_vllm_ascend_routing_prompt_start"
# RequestState attribute a generation whose output splits a request's rows (vLLM 0.21.0: prompt / generated
# tokens, MoE-layer axis) sets for the final output: the whole request on the decoder-layer axis, or None.
_WHOLE_REQUEST = "_vllm_ascend_routing_whole_request"
_ABSENT = object()
_KEEP = "never while validation mode exists"
_ENGINE_WHY = "validation mode: remember the engine's model (experts, MoE layers)"
ENGINE_INITS = (
    Patch(
        "vllm.v1.engine.llm_engine:LLMEngine.__init__",
        _ENGINE_WHY,
        _KEEP,
        params=("self", "vllm_config"),
        feature=VALIDATION,
    ),
    Patch(
        "vllm.v1.engine.async_llm:AsyncLLM.__init__",
        _ENGINE_WHY,
        _KEEP,
        params=("self", "vllm_config"),
        feature=VALIDATION,
    ),
)
FROM_NEW_REQUEST = Patch(
    "vllm.v1.engine.output_processor:RequestState.from_new_request",
    "validation mode: remember the request's routed_experts_prompt_start",
    _KEEP,
    params=("tokenizer", "request"),
    feature=VALIDATION,
)
NEW_COMPLETION_OUTPUT = Patch(
    "vllm.v1.engine.output_processor:RequestState._new_completion_output",
    "validation mode (VLLM_ASCEND_ROUTING_VALIDATE): check each finished request's array",
    _KEEP,
    params=("self", "token_ids", "finish_reason"),
    feature=VALIDATION,
)
PATCHES = (*ENGINE_INITS, FROM_NEW_REQUEST, NEW_COMPLETION_OUTPUT)
NEEDS: tuple[str, ...] = ()  # every generation


class RoutingValidationError(RuntimeError):
    """A returned routed-experts array broke the contract (``VLLM_ASCEND_ROUTING_VALIDATE=strict``)."""


class ValidationUnavailableError(RuntimeError):
    """Validation mode is on but never saw the engine's model: it cannot check, and says so (any mode)."""


@dataclass(frozen=True)
class ModelRouting:
    """What a correct array looks like for one model."""

    num_experts: int
    num_layers: int
    moe_layers: frozenset[int] | None  # None: not derivable from the config, per-layer checks only
    zero_experts: int = 0  # ids [num_experts, num_experts + zero_experts) are zero experts (LongCat-Flash)

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> ModelRouting:
        model_config = vllm_config.model_config
        hf = model_config.hf_text_config
        num_layers = int(hf.num_hidden_layers)
        return cls(
            int(model_config.get_num_experts()), num_layers, moe_layer_ids(hf, num_layers), contract.zero_experts(hf)
        )


def moe_layer_ids(hf_config: Any, num_layers: int) -> frozenset[int] | None:
    """Which layers are MoE (``contract.moe_layers``, the replay bridge's reading); ``None`` if unknown."""
    try:
        return frozenset(contract.moe_layers(hf_config, num_layers))
    except contract.UnknownMoELayersError:
        return None


def check(
    routed: np.ndarray, *, request_id: str, expected_rows: int, model: ModelRouting, limit: int = 5
) -> list[Violation]:
    """Contract violations of one request's array (at most ``limit`` per kind): ``contract.check``'s rules."""
    found = contract.check(
        routed,
        num_experts=model.num_experts,
        moe_layers=model.moe_layers,
        num_layers=model.num_layers,
        expected_rows=expected_rows,
        limit=limit,
        zero_experts=model.zero_experts,
    )
    return [dataclasses.replace(violation, request_id=request_id) for violation in found]


def report(violations: list[Violation], strict: bool) -> None:
    if not violations:
        return
    for violation in violations:
        logger.error("vllm-ascend-routing validation: %s", violation)
    if strict:
        raise RoutingValidationError("; ".join(map(str, violations)))


def keep_whole_request(state: Any, moe_axis_rows: np.ndarray) -> None:
    """For a generation whose final output splits the request's rows over two arrays on the MoE-layer axis
    (vLLM 0.21.0): keep the whole request, on the decoder-layer axis, for the check of that output. Where the
    config names no MoE layers the arrays cannot be placed: ``strict`` refuses (``ValidationUnavailableError``),
    ``1`` logs an error and counts the request as unchecked (``unchecked_arrays``)."""
    mode = envs.VLLM_ASCEND_ROUTING_VALIDATE
    if mode == "off" or _model is None:
        return
    if _model.moe_layers is None:
        _cannot_place(str(getattr(state, "request_id", "?")), mode == "strict")
        setattr(state, _WHOLE_REQUEST, None)
        return
    whole = moe_axis_rows
    if moe_axis_rows.ndim == 3 and moe_axis_rows.shape[1] == len(_model.moe_layers):
        whole = contract.from_device_cache(moe_axis_rows, None, _model.moe_layers, _model.num_layers)
    # else checked as it is: the shape rule names the layer axis the config disagrees with
    setattr(state, _WHOLE_REQUEST, whole)


def _cannot_place(request_id: str, strict: bool) -> None:
    """A request whose rows are on the MoE-layer axis of a model whose MoE layers are unknown: refused (strict) or
    logged and counted unchecked."""
    global _unchecked
    text = (
        f"vllm-ascend-routing validation: request {request_id}'s rows come on the MoE-layer axis, and this model's "
        "config names no MoE layers the plugin can read (contract.moe_layers knows "
        f"{contract.KNOWN_FAMILIES}), so they cannot be placed on the decoder layers and checked."
    )
    if strict:
        raise ValidationUnavailableError(
            f"{text} Strict validation (VLLM_ASCEND_ROUTING_VALIDATE=strict) refuses what it cannot check: set "
            "VLLM_ASCEND_ROUTING_VALIDATE=1 to serve with such arrays logged and counted unchecked, or run a vLLM "
            "release whose arrays span every decoder layer, or report the model family so contract.moe_layers "
            "learns it."
        )
    with _COUNT_LOCK:
        _unchecked += 1
        count = _unchecked
    if count == 1 or count % UNCHECKED_LOG_EVERY == 0:
        logger.error("%s Not checked (%d arrays unchecked so far in this process).", text, count)


# ---- front-end hooks ----

_model: ModelRouting | None = None  # the engine created in this process (one model per front-end)
_checked = 0  # arrays checked in this process
_unchecked = 0  # arrays validation mode could not check (keep_whole_request), with VLLM_ASCEND_ROUTING_VALIDATE=1
_COUNT_LOCK = threading.Lock()  # front-ends of several engines (DP, tests) may finish requests at once
UNCHECKED_LOG_EVERY = 1000  # an unchecked array logs an error the first time, then every this many


def checked_arrays() -> int:
    """How many returned arrays validation mode has checked in this process (0 with it off)."""
    return _checked


def unchecked_arrays() -> int:
    """How many returned arrays validation mode could not check in this process (logged; strict refuses them)."""
    return _unchecked


def install(ctx: InstallContext | None = None) -> None:
    """Patch vLLM's front-end so finished requests are checked (idempotent; only when enabled)."""
    mode = envs.VLLM_ASCEND_ROUTING_VALIDATE
    if mode == "off":
        return
    for patch in ENGINE_INITS:
        patching.replace(patch, _recording_config)
    patching.replace(FROM_NEW_REQUEST, lambda method: classmethod(_recording_prompt_start(method.__func__)))
    patching.replace(NEW_COMPLETION_OUTPUT, lambda method: _validating(method, strict=mode == "strict"))
    logger.info("vllm-ascend-routing validation mode on (%s)", mode)


def rows_start(state: Any, start: int) -> None:
    """The request's rows start at token ``start``: the engine moved its first row (a per-request option, e.g.
    ``routed_experts_omit="cached"``, ``output.engine``); its array is checked against that start."""
    setattr(state, _PROMPT_START, int(start))


def _recording_config(init: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(init)
    def engine_init(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        global _model
        _model = ModelRouting.from_vllm_config(vllm_config)
        init(self, vllm_config, *args, **kwargs)

    return engine_init


def _recording_prompt_start(from_new_request: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(from_new_request)
    def wrapper(cls: type, *args: Any, **kwargs: Any) -> Any:
        state = from_new_request(cls, *args, **kwargs)
        request = kwargs.get("request", args[1] if len(args) > 1 else None)
        params = getattr(request, "sampling_params", None)
        setattr(state, _PROMPT_START, int(getattr(params, "routed_experts_prompt_start", None) or 0))
        return state

    return wrapper


def _validating(new_completion_output: Callable[..., Any], strict: bool) -> Callable[..., Any]:
    @functools.wraps(new_completion_output)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        global _checked
        output = new_completion_output(self, *args, **kwargs)
        routed = self.__dict__.pop(_WHOLE_REQUEST, _ABSENT)
        if routed is _ABSENT:
            routed = getattr(output, "routed_experts", None)
        if routed is None:
            return output
        model = _model
        if model is None:  # checking nothing while switched on would read as "every array passed"
            raise ValidationUnavailableError(
                f"vllm-ascend-routing validation mode is on (VLLM_ASCEND_ROUTING_VALIDATE="
                f"{envs.VLLM_ASCEND_ROUTING_VALIDATE}) but never saw this engine's model: it learns the expert "
                "count and MoE layers when vLLM's LLMEngine or AsyncLLM is created (validate.ENGINE_INITS), and "
                f"request {self.request_id} finished in a front-end built another way. Create the engine through "
                "LLM / LLMEngine / AsyncLLM, or set VLLM_ASCEND_ROUTING_VALIDATE=0 to run without validation."
            )
        num_tokens = int(self.prompt_len) + len(self.detokenizer.output_token_ids)
        expected = num_tokens - 1 - int(getattr(self, _PROMPT_START, 0))
        found = check(np.asarray(routed), request_id=str(self.request_id), expected_rows=expected, model=model)
        with _COUNT_LOCK:
            _checked += 1
        report(found, strict)
        return output

    return wrapper
