# SPDX-License-Identifier: Apache-2.0
"""What one MoE layer records per forward, independent of vLLM generation and backend."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_ascend_routing.ops import OUT_DTYPE, STORAGE_LIMIT, LayerRecorder
from vllm_ascend_routing.sentinel import Sentinel

# The op's storage (``ops.OUT_DTYPE``): the narrowest signed dtype that holds every id of any MoE in use.
CAPTURE_DTYPE = OUT_DTYPE


class LayerCapture(LayerRecorder):
    """Records one layer's logical top-k ids, token ``i`` into ``buffer[i, layer_id]``:
    ``LayerCapture(buffer, layer_id, num_experts, errors, layout=None)``.

    ``buffer`` is allocated before the first forward and never reallocated, so compiled graphs (and
    CUDA/ACL graphs) that bake its address in stay valid. How each call is recorded (the eager direct write
    or the custom op) is the op layer's choice: the call is ``ops.LayerRecorder.__call__`` itself, with no
    extra frame on the per-layer, per-step path.
    """

    @property
    def buffer(self) -> torch.Tensor:
        """``[max_tokens, num_hidden_layers, top_k]`` int16, shared by the model's layers."""
        return self.out


@dataclass(frozen=True)
class PreparedCapture:
    """A target model's capture, bound at load time: one buffer, one error counter, all MoE layers, and the
    always-on check of each step's rows."""

    buffer: torch.Tensor  # [max_tokens, num_hidden_layers, top_k] int16, zeroed
    errors: torch.Tensor
    num_experts: int  # routed experts
    # Every MoE layer id whose rows the buffer holds, ascending: bound by a backend at load, or left to vLLM's
    # binder (``deferred``) until vLLM hands over its capturer; the always-on check covers them all.
    layer_ids: tuple[int, ...]
    id_range: int  # ids recorded as valid: [0, id_range) (routed experts, then zero experts)
    sentinel: Sentinel
    # Layers left to vLLM's own binder (``backends.upstream``), bound when vLLM hands over its capturer.
    deferred: tuple[torch.nn.Module, ...] = ()

    @classmethod
    def bound(
        cls,
        buffer: torch.Tensor,
        errors: torch.Tensor,
        num_experts: int,
        layer_ids: tuple[int, ...],
        id_range: int | None = None,
        deferred: tuple[torch.nn.Module, ...] = (),
    ) -> PreparedCapture:
        layers = tuple(sorted(set(layer_ids)))
        ids = num_experts if id_range is None else id_range
        sentinel = Sentinel.for_capture(buffer, errors, layers, ids)
        return cls(buffer, errors, num_experts, layers, ids, sentinel, deferred)

    def kept_tensors(self) -> dict[str, torch.Tensor]:
        """The device tensors whose contents must outlive a step: the invalid-id counter (a running count) and the
        always-on check's own. The buffer is not one: each step's rows are zeroed before its forward
        (``Sentinel.clear``) and only those are read."""
        return {"invalid_id_count": self.errors, **self.sentinel.kept_tensors()}

    @property
    def num_bound_layers(self) -> int:
        """MoE layers recorded into the buffer (``layer_ids``), whichever binder binds them."""
        return len(self.layer_ids)


def new_error_counter(device: torch.device | str) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int64, device=device)


def check_id_range(num_ids: int) -> None:
    """Refuse an id range (experts, zero experts included) the capture dtype cannot hold."""
    if num_ids > STORAGE_LIMIT:
        raise ValueError(
            f"{num_ids} expert ids do not fit the capture dtype {CAPTURE_DTYPE} (at most {STORAGE_LIMIT})."
        )


def new_capture_buffer(
    num_tokens: int, num_layers: int, top_k: int, num_experts: int, device: torch.device | str
) -> torch.Tensor:
    """A zeroed ``[num_tokens, num_layers, top_k]`` buffer; refuses an expert count it cannot hold."""
    check_id_range(num_experts)
    return torch.zeros((num_tokens, num_layers, top_k), dtype=CAPTURE_DTYPE, device=device)
