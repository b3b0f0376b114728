# SPDX-License-Identifier: Apache-2.0
"""The invalid-id rule of ``record_topk_ids``, defined once for every Python path that records ids.

With ``num_experts`` given, an id is valid when ``0 <= id < limit``, ``limit = min(num_experts,
STORAGE_LIMIT)``. Every other id (padding -1, any negative id, an id of no routed expert, an id the int16
storage cannot hold) is stored as ``INVALID_ID`` instead of a wrapped, plausible expert id, and each one is
counted once in the caller's ``errors`` counter. Without ``num_experts`` nothing is checked and ids are
narrowed as ``Tensor.copy_`` narrows them.

Who applies it: the PyTorch reference (``checked_tensor``), the host kernel (``checked_array``) and the eager
direct write (the same unsigned-max test on its NumPy view, the op for anything else). The native kernels implement the
same rule in C++ (``csrc/cuda/record_topk_ids_kernel.cuh``, ``csrc/ascend/op_kernel/record_topk_ids_kernel.cpp``);
the kernel tests compare them with ``checked_array``.
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np
import torch

# The capture buffer's storage: the narrowest signed dtype that holds every id of any MoE in use, and
# leaves -1 free to mark an invalid one.
OUT_DTYPE = torch.int16
INVALID_ID = -1
# The most ids the storage records as valid (ids 0 .. 32766); a larger expert count is refused at bind time.
STORAGE_LIMIT = 32767

# The id dtypes the op accepts, each with the unsigned NumPy type of its width (the one-reduction check).
ID_DTYPES = (torch.int32, torch.int64)
_UNSIGNED = {np.dtype(np.int32): np.uint32, np.dtype(np.int64): np.uint64}
# The same, keyed by the torch dtype: the eager direct write looks a tensor's up before viewing it as NumPy.
UNSIGNED_OF = {torch.int32: np.uint32, torch.int64: np.uint64}

Ids = TypeVar("Ids", torch.Tensor, np.ndarray)


def id_limit(num_experts: int) -> int:
    """The exclusive upper bound of the valid ids for ``num_experts`` experts."""
    return min(num_experts, STORAGE_LIMIT)


def invalid_mask(ids: Ids, limit: int) -> Ids:
    """Elementwise: true where an id is invalid. The same expression for tensors and NumPy arrays."""
    return (ids < 0) | (ids >= limit)


def checked_tensor(ids: torch.Tensor, num_experts: int | None, errors: torch.Tensor | None) -> torch.Tensor:
    """``ids`` with the rule applied (a new tensor when checked), invalid ids added to ``errors`` on the
    device: no host read, so it adds no synchronisation on accelerators."""
    if num_experts is None:
        return ids
    bad = invalid_mask(ids, id_limit(num_experts))
    if errors is not None:
        errors.add_(bad.sum())
    return ids.masked_fill(bad, INVALID_ID)


def checked_array(ids: np.ndarray, num_experts: int | None, errors: torch.Tensor) -> np.ndarray:
    """``ids`` (a non-empty CPU NumPy view) with the rule applied: ``ids`` itself when all are valid, else a copy with
    the invalid ones replaced and counted in ``errors[0]`` (a CPU tensor, viewed only then).

    The common case is one reduction: viewed as unsigned, a negative id is a huge value, so ``max < limit``
    is ``0 <= id < limit`` for every id at once."""
    if num_experts is None:
        return ids
    unsigned = _UNSIGNED.get(ids.dtype)
    if unsigned is None:
        raise TypeError(f"record_topk_ids: topk_ids must be int32 or int64, got {ids.dtype}")
    limit = id_limit(num_experts)
    if ids.view(unsigned).max() < limit:
        return ids
    bad = invalid_mask(ids, limit)
    errors.numpy()[0] += int(bad.sum())
    return np.where(bad, INVALID_ID, ids)
