# SPDX-License-Identifier: Apache-2.0
"""``torch_npu`` (and ``torchair``, ``npugraph_ex``) stubbed on the CPU, the way vllm-ascend's own unit
tests run without an NPU.

Every ``torch_npu`` module (and ``torch.npu``) is a ``MagicMock``: vllm-ascend imports, and references
``torch.npu.Event`` / ``torch_npu.npu_*`` at import time, work; nothing in these tests reaches an NPU
kernel (routing is forced onto vllm-ascend's native torch path, see ``conftest``).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from unittest import mock

import torch

_ROOT = "torch_npu"
# NPU-only packages vllm-ascend's worker imports (graph modes); stubbed alike.
_STUBBED = (_ROOT, "torchair", "npugraph_ex")


def _stub_module(name: str) -> mock.MagicMock:
    module = mock.MagicMock(name=name)
    module.__name__ = name
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__path__ = []  # a package: submodules import through the finder below
    module.VLLM_ASCEND_ROUTING_STUB = True
    return module


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".")[0] in _STUBBED:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return _stub_module(spec.name)  # type: ignore[return-value]

    def exec_module(self, module: ModuleType) -> None:
        pass


def _gating_top_k_softmax(router_logits: torch.Tensor, k: int, **_: object) -> tuple[torch.Tensor, ...]:
    """CPU stand-in for ``torch_npu.npu_moe_gating_top_k_softmax`` (310P routing): softmax, then top-k;
    returns (weights, int32 ids, row index) like the NPU op. Within a token the k experts come in ascending
    score order, not the descending order of ``torch.topk``: nothing downstream may assume the reference's
    order (the capture must keep the kernel's)."""
    weights, ids = torch.softmax(router_logits.float(), dim=-1).topk(k, dim=-1)
    weights, ids = weights.flip(-1), ids.flip(-1)
    row_idx = torch.arange(ids.numel(), dtype=torch.int32).view(k, -1).t().contiguous()
    return weights, ids.to(torch.int32), row_idx


def install() -> None:
    """Idempotent. Must run before anything imports ``vllm_ascend``."""
    if isinstance(sys.modules.get(_ROOT), mock.MagicMock):
        return
    sys.meta_path.insert(0, _StubFinder())
    root = _stub_module(_ROOT)
    root.npu_moe_gating_top_k_softmax = _gating_top_k_softmax
    sys.modules[_ROOT] = root
    torch.npu = _stub_module("torch.npu")  # type: ignore[attr-defined]
