# SPDX-License-Identifier: Apache-2.0
"""Generation ``device-cache``: vLLM 0.21.0 only (vLLM PR #39917, reverted upstream in 0.22.0).

vLLM 0.21.0's user contract: the prompt's rows on ``RequestOutput.prompt_routed_experts`` and the generated
tokens' rows on ``CompletionOutput.routed_experts``, both int16 ``[rows, MoE layers, top_k]``, filled on the
final output only (``split_routed_experts``: prompt rows ``[:prompt_len]``, generated rows after them; the last
sampled token is never forwarded, so a request of ``p`` prompt and ``o`` output tokens gets ``p`` and ``o - 1``
rows). Its own transport loses rows in ordinary cases: the worker predicts which requests finish this step
(EOS, stop ids, lengths) and ships their whole array only then (a request ending on a stop string gets
nothing), drops preempted requests' rows, never fills prefix-cache hits, sizes the layer axis ignoring
``first_k_dense_replace``, and on the CPU build cannot start (pinned memory, ``torch.cuda.Stream``) and would
record nothing (the CPU MoE bypasses its copy). This adapter keeps that contract and replaces the transport:
  * the target model's MoE layers are bound at load to the plugin's static buffer, as in every generation;
    vLLM's own capturer is never created (its runner's ``init_routed_experts_capturer`` is replaced), so none
    of 0.21.0's per-step code runs;
  * after each forward the step's rows go into a host store indexed by KV slot (the attention group's
    slots, computed from each request's block table), the layer axis narrowed to the MoE layers;
  * each request that samples a token this step gets, in ``ModelRunnerOutput.routed_experts_dict``, the rows
    of its positions not shipped yet, read from that store by its block table: earlier prefill chunks,
    prefix-cache hits and positions recomputed after preemption included, rejected draft tokens excluded;
  * the front-end (``RequestState.make_request_output``) joins a request's chunks and hands the whole array
    to vLLM's own split on the final output, whatever ended the request (stop string and abort included).

On vllm-ascend 0.21.0rc1 (its NPU runner keeps vLLM 0.21.0's statements, gated on ``routed_experts_initialized``)
the same hooks serve its V1 runner; its MoE method's own capture (into vLLM's global capturer, at the decoder
layer id rather than vLLM's ``moe_layer_id``) finds vLLM's no-op there, and the ``ascend`` backend records every
quant method's ``select_experts``.

Layer axis: the ``j``-th MoE layer of the model in decoder order, ``len(moe layers)`` wide (DeepSeek/GLM:
``num_hidden_layers - first_k_dense_replace``), never the trailing all-zero columns vLLM 0.21.0 would add
(``contract.moe_layers`` names the decoder layers; ``replay.from_device_cache`` widens it back).

SCAFFOLDING: remove when the lowest supported vLLM is >= 0.22.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vllm_ascend_routing import patching, validate
from vllm_ascend_routing._logging import get_logger
from vllm_ascend_routing.capture import PreparedCapture
from vllm_ascend_routing.compat._runners import LOAD_MODEL, RUNNER_CLASSES
from vllm_ascend_routing.compat.interface import Adapter, Generation, RunnerClass, RunnerHook
from vllm_ascend_routing.patching import Patch
from vllm_ascend_routing.releases import CAPTURER_MODULE
from vllm_ascend_routing.runner_state import prepared_capture

logger = get_logger(__name__)

_DEVICE_CACHE = (Generation.DEVICE_CACHE,)
_REMOVE = "the lowest supported vLLM is 0.22.0 or newer"
ROW_DTYPE = np.int16  # vLLM 0.21.0's host cache dtype, the user's array

HOOKS: tuple[RunnerHook, ...] = (
    LOAD_MODEL,
    RunnerHook("initialize_kv_cache", ("self", "kv_cache_config"), "size the slot-indexed host store"),
    RunnerHook("execute_model", ("self", "scheduler_output"), "forget finished requests; copy the rows off"),
    RunnerHook("sample_tokens", ("self",), "ship each sampling request's new rows in routed_experts_dict"),
)
CAPTURER_INIT = Patch(
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.init_routed_experts_capturer",
    "vLLM 0.21.0's capturer is never created (pinned memory and a CUDA stream; its transport loses rows)",
    _REMOVE,
    _DEVICE_CACHE,
    ("self",),
)
MAKE_REQUEST_OUTPUT = Patch(
    "vllm.v1.engine.output_processor:RequestState.make_request_output",
    "front-end: join a request's per-step chunks, hand the whole array to vLLM's split on the final output",
    _REMOVE,
    _DEVICE_CACHE,
    ("self", "new_token_ids", "pooling_output", "finish_reason", "stop_reason", "kv_transfer_params",
     "routed_experts"),
)  # fmt: skip
OUTPUT_FIELD = Patch(
    "vllm.v1.outputs:ModelRunnerOutput.routed_experts_dict",
    "the per-request rows travel in vLLM 0.21.0's own output field",
    _REMOVE,
    _DEVICE_CACHE,
    action=patching.RELY,
)
GLOBAL_CAPTURER = Patch(
    f"{CAPTURER_MODULE}:get_global_experts_capturer",
    "stays vLLM's no-op (checked when vLLM would create it): vllm-ascend 0.21.0rc1's MoE method captures into it "
    "itself, at the decoder layer id (not vLLM's moe_layer_id)",
    _REMOVE,
    _DEVICE_CACHE,
    action=patching.RELY,
)
PATCHES = (CAPTURER_INIT, MAKE_REQUEST_OUTPUT, OUTPUT_FIELD, GLOBAL_CAPTURER)

_STATE = "_vllm_ascend_routing_device_cache"  # runner attribute: its _Transport
_CHUNKS = "_vllm_ascend_routing_chunks"  # front-end RequestState attribute: the chunks received


def _no_capturer(init: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(init)
    def init_routed_experts_capturer(self: Any) -> None:
        self.routed_experts_initialized = False  # vLLM's per-step capture code stays off
        if prepared_capture(self) is None:
            raise RuntimeError(
                "vllm-ascend-routing: the runner's load_model hook did not run, so routed-experts capture was "
                f"never bound ({type(self).__name__} is not supported on vLLM 0.21.0)."
            )
        # Code that captures into vLLM's process-wide capturer by itself (vllm-ascend 0.21.0rc1's MoE method, at
        # the decoder layer id) must find the no-op there, whose device cache is None.
        own = patching.resolve(GLOBAL_CAPTURER.target)()
        if own is not None and own.get_device_cache() is not None:
            raise RuntimeError(
                f"vllm-ascend-routing: vLLM 0.21.0's own capturer ({type(own).__name__}) was created in this process "
                "outside the plugin; its capture code would run beside the plugin's. Unset VLLM_ASCEND_ROUTING."
            )
        logger.info("routed experts: vLLM 0.21.0's capturer replaced by the plugin's transport")

    return init_routed_experts_capturer


def _joining(make_request_output: Callable[..., Any]) -> Callable[..., Any]:
    """Chunks are kept per request and joined on the final output (vLLM 0.21.0 splits what it is handed)."""

    @functools.wraps(make_request_output)
    def wrapper(self: Any, new_token_ids: Any, pooling_output: Any, finish_reason: Any, *args: Any,
                **kwargs: Any) -> Any:  # fmt: skip
        chunk = kwargs.pop("routed_experts", None)
        if len(args) > 2:  # (stop_reason, kv_transfer_params, routed_experts), as process_outputs passes them
            chunk, args = args[2], args[:2]
        if chunk is not None:
            chunks: list[np.ndarray] = self.__dict__.setdefault(_CHUNKS, [])
            chunks.append(chunk)
        whole = None
        if finish_reason is not None and self.__dict__.get(_CHUNKS):
            # The last chunk may hold rows of tokens the scheduler then dropped (a step that sampled past
            # max_tokens with accepted drafts): the request's rows end at its last token but one.
            rows = int(self.prompt_len) + len(self.detokenizer.output_token_ids) - 1 if self.detokenizer else None
            whole = np.concatenate(self.__dict__.pop(_CHUNKS), axis=0)[:rows]
            validate.keep_whole_request(self, whole)
        return make_request_output(self, new_token_ids, pooling_output, finish_reason, *args, routed_experts=whole,
                                   **kwargs)  # fmt: skip

    return wrapper


@dataclass
class _Transport:
    """One runner's slot-indexed host store and what each request has been sent."""

    store: np.ndarray  # [num_slots, num_moe_layers, top_k] ROW_DTYPE
    block_size: int
    group: int  # the KV cache group whose block table keys the slots (the first full-attention group)
    columns: np.ndarray  # the decoder-layer columns of the capture buffer that are MoE layers, ascending
    shipped: dict[str, int] = field(default_factory=dict)  # request id -> positions sent to the front-end
    host: torch.Tensor | None = None  # pinned staging of the buffer (accelerators); None on the CPU
    copied: Any = None  # device event recorded after the staging copy
    step: Any = None  # this step's scheduler output, until its rows are shipped

    def slots(self, block_ids: list[int], start: int, end: int) -> np.ndarray:
        positions = np.arange(start, end, dtype=np.int64)
        blocks = np.asarray(block_ids, dtype=np.int64)
        if end > len(blocks) * self.block_size:
            raise RuntimeError(
                f"vllm-ascend-routing: positions up to {end} but only {len(blocks)} KV blocks of "
                f"{self.block_size}; routed experts cannot be placed."
            )
        return blocks[positions // self.block_size] * self.block_size + positions % self.block_size


@dataclass(frozen=True)
class _Request:
    request_id: str
    start: int  # the step's first row in the buffer
    computed: int  # the request's positions computed before this step
    scheduled: int
    drafts: int
    block_ids: list[int]


def _attention_group(runner: Any, kv_cache_config: Any) -> int:
    """The first full-attention KV cache group, whose slots hold each token of a request once."""
    finder = getattr(runner, "_get_attention_kv_cache_gid", None)
    return int(finder()) if finder is not None else 0


def _block_size(kv_cache_config: Any, group: int) -> int:
    return int(kv_cache_config.kv_cache_groups[group].kv_cache_spec.block_size)


class DeviceCacheAdapter(Adapter):
    patches = PATCHES
    generation = Generation.DEVICE_CACHE
    narrowed_by_expert_count = False  # vLLM 0.21.0's arrays are int16 whatever the expert count
    runner_hooks: tuple[RunnerHook, ...] = HOOKS
    # vllm-ascend 0.21.0rc1's NPU runner (V1) overrides every hooked method and keeps vLLM 0.21.0's own statements,
    # each gated on ``routed_experts_initialized`` (left False: vLLM's capturer is never created).
    runner_classes: Mapping[str, tuple[RunnerClass, ...]] = RUNNER_CLASSES
    # The front-end joins the chunks: an engine without the plugin would return one step's rows as the array.
    rows_read_in_front_end = True

    def install(self) -> None:
        patching.replace(CAPTURER_INIT, _no_capturer)
        patching.replace(MAKE_REQUEST_OUTPUT, _joining)

    def install_ascend(self) -> None:
        """Nothing to patch in vllm-ascend 0.21.0rc1: its runner's own routed-experts statements are gated on
        ``routed_experts_initialized`` (False), and the capture its unquantized MoE method does itself (at the
        decoder layer id, not vLLM's ``moe_layer_id``) goes to vLLM's global capturer, which stays vLLM's no-op
        (``_no_capturer`` checks it); the ``ascend`` backend records every quant method instead."""

    def routing_shape(self, vllm_config: Any) -> tuple[int, int, int]:
        """``(num_hidden_layers, top_k, num_experts)`` of the capture buffer; the user's layer axis is
        narrowed to the bound (MoE) layers when rows leave the worker."""
        model_config = vllm_config.model_config
        return (
            int(model_config.get_total_num_hidden_layers()),
            int(model_config.hf_text_config.num_experts_per_tok),
            int(model_config.get_num_experts()),
        )

    def attach(self, runner: Any, prepared: PreparedCapture, capturer: Any) -> None:
        raise RuntimeError("vllm-ascend-routing: vLLM 0.21.0's capturer is never created under the plugin")

    def kv_cache_ready(self, runner: Any, prepared: PreparedCapture, kv_cache_config: Any, profiling: bool) -> None:
        if profiling or getattr(runner, _STATE, None) is not None:
            return
        group = _attention_group(runner, kv_cache_config)
        block_size = _block_size(kv_cache_config, group)
        columns = np.asarray(prepared.layer_ids, dtype=np.int64)
        num_slots = int(kv_cache_config.num_blocks) * block_size
        top_k = int(prepared.buffer.shape[2])
        store = np.zeros((num_slots, len(columns), top_k), dtype=ROW_DTYPE)  # pages committed as written
        host = None
        if prepared.buffer.device.type != "cpu":
            host = torch.empty(prepared.buffer.shape, dtype=prepared.buffer.dtype, pin_memory=True)
        setattr(runner, _STATE, _Transport(store, block_size, group, columns, host=host))
        logger.info(
            "routed experts (vLLM 0.21.0 contract): host store %s int16 by KV slot (group %d), %.1f MiB reserved",
            store.shape,
            group,
            store.nbytes / 2**20,
        )

    def step_started(self, runner: Any, prepared: PreparedCapture, scheduler_output: Any) -> None:
        transport: _Transport | None = getattr(runner, _STATE, None)
        if transport is None:
            return
        for request_id in scheduler_output.finished_req_ids:
            transport.shipped.pop(request_id, None)
        transport.step = scheduler_output

    def after_forward(self, runner: Any, prepared: PreparedCapture, num_tokens: int) -> None:
        """Accelerators: start the step's device-to-host copy now (joined by the step's own sync)."""
        transport: _Transport | None = getattr(runner, _STATE, None)
        if transport is None or transport.host is None or not num_tokens:
            return
        transport.host[:num_tokens].copy_(prepared.buffer[:num_tokens], non_blocking=True)
        module = getattr(torch, prepared.buffer.device.type)
        transport.copied = module.Event()
        transport.copied.record()

    def sample(self, runner: Any, prepared: PreparedCapture, sample_tokens: Callable[[], Any]) -> Any:
        transport: _Transport | None = getattr(runner, _STATE, None)
        if transport is None:
            return sample_tokens()
        batch = _step_requests(runner, transport)
        output = sample_tokens()
        if not batch or output is None:
            return output
        if not hasattr(output, "routed_experts_dict"):  # an async output: vLLM 0.21.0 refuses the combination
            raise RuntimeError(
                f"vllm-ascend-routing: the runner returned {type(output).__name__}, which has no routed_experts_dict "
                "(vLLM 0.21.0 returns routed experts without async scheduling only); unset VLLM_ASCEND_ROUTING."
            )
        num_tokens = batch[-1].start + batch[-1].scheduled
        if transport.host is None:
            rows = prepared.buffer[:num_tokens].numpy()
        else:
            if transport.copied is not None:
                transport.copied.synchronize()  # complete already: the step synchronised on sampled tokens
            rows = transport.host[:num_tokens].numpy()
        rows = rows[:, transport.columns]
        index = {request_id: i for i, request_id in enumerate(output.req_ids)}
        shipped: dict[str, np.ndarray] = {}
        for request in batch:
            sampled = len(output.sampled_token_ids[index[request.request_id]]) if request.request_id in index else 0
            valid = request.scheduled - (request.drafts - (sampled - 1) if sampled else 0)
            if valid > 0:
                slots = transport.slots(request.block_ids, request.computed, request.computed + valid)
                transport.store[slots] = rows[request.start : request.start + valid]
            if sampled:
                end = request.computed + valid
                sent = transport.shipped.get(request.request_id, 0)
                if end > sent:
                    shipped[request.request_id] = transport.store[transport.slots(request.block_ids, sent, end)]
                    transport.shipped[request.request_id] = end
        output.routed_experts_dict = shipped or None
        return output


def _step_requests(runner: Any, transport: _Transport) -> list[_Request]:
    """The step's requests in token order, read before sampling (the runner reuses these arrays)."""
    scheduler_output, transport.step = transport.step, None
    if scheduler_output is None or not scheduler_output.total_num_scheduled_tokens:
        return []
    drafts = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
    requests: list[_Request] = []
    start = 0
    for i, request_id in enumerate(runner.input_batch.req_ids):
        scheduled = int(scheduler_output.num_scheduled_tokens.get(request_id, 0))
        computed = int(runner.input_batch.num_computed_tokens_cpu[i])
        block_ids = list(runner.requests[request_id].block_ids[transport.group])
        requests.append(_Request(request_id, start, computed, scheduled, len(drafts.get(request_id, ())), block_ids))
        start += scheduled
    return requests
