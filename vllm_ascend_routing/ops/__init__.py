# SPDX-License-Identifier: Apache-2.0
"""Public op ``record_topk_ids``: scatter a layer's top-k expert ids into a capture buffer."""

from __future__ import annotations

import torch

from vllm_ascend_routing.ops import _library
from vllm_ascend_routing.ops._library import HOST_KERNEL, check_arguments, record_topk_ids_op
from vllm_ascend_routing.ops._native import native_backend
from vllm_ascend_routing.ops._reference import storage_limit

__all__ = ["eager_view", "kernel_backend", "record_topk_ids", "record_topk_ids_op", "storage_limit"]

native_backend()  # register the native kernels, if built, before the op is first called


def record_topk_ids(
    topk_ids: torch.Tensor,
    out: torch.Tensor,
    layer_id: int,
    rows: torch.Tensor | None = None,
    num_experts: int | None = None,
    errors: torch.Tensor | None = None,
) -> None:
    """Write one MoE layer's top-k ids into ``out`` in place, without a host synchronisation.

    Args:
        topk_ids: `[N, K]` int32/int64 logical expert ids, one row per token.
        out: `[R, L, K]` int16 (or uint8) capture buffer on the same device.
        layer_id: layer index in ``[0, L)``.
        rows: optional `[N]` int32/int64 destination row per token; negative rows are padding and are
            skipped. Without it token ``i`` goes to row ``i``.
        num_experts: when given, an id outside ``[0, num_experts)`` or outside ``out``'s dtype range is
            stored as -1 (int16) / 255 (uint8) instead of a wrapped value, and counted in ``errors``.
        errors: optional 1-element int32/int64 counter, incremented in place.
    """
    check_arguments(topk_ids, out, layer_id, rows, errors)
    if errors is None:
        errors = topk_ids.new_zeros(1)  # discarded counter; capture paths pass a persistent one
    record_topk_ids_op(topk_ids, out, layer_id, rows, num_experts, errors)


def eager_view(out: torch.Tensor, layer_id: int) -> torch.Tensor | None:
    """``out[:, layer_id]`` (a `[R, K]` view) where eager code may write in-range ids into it directly instead
    of calling the op: ``out`` a plain CPU tensor and the host kernel serving the CPU (the reference not
    forced). ``None`` elsewhere: devices whose native kernel (or the reference) the op must run, and tensor
    subclasses of tracers. Never for traced code: ``LayerCapture`` uses it only when not compiling."""
    if not _library.HOST_KERNEL or type(out) is not torch.Tensor or not out.is_cpu or out.dim() != 3:
        return None
    return out[:, layer_id]


def kernel_backend() -> str:
    """Which implementations serve ``record_topk_ids``: ``cuda``/``npu`` native, the host kernel on the CPU,
    the PyTorch reference elsewhere."""
    native = native_backend()
    served = [f"native-{native}"] if native else []
    served.append("host-numpy on cpu" if HOST_KERNEL else "pytorch-reference on cpu")
    return ", ".join(served) + ", pytorch-reference elsewhere"
