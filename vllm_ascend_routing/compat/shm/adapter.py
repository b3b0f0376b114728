# SPDX-License-Identifier: Apache-2.0
"""Generation ``shm``: vLLM 0.20.0-0.20.2 (vLLM PRs #28284 + #33013), process-wide singletons.

vLLM's runner calls ``RoutedExpertsCapturer.create()`` / ``init_buffer(...)`` / ``clear_buffer()`` (every
step) / ``save_captured_experts(indices=slot_mapping)`` (after sampling), and the scheduler calls
``RoutedExpertsReader.create()`` / ``attach_buffer(...)`` / ``get_routed_experts(indices)`` when a request
stops. This adapter substitutes both classes, by name, in the two modules that use them, with
implementations of the same interface that:
  * record through the load-time binding (``_common.bind_target_model``): target-model layers only,
    every backend (the CPU MoE included), exact under ``torch.compile``;
  * keep rows in a narrow shared-memory store (``shm.store``) and widen to int32 only when returned, so
    the user-visible contract of 0.20.x is unchanged: int32 ``[num_tokens - 1, num_hidden_layers, top_k]``;
  * move rows off an accelerator with a non-blocking copy started right after the forward, finished by
    the step's own sampled-token synchronisation (CPU: no copy at all).

SCAFFOLDING: remove when the lowest supported vLLM is >= 0.22.
"""

from __future__ import annotations

import atexit
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from vllm_ascend_routing import contract, patching
from vllm_ascend_routing._logging import get_logger
from vllm_ascend_routing.capture import PreparedCapture
from vllm_ascend_routing.compat._common import misplaced_slot_group
from vllm_ascend_routing.compat._runners import CAPTURER_HOOKS, RUNNER_CLASSES
from vllm_ascend_routing.compat.interface import (
    Adapter,
    Generation,
    RunnerClass,
    RunnerHook,
    UnsupportedVllmError,
)
from vllm_ascend_routing.compat.shm.store import SegmentReader, SegmentSpec, SegmentWriter
from vllm_ascend_routing.patching import Patch

logger = get_logger(__name__)

_SHM = (Generation.SHM,)
_REMOVE = "the lowest supported vLLM is 0.22.0 or newer"
# Where vLLM 0.20.x imported the two classes: they are replaced there, by name.
CAPTURER = Patch(
    "vllm.v1.worker.gpu_model_runner:RoutedExpertsCapturer",
    "substituted by the narrow shared-memory capturer (same call sites)",
    _REMOVE,
    _SHM,
)
READER = Patch(
    "vllm.v1.core.sched.scheduler:RoutedExpertsReader",
    "substituted by the narrow shared-memory reader (same call sites)",
    _REMOVE,
    _SHM,
)
# vllm-ascend 0.20.2rc1: its NPU runner calls the capturer by its own imported name (clear/save), and its
# unquantized MoE method captures through the singleton; the plugin records every method itself.
ASCEND_CAPTURER = Patch(
    "vllm_ascend.worker.model_runner_v1:RoutedExpertsCapturer",
    "the NPU runner's clear/save call sites reach the narrow shared-memory capturer",
    _REMOVE,
    _SHM,
    platform="npu",
    releases="vllm-ascend 0.20.2rc1 (vLLM 0.20.2)",
)
ASCEND_MOE_CAPTURER = Patch(
    "vllm_ascend.ops.fused_moe.fused_moe:RoutedExpertsCapturer",
    "vllm-ascend's own capture (unquantized method only) is turned off: the plugin records every method",
    _REMOVE,
    _SHM,
    platform="npu",
    releases="vllm-ascend 0.20.2rc1 (vLLM 0.20.2)",
)
PATCHES = (CAPTURER, READER, ASCEND_CAPTURER, ASCEND_MOE_CAPTURER)


