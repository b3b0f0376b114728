# SPDX-License-Identifier: Apache-2.0
"""The GPU checks every CUDA kernel of the op passes (native, Triton), through the op's CUDA dispatch: whichever
kernel serves it is what the calling test's fixture asserts."""

from __future__ import annotations

import numpy as np
import torch

from tests.ops.vectors import make_case
from vllm_ascend_routing.ops import record_topk_ids


def matches_oracle(n: int, k: int, id_dtype: torch.dtype, checked: bool, seed: int) -> None:
    """One vector case on the GPU against the oracle: every row, the poison around it, the invalid-id count."""
    case = make_case(n, k, id_dtype, checked, seed)
    expected, bad = case.expected()
    out = case.out.cuda()
    errors = torch.zeros(1, dtype=torch.int64, device="cuda")
    record_topk_ids(case.ids.cuda(), out, case.layer_id, case.num_experts, errors)
    assert int(errors) == bad
    np.testing.assert_array_equal(out.cpu().numpy(), expected)


def graph_replays_new_ids() -> None:
    """Captured once in a CUDA graph after a warm-up outside it, replayed with new ids: each replay writes the step's
    ids (invalid ones as -1) and counts its invalid ones."""
    ids = torch.zeros(64, 8, dtype=torch.int32, device="cuda")
    out = torch.zeros(64, 4, 8, dtype=torch.int16, device="cuda")
    errors = torch.zeros(1, dtype=torch.int64, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        record_topk_ids(ids, out, 2, 16, errors)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        record_topk_ids(ids, out, 2, 16, errors)
    for step in range(3):
        new = torch.randint(0, 20, (64, 8), dtype=torch.int32, device="cuda")
        ids.copy_(new)  # replay reads the new ids from the captured address
        errors.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out[:, 2], torch.where(new >= 16, -1, new).to(torch.int16)), step
        assert int(errors) == int((new >= 16).sum()), step


def opcheck() -> None:
    op = torch.ops.vllm_ascend_routing.record_topk_ids.default
    ids = torch.randint(0, 8, (6, 2), dtype=torch.int32, device="cuda")
    out = torch.zeros(8, 3, 2, dtype=torch.int16, device="cuda")
    torch.library.opcheck(op, (ids, out, 1, 8, torch.zeros(1, dtype=torch.int32, device="cuda")))
