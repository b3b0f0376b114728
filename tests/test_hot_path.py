# SPDX-License-Identifier: Apache-2.0
"""Regression guard for the per-step cost, by counting, not timing: on a fake step, each MoE layer issues
exactly one op (record_topk_ids: one kernel launch with a native backend), nothing in the capture path can
synchronise the host with the device, and the step hooks add no work where vLLM moves the rows itself."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.fakes import FakeModel
from vllm_ascend_routing.compat._common import bind_target_model
from vllm_ascend_routing.ops._reference import record_topk_ids_reference

# Ops that make the host wait for the device (or read device data on the host).
SYNCING = {"_local_scalar_dense", "item", "nonzero", "masked_select", "unique", "_unique2", "equal", "is_nonzero"}


class OpLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(f"{func.namespace}::{func._opname}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("cpu_moe", [False, True], ids=["router", "cpu_moe"])
def test_one_op_per_moe_layer_per_step(cpu_moe: bool) -> None:
    num_layers, moe_layers, tokens = 8, (0, 1, 3, 4, 6, 7), 96
    model = FakeModel(cpu=cpu_moe, moe_layers=moe_layers, num_layers=num_layers)
    prepared = bind_target_model(model, 256, (num_layers, 8, 64), torch.device("cpu"))
    ids = torch.randint(0, 64, (tokens, 8), dtype=torch.int32)
    x, weights = torch.zeros(tokens, 2), torch.ones(tokens, 8)
    with OpLog() as log:
        for layer in moe_layers:  # one forward step: every MoE layer routes once
            module = model.layers[layer]
            if cpu_moe:
                module.quant_method.cpu_fused_moe.forward_method(module, x, weights, ids)
            else:
                module.router.capture_fn(ids)
    recorded = [op for op in log.ops if op == "vllm_ascend_routing::record_topk_ids"]
    assert len(recorded) == len(moe_layers)
    # Besides the fake MoE's own `x + 1`, the capture path dispatches nothing else.
    assert set(log.ops) - {"aten::add"} == {"vllm_ascend_routing::record_topk_ids"}
    assert torch.equal(prepared.buffer[:tokens, 3].to(torch.int32), ids)


def test_reference_kernel_has_no_syncing_op_on_the_capture_path() -> None:
    buffer = torch.zeros(128, 4, 8, dtype=torch.int16)
    errors = torch.zeros(1, dtype=torch.int64)
    with OpLog() as log:
        record_topk_ids_reference(torch.randint(-1, 70, (100, 8), dtype=torch.int32), buffer, 2, None, 64, errors)
    names = {op.split("::")[1] for op in log.ops}
    assert not names & SYNCING, names & SYNCING


def test_host_kernel_dispatches_no_aten_op() -> None:
    """The CPU kernel works on NumPy views: no ATen compute op (the reference dispatches ~8 a call); the only
    dispatch is the view ``Tensor.numpy()`` takes of each tensor it touches."""
    from vllm_ascend_routing.ops._host import record_topk_ids_host

    buffer = torch.zeros(128, 4, 8, dtype=torch.int16)
    errors = torch.zeros(1, dtype=torch.int64)
    in_range = torch.randint(0, 64, (100, 8), dtype=torch.int64)
    out_of_range = torch.randint(-1, 70, (100, 8), dtype=torch.int32)
    with OpLog() as log:
        record_topk_ids_host(in_range, buffer, 2, None, 64, errors)
        record_topk_ids_host(out_of_range, buffer, 3, None, 64, errors)
    assert set(log.ops) == {"aten::detach"} and len(log.ops) == 5  # ids+out, ids+out+errors
    assert torch.equal(buffer[:100, 2].long(), in_range)
    assert int(errors) == int(((out_of_range < 0) | (out_of_range >= 64)).sum())


def test_step_hooks_add_no_work_on_the_cpu() -> None:
    from vllm_ascend_routing.compat import _shm_store as store
    from vllm_ascend_routing.compat.runner_output import RunnerOutputAPI
    from vllm_ascend_routing.compat.shm import ShmAPI, ShmRoutedExpertsCapturer

    prepared = bind_target_model(FakeModel(cpu=False), 64, (3, 2, 8), torch.device("cpu"))
    capturer = ShmRoutedExpertsCapturer()
    capturer._writer = store.SegmentWriter(store.SegmentSpec.for_engine("hotpath", 0, (64, 3, 2), 8))
    capturer.attach_device_buffer(prepared.buffer)  # CPU buffer: rows are read in place, never copied
    ShmRoutedExpertsCapturer._instance = capturer
    try:
        with OpLog() as log:
            RunnerOutputAPI().after_forward(prepared, 64)
            ShmAPI().after_forward(prepared, 64)
        assert log.ops == []
    finally:
        ShmRoutedExpertsCapturer._instance = None
        capturer.cleanup()