def _routing_shape(vllm_config: Any) -> tuple[int, int, int]:
    """``(num_hidden_layers, top_k, num_experts)`` as 0.20.x sizes its buffers."""
    model_config = vllm_config.model_config
    hf_config = model_config.hf_text_config
    return int(hf_config.num_hidden_layers), int(hf_config.num_experts_per_tok), int(model_config.get_num_experts())


def _spec(vllm_config: Any, max_num_kv_tokens: int) -> SegmentSpec:
    num_layers, top_k, num_experts = _routing_shape(vllm_config)
    zero_experts = contract.zero_experts(vllm_config.model_config.hf_text_config)
    return SegmentSpec.for_engine(
        str(vllm_config.instance_id),
        int(vllm_config.parallel_config.data_parallel_rank),
        (int(max_num_kv_tokens), num_layers, top_k),
        num_experts + zero_experts,  # the store's dtype holds zero experts' ids too
    )


class _ProcessSingleton:
    """0.20.x's ``create()`` / ``get_instance()`` contract: one per process, cleaned up at exit."""

    _instance: Any = None

    @classmethod
    def create(cls) -> Any:
        if cls._instance is not None:
            raise RuntimeError(f"{cls.__name__} already created.")
        cls._instance = cls()
        atexit.register(cls._instance.cleanup)
        return cls._instance

    @classmethod
    def get_instance(cls) -> Any:
        return cls._instance

    def cleanup(self) -> None:
        raise NotImplementedError


