# SPDX-License-Identifier: Apache-2.0
"""The capture traced by ``torch.compile`` (Inductor) on the CPU without a native build: the write as ATen ops
(``ops/_in_graph.py``) fused into the graph, against the oracle of ``tests/ops/vectors.py``: exact rows, invalid ids
stored as -1 and counted, rows past the batch and other layers untouched, no call back into the op."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch._inductor.utils import run_and_get_code

from tests.ops.vectors import POISON, Case
from vllm_ascend_routing.ops import LayerRecorder, _library

pytestmark = pytest.mark.host_kernel


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_compiled_capture_writes_in_graph(id_dtype: torch.dtype, run_seed: int) -> None:
    assert _library.HOST_KERNEL
    num_experts, k, rows = 64, 4, 40
    out = torch.full((rows, 3, k), POISON, dtype=torch.int16)
    errors = torch.zeros(1, dtype=torch.int64)
    recorders = [LayerRecorder(out, layer, num_experts, errors) for layer in (0, 2)]

    def routing(x: torch.Tensor) -> torch.Tensor:
        for recorder in recorders:
            weights, ids = torch.topk(x, k, dim=-1)
            recorder(ids.to(id_dtype) + (x[:, :k] > 2.5).to(id_dtype) * 100)  # > 2.5 sigma: an id out of range
            x = x * weights.sum(dim=-1, keepdim=True)
        return x

    compiled = torch.compile(routing, dynamic=True, fullgraph=True)
    generator = torch.Generator().manual_seed(run_seed)
    for n in (17, 30, 0):
        x = torch.randn(n, num_experts, generator=generator)
        x[n // 2 : n // 2 + 1, 0] = 3.0  # at least one id out of range in every non-empty batch
        expected = out.numpy().copy()  # what the compiled call must leave: this start, the layers' rows rewritten
        bad = 0
        eager_x = x.clone()
        for layer in (0, 2):
            weights, ids = torch.topk(eager_x, k, dim=-1)
            ids = ids.to(id_dtype) + (eager_x[:, :k] > 2.5).to(id_dtype) * 100
            case = Case(ids, torch.from_numpy(expected), layer, num_experts)
            expected, layer_bad = case.expected()
            bad += layer_bad
            eager_x = eager_x * weights.sum(dim=-1, keepdim=True)
        before = int(errors)
        if n == 17:
            _, code = run_and_get_code(compiled, x)
            assert "record_topk_ids" not in "".join(code)  # fused, not a call back into Python
        else:
            compiled(x)
        np.testing.assert_array_equal(out.numpy(), expected)
        assert int(errors) - before == bad and (bad > 0) == (n > 0)
