# SPDX-License-Identifier: Apache-2.0
"""Generation ``aux-output``: vLLM 0.31+ (vLLM PR #45635, the AuxOutput connector).

vLLM's worker-side ``AuxOutputWorkerConnector`` owns the data plane (a capturer whose ``device_buffer`` it
snapshots each step, per-block R3 objects keyed by KV block hash, prefix-hit materialisation); the
scheduler-side connector turns its per-step ``ModelRunnerOutput.aux_output_connector_output`` into the
user's chunks (uint8/uint16 ``[num_tokens - 1 - prompt_start, num_hidden_layers, top_k]``). Upstream wires
it into Model Runner V2 only. This adapter:
  * binds the target model's MoE layers at load (before vLLM compiles) to the plugin's static buffer, as
    every generation does, and makes vLLM's binder (as the connector's worker imports it) hand that
    buffer to the connector's capturer instead of binding routers itself;
  * on Model Runner V2 leaves the connector's driving to vLLM;
  * on runners without connector code (vLLM's V1 runner, which the CPU runner and vllm-ascend's NPU
    runner build on) drives it the way Model Runner V2 does: ``begin_step`` before the batch is updated,
    ``prepare_output`` after the forward, ``enqueue_cpu_copy`` / ``process_output`` once the step's
    sampled counts are known, then sets ``aux_output_connector_output``;
  * on the CPU lets vLLM's config check accept that V1 runner (it accepts any runner on out-of-tree
    platforms such as Ascend, which "validate AuxOutput support themselves"): ``config_check``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from vllm_ascend_routing import patching
from vllm_ascend_routing._logging import get_logger
from vllm_ascend_routing.capture import PreparedCapture
from vllm_ascend_routing.compat._common import attach_buffer
from vllm_ascend_routing.compat._runners import LOAD_MODEL, RUNNER_CLASSES
from vllm_ascend_routing.compat.aux_output import config_check, requests
from vllm_ascend_routing.compat.aux_output import kv_rows as block_rows
from vllm_ascend_routing.compat.interface import (
    Adapter,
    Generation,
    RequestSelection,
    RunnerClass,
    RunnerHook,
    UnsupportedVllmError,
)
from vllm_ascend_routing.patching import RELY, Patch
from vllm_ascend_routing.releases import BINDER_FUNCTION
from vllm_ascend_routing.runner_state import as_binding_runner, binding_runner, prepared_capture

logger = get_logger(__name__)

_AUX = (Generation.AUX_OUTPUT,)
# The hooks drive vLLM's AuxOutput connector on runners without connector code of their own.
CONNECTOR_HOOKS: tuple[RunnerHook, ...] = (
    LOAD_MODEL,
    RunnerHook(
        "initialize_kv_cache",
        ("self", "kv_cache_config"),
        "create vLLM's AuxOutput worker connector (Model Runner V2 binds in here)",
    ),
    RunnerHook("execute_model", ("self", "scheduler_output"), "connector.begin_step before the batch is updated"),
    RunnerHook("sample_tokens", ("self",), "prepare_output / process_output around sampling; set the output field"),
)
_WORKER = "vllm.distributed.aux_output_connector.worker"
BINDER = Patch(
    f"{_WORKER}:{BINDER_FUNCTION}",
    "the connector's capturer is handed the buffer bound at load (vLLM would bind after compiling)",
    "vLLM binds before its first compile on every platform",
    _AUX,
    ("model", "capturer"),
)
CONNECTOR = Patch(
    f"{_WORKER}:AuxOutputWorkerConnector",
    "created by the runner hooks on runners without connector code (not replaced)",
    "vLLM's V1 runner drives the connector itself",
    _AUX,
    ("vllm_config", "model", "kv_cache_config"),
    action=RELY,
)
PATCHES = (BINDER, CONNECTOR, *config_check.PATCHES)
_DRIVER = "_vllm_ascend_routing_aux_driver"  # runner attribute: the connector this plugin drives


def _attach_prepared_buffer(model: torch.nn.Module, capturer: Any) -> None:
    """Stands in for vLLM's binder inside the connector: the capturer gets the buffer bound at load."""
    runner = binding_runner()
    prepared = prepared_capture(runner) if runner is not None else None
    if prepared is None or runner.model is not model:
        raise RuntimeError(
            "vllm-ascend-routing: vLLM's AuxOutput connector was created outside a patched model runner's "
            "initialize_kv_cache(); this runner class is not supported."
        )
    attach_buffer(prepared, capturer)  # snapshot_routing_data narrows it to uint8/uint16


@dataclass
class _Driver:
    """The connector this plugin drives for one runner, and the step it is in."""

    connector: Any
    scheduler_output: Any = None


def connector_class() -> Any:
    """vLLM's ``AuxOutputWorkerConnector``, created on runners that have no connector code."""
    return patching.resolve(CONNECTOR.target)