class ShmRoutedExpertsCapturer(_ProcessSingleton):
    """Worker side; stands in for 0.20.x ``RoutedExpertsCapturer`` (same call sites)."""

    _instance: ShmRoutedExpertsCapturer | None = None

    def __init__(self) -> None:
        self.device_buffer: torch.Tensor | None = None
        self._writer: SegmentWriter | None = None
        self._host: torch.Tensor | None = None  # pinned staging on accelerators; None on the CPU
        self._copied: Any = None  # device event recorded after the staging copy
        self._staged = 0  # rows the last stage() copied: the step's scheduled tokens

    def init_buffer(self, max_num_batched_tokens: int, max_num_kv_tokens: int, vllm_config: Any) -> None:
        from vllm.distributed import get_tensor_model_parallel_rank

        if get_tensor_model_parallel_rank() != 0:
            return  # every TP rank sees the same routing; rank 0 publishes it
        spec = _spec(vllm_config, max_num_kv_tokens)
        self._writer = SegmentWriter(spec)
        logger.info(
            "routed-experts shared memory %s: %s %s, %.1f MiB (%.2fx vLLM's int32 layout)",
            self._writer.name,
            spec.shape,
            spec.dtype,
            spec.nbytes / 2**20,
            spec.nbytes / spec.upstream_nbytes,
        )

    def attach_device_buffer(self, buffer: torch.Tensor) -> None:
        self.device_buffer = buffer
        if buffer.device.type != "cpu":
            self._host = torch.empty(buffer.shape, dtype=buffer.dtype, pin_memory=True)

    def capture(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        raise RuntimeError("vllm-ascend-routing binds MoE layers itself; RoutedExpertsCapturer.capture is unused")

    def clear_buffer(self) -> None:
        if self.device_buffer is not None:
            self.device_buffer.zero_()

    def stage(self, num_tokens: int) -> None:
        """Start the device-to-host copy of this step's rows (accelerators only; no synchronisation)."""
        if self._host is None or self.device_buffer is None or self._writer is None:
            return
        self._host[:num_tokens].copy_(self.device_buffer[:num_tokens], non_blocking=True)
        # The device's own event type (torch.npu.Event on Ascend, never a torch.cuda alias).
        module = getattr(torch, self.device_buffer.device.type)
        self._copied = module.Event()
        self._copied.record()
        self._staged = num_tokens

    def save_captured_experts(self, indices: np.ndarray) -> None:
        if self._writer is None or self.device_buffer is None:
            return
        slots = np.asarray(indices)
        if self._host is None:
            rows = self.device_buffer[: len(slots)].numpy()
        else:
            # vllm-ascend passes its padded slot mapping (tail -1): only the staged rows are real.
            slots = slots[: self._staged]
            if self._copied is not None:
                self._copied.synchronize()  # already complete: the step synchronised on sampled tokens
            rows = self._host[: len(slots)].numpy()
        self._writer.write(slots, rows)

    def cleanup(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class ShmRoutedExpertsReader(_ProcessSingleton):
    """Scheduler side; stands in for 0.20.x ``RoutedExpertsReader`` (same call sites)."""

    _instance: ShmRoutedExpertsReader | None = None

    def __init__(self) -> None:
        self._reader: SegmentReader | None = None

    def attach_buffer(self, max_num_kv_tokens: int, vllm_config: Any) -> None:
        self._reader = SegmentReader(_spec(vllm_config, max_num_kv_tokens))

    def get_routed_experts(self, indices: np.ndarray) -> np.ndarray:
        """int32 ``[len(indices), num_hidden_layers, top_k]`` (0.20.x's contract)."""
        if self._reader is None:
            raise RuntimeError("Buffer not attached. Call attach_buffer() first.")
        return self._reader.read(np.asarray(indices))

    def cleanup(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None


class _CaptureOff:
    """What vllm-ascend's MoE method sees as ``RoutedExpertsCapturer``: no instance, so it skips its own
    (unquantized-only) capture; the plugin's ``ascend`` backend records every quant method instead."""

    @staticmethod
    def get_instance() -> None:
        return None


def refuse_misplaced_slots(runner: Any) -> None:
    """vLLM 0.20.x copies the slot snapshot to the host inside the runner's own step, so it cannot be re-taken
    (runner-output does): refuse a runner that would ship another KV group's slots."""
    gid = misplaced_slot_group(runner)
    if gid is not None:
        raise UnsupportedVllmError(
            f"vllm-ascend-routing: vllm-ascend's V1 runner keys routed-experts rows by KV cache group 0's slots, "
            f"but this hybrid model's attention is group {gid}: rows would be filed under the wrong tokens. "
            "Upgrade to vllm-ascend 0.23.0 or newer (the plugin corrects it there) or unset VLLM_ASCEND_ROUTING."
        )


class ShmAdapter(Adapter):
    patches = PATCHES
    generation = Generation.SHM
    runner_hooks: tuple[RunnerHook, ...] = CAPTURER_HOOKS
    runner_classes: Mapping[str, tuple[RunnerClass, ...]] = RUNNER_CLASSES
    rows_read_in_front_end = True  # the front-end reads the plugin's shared-memory store
    narrowed_by_expert_count = False  # the plugin's own store, sized for every id (zero experts' too)
    routing_shape = staticmethod(_routing_shape)

    def install(self) -> None:
        patching.replace(CAPTURER, lambda _: ShmRoutedExpertsCapturer)
        patching.replace(READER, lambda _: ShmRoutedExpertsReader)

    def install_ascend(self) -> None:
        patching.replace(ASCEND_CAPTURER, lambda _: ShmRoutedExpertsCapturer)
        patching.replace(ASCEND_MOE_CAPTURER, lambda _: _CaptureOff)

    def attach(self, runner: Any, prepared: PreparedCapture, capturer: Any) -> None:
        refuse_misplaced_slots(runner)
        if not isinstance(capturer, ShmRoutedExpertsCapturer):
            raise RuntimeError(f"vllm-ascend-routing: unexpected capturer {type(capturer).__name__}")
        capturer.attach_device_buffer(prepared.buffer)

    def after_forward(self, runner: Any, prepared: PreparedCapture, num_tokens: int) -> None:
        capturer = ShmRoutedExpertsCapturer.get_instance()
        if capturer is not None:
            capturer.stage(num_tokens)
