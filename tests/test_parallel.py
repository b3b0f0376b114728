# SPDX-License-Identifier: Apache-2.0
"""Row placement under data parallel and token-split layouts (``vllm_ascend_routing.parallel``), and the
``record_local_topk_ids`` op that applies it: each rank's buffer gets exactly its own tokens, row i = token i."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch

from vllm_ascend_routing import parallel
from vllm_ascend_routing.capture import LayerCapture, new_error_counter
from vllm_ascend_routing.parallel import PlacementError, RankLayout, Span, place


@pytest.mark.parametrize("counts", [[5, 1, 9], [1, 1, 1], [7, 3, 2], [0, 4, 6]])
def test_all_ranks_tokens_gathered_before_routing(counts: list[int]) -> None:
    """vLLM's naive dispatch: the router sees every DP rank's tokens, in rank order, uneven counts."""
    for rank in range(len(counts)):
        span = place(sum(counts), RankLayout(rank, 1), counts)
        assert span == Span(sum(counts[:rank]), counts[rank])


def test_local_routing_takes_every_row() -> None:
    assert place(9, RankLayout(1, 1), [5, 9]) == Span(0, 9)
    assert place(3, RankLayout(0, 2), None) == Span(0, None)  # single engine: no DP metadata


def test_padded_dp_batch_keeps_padding_past_the_real_tokens() -> None:
    """Padded DP batches (graph sizes): the counts include padding; this rank's rows come first and the
    padding rows after them are never shipped (the runner copies only the step's real tokens)."""
    assert place(16, RankLayout(1, 1), [8, 8]) == Span(8, 8)
    assert place(8, RankLayout(1, 1), [8, 8]) == Span(0, 8)


def test_tp_shard_is_gathered_and_its_padding_trimmed() -> None:
    """Sequence-parallel MoE: this rank's 7 tokens split ceil(7/2)=4 per TP rank before routing."""
    assert place(4, RankLayout(1, 2, split_over_tp=True), [3, 7]) == Span(0, 7, gather_tp=True)
    # A one-token rank splits into shards of one: the gather still runs (its shard equals its count).
    assert place(1, RankLayout(0, 2, split_over_tp=True), [1, 5]) == Span(0, 1, gather_tp=True)
    # vllm-ascend's DP all-gather: every DP rank padded to the widest before routing.
    assert place(18, RankLayout(1, 1), [9, 4]) == Span(9, 4)
    # Without DP (vllm-ascend MC2 / flash-comm at DP=1): gathered, the buffer keeps the step's rows.
    assert place(4, RankLayout(0, 2, split_over_tp=True), None) == Span(0, None, gather_tp=True)


def test_a_shard_as_large_as_a_shard_can_be_is_gathered() -> None:
    """``capacity``: the most rows one TP shard holds (``ceil(buffer rows / tp)``). A split layout whose router saw
    that many rows saw a shard and gathers; one that saw more saw the whole batch and records it as it is."""
    layout = RankLayout(0, 2, split_over_tp=True)
    assert place(4, layout, [7, 3], capacity=4) == Span(0, 7, gather_tp=True)
    assert place(3, layout, [7, 3], capacity=4) == Span(0, 7, gather_tp=True)
    assert place(10, layout, [7, 3], capacity=4) == Span(0, 7)  # every DP rank's tokens: this rank's come first
    assert place(4, layout, None, capacity=4) == Span(0, None, gather_tp=True)
    assert place(5, layout, None, capacity=4) == Span(0, None)


def test_sp_shards_of_all_ranks_gathered() -> None:
    """vLLM's naive DP+EP dispatch with a sequence-parallel MoE: shards DP-major, padded (ceil)."""
    counts, shards = [5, 3], [3, 3, 2, 2]
    assert place(10, RankLayout(1, 2, split_over_tp=True), counts, shards) == Span(6, 3)
    assert place(10, RankLayout(0, 2, split_over_tp=True), counts, shards) == Span(0, 5)


def test_unknown_count_is_refused() -> None:
    with pytest.raises(PlacementError, match="routed 6 tokens"):
        place(6, RankLayout(0, 1), [5, 3])


@pytest.fixture
def forward_context(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A stand-in for ``vllm.forward_context`` holding this step's DP counts."""
    state: dict[str, Any] = {"counts": None}
    module = types.ModuleType("vllm.forward_context")

    contexts: dict[tuple[int, ...], Any] = {}  # built once per step's counts, as vLLM builds it before the step

    def get_forward_context() -> Any:
        counts = state["counts"]
        if counts is None:
            return types.SimpleNamespace(dp_metadata=None)
        if tuple(counts) not in contexts:
            contexts[tuple(counts)] = types.SimpleNamespace(
                dp_metadata=types.SimpleNamespace(num_tokens_across_dp_cpu=torch.tensor(counts), local_sizes=None)
            )
        return contexts[tuple(counts)]

    module.get_forward_context = get_forward_context  # type: ignore[attr-defined]
    module.is_forward_context_available = lambda: True  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.forward_context", module)
    return state


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_capture_records_only_this_ranks_rows(forward_context: dict[str, Any], compiled: bool) -> None:
    """Through ``LayerCapture`` (the op every backend calls), eager and under ``torch.compile(fullgraph)``:
    the placement runs in the op at run time, so a compiled graph follows each step's counts."""
    buffer = torch.full((8, 2, 2), 99, dtype=torch.int16)
    capture = LayerCapture(buffer, 1, 64, new_error_counter("cpu"), RankLayout(1, 1))

    def moe(ids: torch.Tensor) -> torch.Tensor:
        capture(ids)
        return ids + 1

    run = torch.compile(moe, fullgraph=True, dynamic=True) if compiled else moe
    for counts in ([3, 5], [6, 2], [1, 1]):
        forward_context["counts"] = counts
        ids = torch.arange(sum(counts) * 2, dtype=torch.int32).reshape(-1, 2)
        run(ids)
        assert torch.equal(buffer[: counts[1], 1].to(torch.int32), ids[counts[0] :]), counts
    assert torch.equal(buffer[:, 0], torch.full((8, 2), 99, dtype=torch.int16))  # other layers untouched


def fake_tp_group(monkeypatch: pytest.MonkeyPatch, shards: list[torch.Tensor]) -> None:
    """vLLM's TP all-gather, as seen by one rank, when the TP ranks hold ``shards`` (same block format)."""

    def all_gather(block: torch.Tensor) -> torch.Tensor:
        blocks = []
        for shard in shards:
            other = block.new_zeros(block.shape)
            other[0] = shard.shape[0]
            other[1 : shard.shape[0] + 1] = shard
            blocks.append(other)
        return torch.cat(blocks)

    monkeypatch.setattr(parallel, "tp_group_all_gather", all_gather)


@pytest.mark.parametrize("tokens, tp", [(5, 2), (7, 4), (1, 2), (9, 3), (2, 4)])
def test_capture_assembles_uneven_tp_shards(
    forward_context: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tokens: int, tp: int
) -> None:
    """vllm-ascend's all-to-all split: ``torch.tensor_split`` of the batch (padded to TP when shorter), so
    shards differ in size; every TP rank's buffer gets the whole step in token order, padding dropped."""
    full = torch.arange(tokens * 2, dtype=torch.int32).reshape(tokens, 2) % 60
    padded = torch.cat([full, torch.full((max(tp - tokens, 0), 2), 63, dtype=torch.int32)])
    shards = list(torch.tensor_split(padded, tp))
    fake_tp_group(monkeypatch, shards)
    for rank in range(tp):
        buffer = torch.full((16, 1, 2), -7, dtype=torch.int16)
        errors = new_error_counter("cpu")
        LayerCapture(buffer, 0, 64, errors, RankLayout(0, tp, split_over_tp=True))(shards[rank])
        assert torch.equal(buffer[:tokens, 0].to(torch.int32), full), (rank, buffer[:, 0])
        assert int(errors) == 0


def test_tp_gather_under_dp(forward_context: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """DP + TP split (MC2 padding to 6): this DP rank's 5 tokens land on rows 0-4 of every TP rank."""
    full = torch.arange(10, dtype=torch.int32).reshape(5, 2)
    padded = torch.cat([full, torch.zeros((1, 2), dtype=torch.int32)])
    shards = list(torch.tensor_split(padded, 2))
    fake_tp_group(monkeypatch, shards)
    forward_context["counts"] = [5, 9]
    for tp_rank in (0, 1):
        buffer = torch.full((8, 1, 2), -7, dtype=torch.int16)
        LayerCapture(buffer, 0, 64, new_error_counter("cpu"), RankLayout(0, 2, split_over_tp=True))(shards[tp_rank])
        assert torch.equal(buffer[:5, 0].to(torch.int32), full)


def test_tp_gather_adds_no_syncing_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """The assembly (sizes, spans, the lookup of every row) stays on the device: nothing waits for it."""
    from tests.test_hot_path import SYNCING, OpLog

    shards = list(torch.tensor_split(torch.arange(14, dtype=torch.int32).reshape(7, 2), 3))
    fake_tp_group(monkeypatch, shards)
    with OpLog() as log:
        ids = parallel.gather_tp_shards(shards[1], 3, 4, 12)
    assert not {op.split("::")[1] for op in log.ops} & SYNCING, log.ops
    assert torch.equal(ids[:7], torch.arange(14, dtype=torch.int32).reshape(7, 2))


def test_full_batch_seen_by_every_tp_rank_is_not_duplicated(
    forward_context: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A split layout whose router saw the whole batch on every TP rank (vllm-ascend's EP all-gather under
    flash-comm): small batches are gathered, TP rank 0's copy lands on the step's rows; large ones (more
    than a shard can hold) are recorded as they are."""
    small = torch.arange(6, dtype=torch.int32).reshape(3, 2)
    fake_tp_group(monkeypatch, [small, small])
    buffer = torch.zeros((8, 1, 2), dtype=torch.int16)
    LayerCapture(buffer, 0, 64, new_error_counter("cpu"), RankLayout(0, 2, split_over_tp=True))(small)
    assert torch.equal(buffer[:3, 0].to(torch.int32), small)
    large = torch.arange(14, dtype=torch.int32).reshape(7, 2)
    monkeypatch.setattr(parallel, "tp_group_all_gather", lambda block: pytest.fail("gathered a full batch"))
    LayerCapture(buffer, 0, 64, new_error_counter("cpu"), RankLayout(1, 2, split_over_tp=True))(large)
    assert torch.equal(buffer[:7, 0].to(torch.int32), large)


def test_placement_adds_no_syncing_op(forward_context: dict[str, Any]) -> None:
    """Hot path under DP: per layer one op, and inside it only a view of the routed ids and the record op,
    nothing that waits on a device (the counts are host-side lists)."""
    from tests.test_hot_path import SYNCING, OpLog
    from vllm_ascend_routing.ops._library import record_local_topk_ids

    buffer = torch.zeros((64, 3, 2), dtype=torch.int16)
    errors = new_error_counter("cpu")
    captures = [LayerCapture(buffer, layer, 16, errors, RankLayout(1, 1)) for layer in range(3)]
    forward_context["counts"] = [20, 12]
    ids = torch.randint(0, 16, (32, 2), dtype=torch.int32)
    captures[0](ids)  # the step's forward context exists before the MoE layers run
    with OpLog() as log:
        for capture in captures:
            capture(ids)
    assert log.ops == ["vllm_ascend_routing::record_local_topk_ids"] * 3
    with OpLog() as inner:  # what the op's implementation dispatches
        record_local_topk_ids(ids, buffer, 0, 16, errors, 1, 1, False)
    assert set(inner.ops) <= {"aten::slice", "vllm_ascend_routing::record_topk_ids"}, inner.ops
    assert inner.ops.count("vllm_ascend_routing::record_topk_ids") == 1
    assert not {op.split("::")[1] for op in log.ops + inner.ops} & SYNCING
    assert torch.equal(buffer[:12, 2].to(torch.int32), ids[20:])
