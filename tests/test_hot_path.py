# SPDX-License-Identifier: Apache-2.0
"""Regression guard for the per-step cost, by counting, not timing: on a fake step, each MoE layer's capture
is, in eager mode on the CPU, a direct host write that dispatches no op and allocates nothing, and, when traced
by torch.compile, exactly one op (record_topk_ids: one kernel launch with a native backend); nothing in the
capture path can synchronise the host with the device, and the step hooks add no work where vLLM moves the
rows itself."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.fakes import FakeModel
from vllm_ascend_routing.compat._common import bind_target_model
from vllm_ascend_routing.ops import _library
from vllm_ascend_routing.ops._reference import record_topk_ids_reference

# Eager mode on the CPU, per MoE layer per step (``ops.LayerRecorder.__call__``). Without a native build: the ids
# viewed as NumPy (``Tensor.numpy`` dispatches one ``detach``, a view), then the range check (one NumPy reduction on
# CPU memory, nothing waited for) and the write into a NumPy view taken at bind time, neither an ATen op. With one
# (make test-native): the C++ kernel's direct entry on the tensors themselves, no op at all. Either way no op of
# the plugin's own (no dispatcher round trip into a Python kernel), no allocation, no copy.
EAGER_CAPTURE_OPS = [] if _library.NATIVE_RECORD_ROWS is not None else ["aten::detach"]
# Ops that make the host wait for the device (or read device data on the host).
SYNCING = {"_local_scalar_dense", "item", "nonzero", "masked_select", "unique", "_unique2", "equal", "is_nonzero"}


class OpLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(f"{func.namespace}::{func._opname}")
        return func(*args, **(kwargs or {}))


def _moe_step(
    model: FakeModel,
    moe_layers: tuple[int, ...],
    cpu_moe: bool,
    ids: torch.Tensor,
    x: torch.Tensor,
    weights: torch.Tensor,
) -> None:
    """One forward step of the fake model: every MoE layer routes once and hands its ids to its capture."""
    for layer in moe_layers:
        module = model.layers[layer]
        if cpu_moe:
            module.quant_method.cpu_fused_moe.forward_method(module, x, weights, ids)
        else:
            module.router.capture_fn(ids)


BACKENDS = pytest.mark.parametrize("cpu_moe", [False, True], ids=["router", "cpu_moe"])


@BACKENDS
def test_eager_capture_skips_the_dispatcher(cpu_moe: bool) -> None:
    """Eager mode on the CPU: per MoE layer per step the capture dispatches no op of its own (the
    in-range write is called directly: the dispatcher round trip into the Python kernel made it twice vLLM's
    own capture) and exactly ``EAGER_CAPTURE_OPS``."""
    num_layers, moe_layers, tokens = 8, (0, 1, 3, 4, 6, 7), 96
    model = FakeModel(cpu=cpu_moe, moe_layers=moe_layers, num_layers=num_layers)
    prepared = bind_target_model(model, 256, (num_layers, 8, 64), torch.device("cpu"))
    ids = torch.randint(0, 64, (tokens, 8), dtype=torch.int32)
    x, weights = torch.zeros(tokens, 2), torch.ones(tokens, 8)
    with OpLog() as log:
        _moe_step(model, moe_layers, cpu_moe, ids, x, weights)
    capture_ops = [op for op in log.ops if op != "aten::add"]  # the fake MoE's own `x + 1`
    assert capture_ops == EAGER_CAPTURE_OPS * len(moe_layers), capture_ops
    for layer in range(num_layers):
        expected = ids if layer in moe_layers else torch.zeros_like(ids)
        assert torch.equal(prepared.buffer[:tokens, layer].to(torch.int32), expected)
    assert int(prepared.errors) == 0


@BACKENDS
def test_traced_capture_is_one_op_per_moe_layer(cpu_moe: bool) -> None:
    """Under ``torch.compile`` the capture stays the custom op mutating the buffer (what keeps the write in
    compiled graphs and graph captures), one per MoE layer per step, nothing else; the compiled step writes.
    On the CPU without a native build, one ``index_put_`` per MoE layer instead (``ops/_in_graph.py``: Inductor
    fuses it; the op would call back into the Python host kernel) and no op."""
    num_layers, moe_layers, tokens = 8, (0, 1, 3, 4, 6, 7), 24
    model = FakeModel(cpu=cpu_moe, moe_layers=moe_layers, num_layers=num_layers)
    prepared = bind_target_model(model, 64, (num_layers, 8, 64), torch.device("cpu"))
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    step = torch.compile(_moe_step, backend=backend, fullgraph=True)
    ids = torch.randint(0, 64, (tokens, 8), dtype=torch.int64)
    step(model, moe_layers, cpu_moe, ids, torch.zeros(tokens, 2), torch.ones(tokens, 8))
    assert len(graphs) == 1
    targets = [str(node.target) for node in graphs[0].graph.nodes if node.op in ("call_function", "call_method")]
    recorded = [t for t in targets if "record_topk_ids" in t]
    if _library.HOST_KERNEL:
        assert not recorded and targets.count("index_put_") == len(moe_layers), targets
    else:
        assert len(recorded) == len(moe_layers) and "index_put_" not in targets, targets
        assert all(t == "vllm_ascend_routing.record_topk_ids.default" for t in recorded), recorded
    for layer in moe_layers:
        assert torch.equal(prepared.buffer[:tokens, layer].long(), ids)


def test_capture_takes_the_op_where_the_host_kernel_does_not_serve() -> None:
    """Off the CPU (native kernel or reference), with the reference forced, or for ids the direct write does
    not accept, ``LayerCapture`` (its ``ops.LayerRecorder``) emits the op (which stores and counts invalid ids,
    or raises, as before)."""
    from vllm_ascend_routing.capture import LayerCapture

    errors = torch.zeros(1, dtype=torch.int64)
    meta = LayerCapture(torch.zeros(8, 2, 4, dtype=torch.int16, device="meta"), 1, 64, errors)
    assert not meta.writes_directly
    cpu = LayerCapture(torch.zeros(8, 2, 4, dtype=torch.int16), 1, 64, errors)
    assert cpu.writes_directly
    ids = torch.zeros(3, 4, dtype=torch.int32)
    with OpLog() as log:
        cpu(ids)
    assert log.ops == EAGER_CAPTURE_OPS
    # Out of range: stored as -1 and counted, by the op (NumPy direct write) or by the C++ direct entry itself.
    native = _library.NATIVE_RECORD_ROWS is not None

    def invalid_ids_took_their_path(ops: list[str]) -> bool:
        return ops == EAGER_CAPTURE_OPS if native else "vllm_ascend_routing::record_topk_ids" in ops

    invalid = torch.tensor([[1, 2, 64, -1], [0, 0, 0, 70000]])
    with OpLog() as log:
        cpu(invalid)
    assert invalid_ids_took_their_path(log.ops)
    assert cpu.buffer[:2, 1].tolist() == [[1, 2, -1, -1], [0, 0, 0, -1]] and int(errors) == 3
    for dtype in (torch.int32, torch.int64):  # a negative id alone (every other in range): never written as is
        lone_negative = torch.tensor([[3, -1, 5, 6]], dtype=dtype)
        with OpLog() as log:
            cpu(lone_negative)
        assert invalid_ids_took_their_path(log.ops)
        assert cpu.buffer[0, 1].tolist() == [3, -1, 5, 6]
    assert int(errors) == 5
    with OpLog() as log, pytest.raises((RuntimeError, TypeError, ValueError)):
        cpu(torch.zeros(3, 4))  # float ids: the op refuses them
    assert "vllm_ascend_routing::record_topk_ids" in log.ops
    with pytest.raises(RuntimeError):
        cpu(torch.zeros(9, 4, dtype=torch.int32))  # more tokens than rows: never a silent partial write
    with pytest.MonkeyPatch.context() as forced:  # VLLM_ASCEND_ROUTING_FORCE_REFERENCE=1
        forced.setattr(_library, "HOST_KERNEL", False)
        forced.setattr(_library, "NATIVE_RECORD_ROWS", None)
        assert not LayerCapture(torch.zeros(8, 2, 4, dtype=torch.int16), 1, 64, errors).writes_directly


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_a_long_prefill_is_written_by_torchs_threads(id_dtype: torch.dtype) -> None:
    """From ``LARGE_BATCH_IDS`` ids on, the eager write without a native build checks and copies with ATen's
    threaded ``aminmax`` and ``copy_`` (reading two bounds from CPU memory) instead of NumPy's single-threaded
    calls; with one, the C++ direct entry (threaded itself). In range: exact; any invalid id, at either end of the
    batch: the op, which stores it as -1 and counts it."""
    from vllm_ascend_routing.capture import LayerCapture
    from vllm_ascend_routing.ops._recorder import LARGE_BATCH_IDS

    k = 8
    tokens = LARGE_BATCH_IDS // k + 3
    errors = torch.zeros(1, dtype=torch.int64)
    cpu = LayerCapture(torch.zeros(tokens + 2, 3, k, dtype=torch.int16), 2, 64, errors)
    ids = torch.randint(0, 64, (tokens, k), dtype=id_dtype, generator=torch.Generator().manual_seed(7))
    with OpLog() as log:
        cpu(ids)
    native = _library.NATIVE_RECORD_ROWS is not None
    large_ops = ["aten::detach", "aten::aminmax", *["aten::_local_scalar_dense"] * 2, "aten::slice", "aten::copy_"]
    assert log.ops == ([] if native else large_ops), log.ops
    assert torch.equal(cpu.buffer[:tokens, 2].to(id_dtype), ids) and not cpu.buffer[tokens:].any()
    assert not cpu.buffer[:, :2].any() and int(errors) == 0
    for row, slot, bad in ((0, 3, -1), (tokens - 1, 7, 64)):
        planted = ids.clone()
        planted[row, slot] = bad
        with OpLog() as log:
            cpu(planted)
        assert native or "vllm_ascend_routing::record_topk_ids" in log.ops, log.ops
        expected = planted.clone()
        expected[row, slot] = -1
        assert torch.equal(cpu.buffer[:tokens, 2].to(id_dtype), expected)
    assert int(errors) == 2


def test_reference_kernel_has_no_syncing_op_on_the_capture_path() -> None:
    buffer = torch.zeros(128, 4, 8, dtype=torch.int16)
    errors = torch.zeros(1, dtype=torch.int64)
    with OpLog() as log:
        record_topk_ids_reference(torch.randint(-1, 70, (100, 8), dtype=torch.int32), buffer, 2, 64, errors)
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
        record_topk_ids_host(in_range, buffer, 2, 64, errors)
        record_topk_ids_host(out_of_range, buffer, 3, 64, errors)
    assert set(log.ops) == {"aten::detach"} and len(log.ops) == 5  # ids+out, ids+out+errors
    assert torch.equal(buffer[:100, 2].long(), in_range)
    assert int(errors) == int(((out_of_range < 0) | (out_of_range >= 64)).sum())


def test_step_hooks_add_no_work_on_the_cpu() -> None:
    from vllm_ascend_routing.compat.runner_output.adapter import RunnerOutputAdapter
    from vllm_ascend_routing.compat.shm import store
    from vllm_ascend_routing.compat.shm.adapter import ShmAdapter, ShmRoutedExpertsCapturer

    prepared = bind_target_model(FakeModel(cpu=False), 64, (3, 2, 8), torch.device("cpu"))
    capturer = ShmRoutedExpertsCapturer()
    capturer._writer = store.SegmentWriter(store.SegmentSpec.for_engine("hotpath", 0, (64, 3, 2), 8))
    capturer.attach_device_buffer(prepared.buffer)  # CPU buffer: rows are read in place, never copied
    ShmRoutedExpertsCapturer._instance = capturer
    runner = SimpleNamespace(routed_experts_attn_gid=0)  # vLLM's runner (attention in KV group 0)
    try:
        with OpLog() as log:
            RunnerOutputAdapter().after_forward(runner, prepared, 64)
            ShmAdapter().after_forward(runner, prepared, 64)
        assert log.ops == []
    finally:
        ShmRoutedExpertsCapturer._instance = None
        capturer.cleanup()