class AuxOutputAdapter(Adapter):
    generation = Generation.AUX_OUTPUT
    # Its own rows, the per-request options' (required on every engine), the KV store's (optional until a connector)
    patches = (*PATCHES, *requests.PATCHES, *block_rows.PATCHES)
    per_request_output = True  # rows start at routed_experts_prompt_start, sent per request through the engine core
    runner_hooks: tuple[RunnerHook, ...] = CONNECTOR_HOOKS
    runner_classes: Mapping[str, tuple[RunnerClass, ...]] = RUNNER_CLASSES
    rows_read_in_front_end = False  # rows travel through vLLM's AuxOutput connector
    narrowed_by_expert_count = True  # vLLM returns the array as uint8 where the routed experts fit it
    kv_rows = block_rows.AuxRows()  # rows of tokens a KV connector loaded: in the connector's block store (``kv``)

    def routed_experts_requested(self, vllm_config: Any) -> bool:
        return bool(vllm_config.aux_output_config.enable_return_routed_experts)

    def install(self) -> None:
        patching.replace(BINDER, lambda _: _attach_prepared_buffer)
        config_check.install()

    def install_request_options(self, selection: RequestSelection) -> None:
        requests.install(selection)  # per-request options on the connector's scheduler side

    def install_ascend(self) -> None:
        """Nothing beyond the runner hooks: Ascend is out-of-tree, so vLLM's check already lets its runner
        serve the connector, which the hooks then drive."""

    def routing_shape(self, vllm_config: Any) -> tuple[int, int, int]:
        """``(num_hidden_layers, top_k, num_experts)`` exactly as the connector's capturer sizes them."""
        model_config = vllm_config.model_config
        return (
            int(model_config.get_total_num_hidden_layers()),
            int(model_config.get_num_experts_per_tok()),
            int(model_config.get_num_experts()),
        )

    def attach(self, runner: Any, prepared: PreparedCapture, capturer: Any) -> None:
        attach_buffer(prepared, capturer)  # snapshot_routing_data narrows it to uint8/uint16

    def after_forward(self, runner: Any, prepared: PreparedCapture, num_tokens: int) -> None:
        """Nothing: the connector snapshots the buffer when the step's output is prepared."""

    # ---- driving the connector from a runner that has no connector code (V1: CPU, Ascend) ----

    def kv_cache_ready(self, runner: Any, prepared: PreparedCapture, kv_cache_config: Any, profiling: bool) -> None:
        if profiling or hasattr(runner, "aux_output_connector") or getattr(runner, _DRIVER, None) is not None:
            return  # Model Runner V2 drives vLLM's own connector; a nested super() call was already served
        config = runner.vllm_config
        if getattr(config.scheduler_config, "async_scheduling", False):
            raise UnsupportedVllmError(
                "vllm-ascend-routing: async scheduling with routed experts on this runner is not supported; "
                "pass --no-async-scheduling or unset VLLM_ASCEND_ROUTING."
            )
        with as_binding_runner(runner):
            connector = connector_class()(vllm_config=config, model=runner.model, kv_cache_config=kv_cache_config)
        setattr(runner, _DRIVER, _Driver(connector))
        logger.info("routed experts: driving vLLM's AuxOutput connector from %s", type(runner).__name__)

    def step_started(self, runner: Any, prepared: PreparedCapture, scheduler_output: Any) -> None:
        driver: _Driver | None = getattr(runner, _DRIVER, None)
        if driver is None:
            return
        # Before the runner updates its batch and before its zero-token early return: finished requests
        # and new block hashes reach the connector every step.
        driver.connector.begin_step(scheduler_output.aux_output_connector_metadata)
        driver.scheduler_output = scheduler_output

    def sample(self, runner: Any, prepared: PreparedCapture, sample_tokens: Callable[[], Any]) -> Any:
        driver: _Driver | None = getattr(runner, _DRIVER, None)
        scheduler_output = None if driver is None else driver.scheduler_output
        if driver is None or scheduler_output is None or not scheduler_output.total_num_scheduled_tokens:
            return sample_tokens()
        driver.scheduler_output = None
        pending = driver.connector.prepare_output(_step_batch(runner, scheduler_output))
        output = sample_tokens()
        if pending is None:  # not the first TP rank: that rank's output is the one returned
            return output
        index = {request_id: i for i, request_id in enumerate(output.req_ids)}
        sampled = np.array([len(output.sampled_token_ids[index[r]]) for r in pending.request_ids], dtype=np.int64)
        drafts = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
        pending.enqueue_cpu_copy(sampled, rejected_drafts(pending.request_ids, sampled, drafts))
        output.aux_output_connector_output = pending.process_output()
        return output


def rejected_drafts(request_ids: list[str], sampled: np.ndarray, drafts: dict[str, list[int]]) -> np.ndarray:
    """Per request, the draft tokens of this step the rejection sampler threw away, as Model Runner V2
    counts them (``num_logits - num_sampled``): the connector drops that suffix of the step's rows, which
    were captured before acceptance. A request that sampled ``n > 0`` tokens accepted ``n - 1`` drafts
    (the last one is the bonus or corrected token); one that sampled none (a prefill chunk) had none."""
    rejected = np.zeros(len(request_ids), dtype=np.int64)
    for i, (request_id, num_sampled) in enumerate(zip(request_ids, sampled, strict=True)):
        scheduled = len(drafts.get(request_id, ()))
        if num_sampled > 0:
            if num_sampled - 1 > scheduled:
                raise RuntimeError(
                    f"vllm-ascend-routing: request {request_id} sampled {num_sampled} tokens with only "
                    f"{scheduled} drafts scheduled; routed experts cannot be placed."
                )
            rejected[i] = scheduled - (num_sampled - 1)
    return rejected


def _step_batch(runner: Any, scheduler_output: Any) -> SimpleNamespace:
    """The three batch fields the connector reads, as Model Runner V2 defines them, copied (the runner
    reuses its arrays next step): request ids in token order, the step's query start offsets, and each
    request's computed tokens before this step."""
    request_ids = list(runner.input_batch.req_ids)
    scheduled = np.array([scheduler_output.num_scheduled_tokens[r] for r in request_ids], dtype=np.int32)
    query_start_loc = np.zeros(len(request_ids) + 1, dtype=np.int32)
    np.cumsum(scheduled, out=query_start_loc[1:])
    computed = np.array(runner.input_batch.num_computed_tokens_cpu[: len(request_ids)], dtype=np.int32)
    return SimpleNamespace(req_ids=request_ids, query_start_loc_np=query_start_loc, num_computed_tokens_np=computed)
