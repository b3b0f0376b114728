# SPDX-License-Identifier: Apache-2.0
"""What one MoE layer records per forward, independent of vLLM generation and backend."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_ascend_routing.ops import record_topk_ids_op, storage_limit

# Narrowest signed storage that holds every id of any MoE in use; -1 marks an invalid id.
CAPTURE_DTYPE = torch.int16


@dataclass(frozen=True)
class LayerCapture:
    """Records one layer's logical top-k ids, token ``i`` into ``buffer[i, layer_id]``.

    ``buffer`` is allocated before the first forward and never reallocated, so compiled graphs (and
    CUDA/ACL graphs) that bake its address in stay valid.
    """

    buffer: torch.Tensor  # [max_tokens, num_hidden_layers, top_k] int16
    layer_id: int
    num_experts: int
    errors: torch.Tensor  # [1] int64, out-of-range ids seen (shared by a model's layers)

    def __call__(self, topk_ids: torch.Tensor) -> None:
        # The op itself (no Python argument checks: buffer and layer were validated at bind time, and the
        # fake kernel checks shapes when compiled). Runs once per MoE layer per step.
        record_topk_ids_op(topk_ids, self.buffer, self.layer_id, None, self.num_experts, self.errors)


@dataclass(frozen=True)
class PreparedCapture:
    """A target model's capture, bound at load time: one buffer, one error counter, all MoE layers."""

    buffer: torch.Tensor  # [max_tokens, num_hidden_layers, top_k] int16, zeroed
    errors: torch.Tensor
    num_experts: int
    num_bound_layers: int


def new_error_counter(device: torch.device | str) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int64, device=device)


def new_capture_buffer(
    num_tokens: int, num_layers: int, top_k: int, num_experts: int, device: torch.device | str
) -> torch.Tensor:
    """A zeroed ``[num_tokens, num_layers, top_k]`` buffer; refuses an expert count it cannot hold."""
    if num_experts > storage_limit(CAPTURE_DTYPE):
        raise ValueError(
            f"{num_experts} experts do not fit the capture dtype {CAPTURE_DTYPE} "
            f"(at most {storage_limit(CAPTURE_DTYPE)})."
        )
    return torch.zeros((num_tokens, num_layers, top_k), dtype=CAPTURE_DTYPE, device=device)
