# SPDX-License-Identifier: Apache-2.0
"""The capture's state through vLLM's sleep mode (``enable_sleep_mode``, RL frameworks' rollout engines).

Everything allocated while the model loads lives in vLLM's "weights" memory pool, the capture's buffer and counter
included. ``sleep(level=1)`` copies that pool to the host and back; ``sleep(level=2)`` discards it, and ``wake_up``
maps fresh memory at the same addresses (so graphs stay valid) with its old contents lost. The one thing vLLM (and
vllm-ascend's NPU worker, 0.20-0.30) saves and restores across level 2 is the model's registered buffers
(``model.named_buffers()``); the framework loads the weights again itself.

So the tensors the capture keeps from one step to the next (``PreparedCapture.kept_tensors``) are registered as
non-persistent buffers of the model: restored with the model's own, never in a state dict or a checkpoint. A counter
that came back as whatever the memory held would read as billions of invalid ids (and raise in strict mode).
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_ascend_routing.capture import PreparedCapture

BUFFER_PREFIX = "vllm_ascend_routing_"  # names on the model: ``vllm_ascend_routing_invalid_id_count`` ...


def keep_through_sleep(model: Any, prepared: PreparedCapture) -> dict[str, torch.Tensor]:
    """Register the capture's kept tensors on ``model`` (the runner's, possibly behind vLLM's graph wrapper, which
    forwards to it) under ``BUFFER_PREFIX``; returns them by their registered names."""
    kept = {BUFFER_PREFIX + name: tensor for name, tensor in prepared.kept_tensors().items()}
    for name, tensor in kept.items():
        model.register_buffer(name, tensor, persistent=False)
    return kept
