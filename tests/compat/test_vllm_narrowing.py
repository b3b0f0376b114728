# SPDX-License-Identifier: Apache-2.0
"""vLLM's own transport narrows an invalid id (-1) exactly as ``tests/test_invalid_ids.py`` assumes: uint8 up
to 256 experts (-1 shows as 255, a real expert of a 256-expert model), else uint16 (65535). Runs vLLM's real
code of the installed release: ``RoutedExpertsManager`` (0.22-0.30) or ``snapshot_routing_data`` (0.31+)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from tests.test_invalid_ids import user_view

pytestmark = pytest.mark.vllm


def _config(num_experts: int) -> Any:
    hf = SimpleNamespace(model_type="tiny", num_hidden_layers=2, num_experts_per_tok=2, num_experts=num_experts)
    model = SimpleNamespace(
        get_total_num_hidden_layers=lambda: 2,
        get_num_experts=lambda: num_experts,
        get_num_experts_per_tok=lambda: 2,
        hf_text_config=hf,
    )
    return SimpleNamespace(
        model_config=model, parallel_config=SimpleNamespace(data_parallel_rank=0, tensor_parallel_size=1)
    )


def vllm_view(rows: np.ndarray, num_experts: int) -> np.ndarray:
    """``rows`` (int16, the plugin's buffer) after the installed vLLM's transport."""
    import torch
    from vllm.model_executor.layers.fused_moe import routed_experts_capturer as upstream

    if hasattr(upstream, "RoutedExpertsManager"):  # 0.22-0.30: the scheduler's slot store
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        spec = FullAttentionSpec(block_size=len(rows), num_kv_heads=1, head_size=8, dtype=torch.float32)
        kv_cache = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec)], num_blocks=1)
        manager = upstream.RoutedExpertsManager(_config(num_experts), kv_cache)
        manager.store_batch(rows, np.arange(len(rows)))
        return np.asarray(manager.get([0], len(rows)))
    capturer = upstream.RoutedExpertsCapturer(len(rows), _config(num_experts))  # 0.31+: the connector's snapshot
    capturer.device_buffer.copy_(torch.from_numpy(rows.astype(np.int32)))
    return capturer.snapshot_routing_data(len(rows)).numpy()


@pytest.mark.parametrize("num_experts", [255, 256, 300])
def test_vllms_transport_narrows_an_invalid_id_as_assumed(num_experts: int) -> None:
    from vllm_ascend_routing.compat import adapter as get_adapter

    if get_adapter().generation.value == "shm":
        pytest.skip("vLLM 0.20.x's transport is replaced by the plugin's store (tests/test_invalid_ids.py runs it)")
    rows = np.array([[[-1, 3], [num_experts - 1, 0]], [[2, -1], [1, 5]]], dtype=np.int16)
    shown = vllm_view(rows, num_experts)
    assert shown.tolist() == user_view("runner-output", rows, num_experts).tolist()
    assert int(shown[0, 0, 0]) == (255 if num_experts <= 256 else 65535)
