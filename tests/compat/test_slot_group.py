# SPDX-License-Identifier: Apache-2.0
"""The KV group whose slots key routed-experts rows: vllm-ascend's V1 runner snapshots group 0, which in a
hybrid model is a linear-attention group; runner-output re-takes the snapshot from the attention group after
each forward, 0.20.x (shm) refuses. Runners that snapshot the right group are left alone."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from vllm_ascend_routing.compat._common import misplaced_slot_group
from vllm_ascend_routing.compat.interface import UnsupportedVllmError
from vllm_ascend_routing.compat.runner_output.adapter import RunnerOutputAdapter
from vllm_ascend_routing.compat.shm.adapter import refuse_misplaced_slots


def runner_class(module: str) -> type:
    return type("NPUModelRunner", (), {"__module__": module})


ASCEND_V1 = runner_class("vllm_ascend.worker.model_runner_v1")
ASCEND_V2 = runner_class("vllm_ascend.worker.v2.model_runner")
VLLM_V1 = runner_class("vllm.v1.worker.gpu_model_runner")


def runner(cls: type, attention_gid: int | None, capturer_gid: int | None = None) -> Any:
    instance = cls()
    if attention_gid is not None:
        instance.routed_experts_attn_gid = attention_gid  # vLLM 0.20-0.27
    instance.routed_experts_capturer = SimpleNamespace(attn_gid=capturer_gid)  # 0.28+
    mamba, attention = torch.arange(100, 116), torch.arange(16)
    instance.input_batch = SimpleNamespace(
        block_table=[SimpleNamespace(slot_mapping=SimpleNamespace(gpu=t)) for t in (mamba, attention)]
    )
    instance.routed_experts_slot_mapping_device = mamba.clone()  # what vllm-ascend snapshotted: group 0
    return instance


@pytest.mark.parametrize(
    ("cls", "attention_gid", "capturer_gid", "expected"),
    [
        (ASCEND_V1, 1, None, 1),  # 0.23-0.27: the runner's attention group
        (ASCEND_V1, None, 1, 1),  # 0.28+: the capturer's
        (ASCEND_V1, 0, None, None),  # attention in group 0: vllm-ascend's snapshot is right
        (ASCEND_V2, None, 1, None),  # Model Runner V2 keys by the attention group itself
        (VLLM_V1, 1, None, None),  # vLLM's own runner snapshots the attention group
    ],
)
def test_which_runner_snapshots_the_wrong_group(
    cls: type, attention_gid: int | None, capturer_gid: int | None, expected: int | None
) -> None:
    assert misplaced_slot_group(runner(cls, attention_gid, capturer_gid)) == expected


def test_runner_output_re_takes_the_snapshot_from_the_attention_group() -> None:
    api, prepared = RunnerOutputAdapter(), SimpleNamespace()
    hybrid = runner(ASCEND_V1, 1)
    capturer = SimpleNamespace(device_buffer=torch.zeros(16, 2, 2, dtype=torch.int16))
    prepared = SimpleNamespace(buffer=capturer.device_buffer, deferred=())  # no layer left to vLLM
    api.attach(hybrid, prepared, capturer)  # type: ignore[arg-type]
    api.after_forward(hybrid, prepared, 5)  # type: ignore[arg-type]
    assert hybrid.routed_experts_slot_mapping_device[:5].tolist() == [0, 1, 2, 3, 4]  # the attention slots
    assert hybrid.routed_experts_slot_mapping_device[5:].tolist() == list(range(105, 116))  # untouched

    plain = runner(ASCEND_V1, 0)
    api.attach(plain, prepared, capturer)  # type: ignore[arg-type]
    api.after_forward(plain, prepared, 5)  # type: ignore[arg-type]
    assert plain.routed_experts_slot_mapping_device.tolist() == list(range(100, 116))  # nothing to correct


def test_the_shm_generation_refuses_a_misplaced_snapshot() -> None:
    with pytest.raises(UnsupportedVllmError, match="keys routed-experts rows by KV cache group 0's slots"):
        refuse_misplaced_slots(runner(ASCEND_V1, 1))
    refuse_misplaced_slots(runner(ASCEND_V1, 0))
    refuse_misplaced_slots(runner(VLLM_V1, 1))
