# SPDX-License-Identifier: Apache-2.0
"""Per-rank shards of the bridge's output against Megatron-Core's own splitting, on CPU tensors: each (DP, CP, SP)
rank's rows equal what Megatron's ``get_batch_on_this_cp_rank`` and sequence-parallel split give that rank of the
whole batch, and each pipeline stage's layers what Megatron assigns it (``tests/test_replay_megatron.py`` runs the
whole batch through Megatron's routers)."""

from __future__ import annotations

import importlib.util
import warnings
from unittest import mock

import numpy as np
import pytest
import torch

from tests.test_replay_megatron import pytestmark, vllm_request  # noqa: F401 (pytestmark: the same markers)
from vllm_ascend_routing import replay
from vllm_ascend_routing.replay import to_megatron

if importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None:
    with warnings.catch_warnings():  # Megatron warns at import that Transformer Engine and Apex are absent
        warnings.simplefilter("ignore")
        from megatron.core.transformer.transformer_config import TransformerConfig


class FakeGroup:
    """A process group as Megatron's split functions read it: its size and this rank's place."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def megatron_cp_split(rows: torch.Tensor, cp_rank: int, cp_size: int) -> torch.Tensor:
    """One sequence's rows `[P, ...]` as Megatron gives them to CP rank ``cp_rank`` (get_batch_on_this_cp_rank)."""
    import inspect

    from megatron.core.utils import get_batch_on_this_cp_rank

    extra = {"is_hybrid_cp": False} if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters else {}
    group = FakeGroup(cp_rank, cp_size)
    # 0.16 asks the group itself, 0.19 asks torch.distributed about it (a group it never created).
    with (
        mock.patch.object(torch.distributed, "get_world_size", lambda group=None: group.size()),
        mock.patch.object(torch.distributed, "get_rank", lambda group=None: group.rank()),
    ):
        batch = get_batch_on_this_cp_rank({"tokens": rows.unsqueeze(0)}, cp_group=group, **extra)
    out: torch.Tensor = batch["tokens"][0]
    return out


def megatron_sp_split(rows: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The rows TP rank ``tp_rank`` routes under sequence parallelism (scatter_to_sequence_parallel_region)."""
    from megatron.core.tensor_parallel.mappings import _split_along_first_dim

    out: torch.Tensor = _split_along_first_dim(rows, FakeGroup(tp_rank, tp_size))
    return out


SHARD_LAYOUTS = {
    # dp_size, cp_size, tp_size (sequence parallel), pad_to
    "cp2": (1, 2, 1, 4),
    "dp2_cp2": (2, 2, 1, 4),
    "cp4": (1, 4, 1, 8),
    "sp2": (1, 1, 2, 2),
    "dp2_cp2_sp2": (2, 2, 2, 8),
    "cp3_sp2": (1, 3, 2, 12),
}


@pytest.mark.parametrize("layout", SHARD_LAYOUTS)
def test_shard_rows_are_megatrons_cp_and_sp_split(layout: str, model_parallel: None) -> None:
    """Every (DP, CP, SP) rank's shard equals, row for row, Megatron's own split of the whole micro-batch:
    each sequence through get_batch_on_this_cp_rank, the packed rows through the sequence-parallel scatter."""
    dp_size, cp_size, tp_size, pad_to = SHARD_LAYOUTS[layout]
    moe, num_layers, num_experts, top_k = (0, 2, 3), 4, 16, 4
    rng = np.random.default_rng(7)
    lengths = [(7, 5, 0), (9, 3, 4), (2, 6, 0), (30, 11, 3)]  # prompt, output, prompt_start
    samples = [vllm_request(rng, p, o, num_layers, moe, num_experts, top_k, np.uint8, s).aligned for p, o, s in lengths]
    per_dp = len(samples) // dp_size
    compared = 0
    for dp_rank in range(dp_size):
        ours = samples[dp_rank * per_dp : (dp_rank + 1) * per_dp]  # contiguous DP chunks
        whole = to_megatron(ours, moe, num_experts, pad_to=pad_to)
        rows = torch.cat(
            [whole.ids.permute(1, 0, 2), whole.valid.view(-1, 1, 1).expand(-1, 1, top_k).to(torch.uint8)], 1
        )
        for cp_rank in range(cp_size):
            local, at = [], 0
            for sample in ours:
                padded = -(-sample.num_tokens // pad_to) * pad_to
                local.append(
                    megatron_cp_split(rows[at : at + padded], cp_rank, cp_size)
                    if cp_size > 1
                    else rows[at : at + padded]
                )
                at += padded
            for tp_rank in range(tp_size):
                want = megatron_sp_split(torch.cat(local), tp_rank, tp_size)
                shard = replay.Shard(dp_rank, dp_size, None, cp_rank, cp_size, tp_rank, tp_size)
                got = to_megatron(samples, moe, num_experts, pad_to=pad_to, shard=shard)
                assert got.layers == moe and tuple(got.ids.shape) == (len(moe), len(want), top_k)
                assert torch.equal(got.ids.permute(1, 0, 2), want[:, : len(moe)])
                assert torch.equal(got.valid, want[:, len(moe), 0].bool())
                compared += len(want)
    padded_total = sum(-(-(p + o) // pad_to) * pad_to for p, o, _ in lengths)
    assert compared == padded_total  # the ranks' shards cover the batch once


PIPELINE_LAYOUTS = {
    # num_layers, pp, vpp, layers in the first stage, in the last stage
    "pp4": (8, 4, None, None, None),
    "pp2_vpp2": (8, 2, 2, None, None),
    "pp4_uneven": (10, 4, None, 1, 3),
    "pp2_vpp2_uneven": (10, 3, 2, 2, 4),
}


@pytest.mark.parametrize("layout", PIPELINE_LAYOUTS)
def test_shard_layers_are_megatrons_pipeline_split(layout: str, model_parallel: None) -> None:
    """A pipeline stage's shard holds the MoE layers Megatron builds on it (get_transformer_layer_offset and
    get_num_layers_to_build per virtual-pipeline chunk), each equal to the whole batch's tensor of that layer."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    num_layers, pp, vpp, first, last = PIPELINE_LAYOUTS[layout]
    config = TransformerConfig(
        num_layers=num_layers,
        hidden_size=32,
        num_attention_heads=2,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        num_layers_in_first_pipeline_stage=first,
        num_layers_in_last_pipeline_stage=last,
        pipeline_dtype=torch.float32,
    )
    moe = tuple(layer for layer in range(num_layers) if layer % 4 != 1)  # dense layers 1, 5, 9
    rng = np.random.default_rng(8)
    samples = [vllm_request(rng, 6, 4, num_layers, moe, 8, 2, np.uint8, s).aligned for s in (0, 3)]
    whole = to_megatron(samples, moe, 8)
    seen: list[int] = []
    for pp_rank in range(pp):
        stage = [
            get_transformer_layer_offset(config, vp_stage=vp, pp_rank=pp_rank) + i
            for vp in (range(vpp) if vpp else [None])
            for i in range(get_num_layers_to_build(config, vp_stage=vp, pp_rank=pp_rank))
        ]
        seen += stage
        got = to_megatron(samples, moe, 8, shard=replay.Shard(layers=stage))
        assert got.layers == tuple(layer for layer in moe if layer in stage)
        for j, layer in enumerate(got.layers):
            assert torch.equal(got.ids[j], whole.ids[moe.index(layer)])
        assert torch.equal(got.valid, whole.valid)
    assert sorted(seen) == list(range(num_layers))  # the stages partition the decoder
