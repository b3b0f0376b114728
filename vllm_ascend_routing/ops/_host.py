# SPDX-License-Identifier: Apache-2.0
"""CPU kernel of ``record_topk_ids``: the same contract as the reference, on NumPy views of the tensors.

Why not the reference on the CPU: each ATen call costs several microseconds of dispatch there, and the
reference's range check, masking and error count are several of them per MoE layer per step. Here the
common case, every id in range, is one reduction and one strided copy on zero-copy NumPy views
(``_id_rule.checked_array``). The host reads it does cost nothing: on the CPU the data already is on the
host, so no device is waited for.

In eager mode (not traced) the capture path does not reach this kernel for in-range ids: ``LayerRecorder``
writes them itself into a view taken at bind time (``ops.eager_view``). This kernel serves compiled graphs,
the public ``record_topk_ids``, and every batch with an id out of range.
"""

from __future__ import annotations

import torch

from vllm_ascend_routing.ops._id_rule import checked_array


def record_topk_ids_host(
    topk_ids: torch.Tensor,
    out: torch.Tensor,
    layer_id: int,
    num_experts: int | None,
    errors: torch.Tensor,
) -> None:
    """Write ``topk_ids`` `[N, K]` into ``out[:N, layer_id]`` (see ``ops.record_topk_ids``); CPU tensors."""
    if topk_ids.shape[0] == 0:
        return
    # Integer tensors never require grad, so .numpy() is always a zero-copy view here.
    ids = checked_array(topk_ids.numpy(), num_experts, errors)
    out.numpy()[: ids.shape[0], layer_id] = ids  # a view of ``out``; the unsafe cast narrows like ``copy_``
