# SPDX-License-Identifier: Apache-2.0
"""Row placement under data parallel and token-split layouts (``vllm_ascend_routing.parallel``), and the
``record_local_topk_ids`` op that applies it: each rank's buffer gets exactly its own tokens, row i = token i."""

from __future__ import annotations

import re
import sys
import types
from dataclasses import dataclass
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
    """A stand-in for ``vllm.forward_context`` holding this step's DP counts (and SP shard sizes, if set)."""
    state: dict[str, Any] = {"counts": None, "shards": None}
    module = types.ModuleType("vllm.forward_context")

    contexts: dict[Any, Any] = {}  # built once per step's counts, as vLLM builds it before the step

    def get_forward_context() -> Any:
        counts, shards = state["counts"], state["shards"]
        if counts is None:
            return types.SimpleNamespace(dp_metadata=None)
        key = (tuple(counts), None if shards is None else tuple(shards))
        if key not in contexts:
            contexts[key] = types.SimpleNamespace(
                dp_metadata=types.SimpleNamespace(num_tokens_across_dp_cpu=torch.tensor(counts), local_sizes=shards)
            )
        return contexts[key]

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


# ---- graph mode: captured or compiled once, run again with other steps' counts ----


@dataclass(frozen=True)
class Step:
    """One forward of a layer on DP rank ``rank``: the ids its router saw and the rows this rank must record."""

    counts: list[int] | None
    routed: torch.Tensor  # what the router saw
    expected: torch.Tensor  # this rank's ids in token order
    shards: list[int] | None = None


def ids_of(rank: int, count: int, step: int) -> torch.Tensor:
    """Ids no other (rank, step) shares in any row: a stale or shifted span cannot match by chance."""
    base = 1000 * (step + 1) + 100 * rank
    return (base + torch.arange(count * 2, dtype=torch.int32).reshape(count, 2)) % 4096


def all_gathered(counts: list[int], rank: int, step: int) -> Step:
    """vLLM's naive dispatch: every DP rank's tokens in rank order."""
    parts = [ids_of(r, c, step) for r, c in enumerate(counts)]
    return Step(counts, torch.cat(parts), parts[rank])


def padded_gathered(counts: list[int], rank: int, step: int) -> Step:
    """vllm-ascend's all-gather: every rank padded to the widest (padding ids 4095)."""
    widest = max(counts)
    parts = [ids_of(r, c, step) for r, c in enumerate(counts)]
    routed = torch.cat([torch.cat([p, torch.full((widest - len(p), 2), 4095, dtype=torch.int32)]) for p in parts])
    return Step(counts, routed, parts[rank])


def local_only(counts: list[int], rank: int, step: int) -> Step:
    """An all-to-all dispatch after routing: the router saw this rank's tokens only."""
    mine = ids_of(rank, counts[rank], step)
    return Step(counts, mine, mine)


def sp_sharded(counts: list[int], rank: int, step: int, tp: int = 2) -> Step:
    """vLLM's naive DP+EP dispatch with a sequence-parallel MoE: every DP rank's tokens in ``tp`` shards of
    ``ceil(count / tp)`` (padded), DP-major then TP, the shard sizes set by vLLM (``local_sizes``)."""
    shards, parts = [], []
    for r, count in enumerate(counts):
        size = -(-count // tp)
        shards += [size] * tp
        mine = ids_of(r, count, step)
        parts.append(torch.cat([mine, torch.full((size * tp - count, 2), 4095, dtype=torch.int32)]))
    return Step(counts, torch.cat(parts), ids_of(rank, counts[rank], step), shards)


# Layout, rank, the steps' counts: the first step's counts are the ones the graph is compiled with; every later one
# has other counts, another token split, or padding (the uniform [8, 8] is a DP step padded to a graph size).
COMPILED_LAYOUTS = {
    "all_gather": (all_gathered, RankLayout(1, 1), [[3, 5], [6, 2], [8, 8], [0, 4], [4, 0], [1, 1], [7, 9]]),
    "padded_to_widest": (padded_gathered, RankLayout(1, 1), [[9, 4], [2, 7], [5, 5], [1, 6]]),
    "local": (local_only, RankLayout(0, 1), [[4, 7], [9, 2], [1, 1], [6, 3]]),
    "dp3_all_gather": (all_gathered, RankLayout(2, 1), [[2, 3, 4], [5, 1, 1], [3, 3, 3], [0, 0, 6]]),
    "sp_shards": (sp_sharded, RankLayout(1, 2, split_over_tp=True), [[5, 3], [2, 7], [4, 4], [9, 1]]),
}


def skip_all_guards(entries: list[Any]) -> list[bool]:
    return [False for _ in entries]


def compiled_as_vllm_compiles(fn: Any, compiles: list[int]) -> Any:
    """``torch.compile`` as vLLM 0.26-0.30 compile a model (``TorchCompileWithNoGuardsWrapper``): fullgraph, the token
    dimension marked dynamic on the first call, every guard dropped, so the code compiled for the first step's
    counts is reused for every later step without re-tracing. ``compiles`` counts the graphs compiled."""
    from torch._inductor.compile_fx import compile_fx

    def backend(graph: Any, example_inputs: Any) -> Any:
        compiles.append(1)
        return compile_fx(graph, example_inputs)

    return torch.compile(
        fn, fullgraph=True, dynamic=False, backend=backend, options={"guard_filter_fn": skip_all_guards}
    )


@pytest.mark.parametrize("name", list(COMPILED_LAYOUTS))
def test_compiled_once_then_run_with_other_counts(forward_context: dict[str, Any], name: str) -> None:
    """Compiled with one step's counts, run with others (DP counts, token splits, padding): every row of every step
    exact, from one compiled graph. The placement runs in the opaque op at run time, not in the traced code."""
    make, layout, steps = COMPILED_LAYOUTS[name]
    buffer = torch.full((32, 2, 2), -9, dtype=torch.int16)
    capture = LayerCapture(buffer, 1, 4096, new_error_counter("cpu"), layout)

    def moe(ids: torch.Tensor) -> torch.Tensor:
        capture(ids)
        return ids + 1

    compiles: list[int] = []
    run = compiled_as_vllm_compiles(moe, compiles)
    exact = 0
    for index, counts in enumerate(steps):
        step = make(counts, layout.dp_rank, index)
        forward_context["counts"], forward_context["shards"] = step.counts, step.shards
        buffer.fill_(-9)
        if index == 0:
            torch._dynamo.mark_dynamic(step.routed, 0)
        assert torch.equal(run(step.routed), step.routed + 1)
        rows = len(step.expected)
        assert torch.equal(buffer[:rows, 1].to(torch.int32), step.expected), (name, counts)
        assert bool((buffer[rows:, 1] == -9).all()) or layout.dp_rank == 0 and rows == len(step.routed)
        exact += rows
    assert len(compiles) == 1, f"{name}: compiled {len(compiles)} times; the test needs one graph for every step"
    assert exact == sum(c[layout.dp_rank] for c in steps)


def test_compiled_step_with_an_unknown_count_is_refused(forward_context: dict[str, Any]) -> None:
    """A count that fits no layout raises from the compiled graph at run time (never a guessed span)."""
    buffer = torch.zeros((16, 1, 2), dtype=torch.int16)
    capture = LayerCapture(buffer, 0, 4096, new_error_counter("cpu"), RankLayout(0, 1))
    run = compiled_as_vllm_compiles(lambda ids: capture(ids) or ids + 1, [])
    forward_context["counts"] = [5, 3]
    first = all_gathered([5, 3], 0, 0)
    torch._dynamo.mark_dynamic(first.routed, 0)
    run(first.routed)
    with pytest.raises(PlacementError, match="routed 6 tokens"):
        run(ids_of(0, 6, 1))


def test_placement_traced_by_the_compiler_is_refused(forward_context: dict[str, Any]) -> None:
    """The placement itself traced (called outside the op): the first step's counts would be baked into the code
    and reused with guards dropped; it refuses to be traced instead."""
    forward_context["counts"] = [3, 5]
    assert parallel.step_counts() == ([3, 5], None)  # the step's context exists before the forward, as in vLLM

    def traced(ids: torch.Tensor) -> torch.Tensor:
        return parallel.local_topk_ids(ids, RankLayout(1, 1), 16) + 0

    run = compiled_as_vllm_compiles(traced, [])
    with pytest.raises(Exception, match="being traced by torch.compile"):
        run(all_gathered([3, 5], 1, 0).routed)


@pytest.mark.parametrize(
    "counts, refused",
    [([3, 5], True), ([0, 4], True), ([8, 8], False), ([4, 4, 4], False), (None, False)],
)
def test_graph_capture_freezes_only_a_span_replays_share(
    forward_context: dict[str, Any], monkeypatch: pytest.MonkeyPatch, counts: list[int] | None, refused: bool
) -> None:
    """The rule for CUDA/ACL graph captures, on the CPU (the capture state stood in): unequal DP counts would freeze a
    span that a replay with other counts reuses, so the capture is refused, naming the layout; equal counts (vLLM's
    DP padding whenever a graph runs) or none give a span that depends on the captured token count alone."""
    monkeypatch.setattr(parallel, "graph_capturing", lambda device: True)
    forward_context["counts"] = counts
    step = all_gathered(counts, 1, 0) if counts else local_only([4, 4], 1, 0)
    buffer = torch.zeros((16, 1, 2), dtype=torch.int16)
    capture = LayerCapture(buffer, 0, 4096, new_error_counter("cpu"), RankLayout(1, 1))
    if refused:
        with pytest.raises(
            parallel.GraphPlacementError, match=r"unequal DP token counts .*DP counts " + re.escape(str(counts))
        ):
            capture(step.routed)
        assert not buffer.any()
    else:
        capture(step.routed)
        assert torch.equal(buffer[: len(step.expected), 0].to(torch.int32), step.expected)


def test_graph_capturing_asks_the_devices_own_stream_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """An ACL graph capture is seen through torch_npu's ``torch.npu.is_current_stream_capturing`` (stood in here: no
    torch_npu), a CUDA graph capture through ``torch.cuda``'s: each device's own probe, never another's; the CPU
    captures none."""
    capturing = {"npu": True, "cuda": False}
    npu = types.SimpleNamespace(is_current_stream_capturing=lambda: capturing["npu"])
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing["cuda"])
    ascend = types.SimpleNamespace(type="npu")  # torch.device("npu") exists only once torch_npu is imported
    assert parallel.graph_capturing(ascend) is True
    assert parallel.graph_capturing(torch.device("cuda")) is False
    capturing.update(npu=False, cuda=True)
    assert parallel.graph_capturing(ascend) is False
    assert parallel.graph_capturing(torch.device("cuda")) is True
    assert parallel.graph_capturing(torch.device("cpu")) is False


def captured(fn: Any) -> torch.cuda.CUDAGraph:
    """``fn()`` run once on a side stream (warm-up, as vLLM does before capturing), then captured in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


@pytest.mark.cuda
def test_cuda_graph_captured_once_replays_every_step_exactly(forward_context: dict[str, Any]) -> None:
    """DP rank 1 of 2, all-gather dispatch, captured once at the graph size 8 (vLLM pads both ranks to it whenever a
    graph runs: counts [8, 8] at capture and at every replay), replayed with other real token splits: each replay's
    rows are that step's, the padding rows after them never this rank's tokens."""
    buffer = torch.full((32, 2, 2), -9, dtype=torch.int16, device="cuda")
    capture = LayerCapture(buffer, 1, 4096, new_error_counter("cuda"), RankLayout(1, 1))
    routed = torch.zeros((16, 2), dtype=torch.int32, device="cuda")  # the graph's static input
    forward_context["counts"] = [8, 8]
    graph = captured(lambda: capture(routed))
    for step, real in enumerate([(3, 5), (8, 8), (7, 1), (0, 6), (2, 8)]):
        parts = [ids_of(rank, count, step) for rank, count in enumerate(real)]
        routed.copy_(torch.cat([torch.cat([p, torch.full((8 - len(p), 2), 4095, dtype=torch.int32)]) for p in parts]))
        buffer.fill_(-9)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(buffer[: real[1], 1].cpu().to(torch.int32), parts[1]), (step, real)


@pytest.mark.cuda
def test_cuda_graph_capture_with_unequal_dp_counts_is_refused(forward_context: dict[str, Any]) -> None:
    """A real CUDA stream capture (the probe, not a stand-in) with unequal DP counts: refused at capture, naming the
    layout, instead of a span every replay would reuse."""
    buffer = torch.zeros((16, 1, 2), dtype=torch.int16, device="cuda")
    capture = LayerCapture(buffer, 0, 4096, new_error_counter("cuda"), RankLayout(1, 1))
    routed = all_gathered([3, 5], 1, 0).routed.cuda()
    forward_context["counts"] = [3, 5]
    capture(routed)  # eager: placed by this step's counts
    torch.cuda.synchronize()
    assert torch.equal(buffer[:5, 0].cpu().to(torch.int32), ids_of(1, 5, 0))
    with pytest.raises(parallel.GraphPlacementError, match=r"unequal DP token counts .*DP counts \[3, 5\]"):
        captured(lambda: capture(routed))


@pytest.mark.cuda
def test_cuda_graph_tp_gather_follows_the_other_ranks_sizes(
    forward_context: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A TP-split layout captured once: TP rank 1's shard of 4 tokens is fixed by the graph, TP rank 0's size arrives
    in the gathered block at every replay (a static buffer here, as NCCL writes it); the rows are looked up on the
    device, so each replay assembles that step's tokens in order."""
    capacity = 4
    other = torch.zeros((capacity + 1, 2), dtype=torch.int32, device="cuda")  # TP rank 0's block
    monkeypatch.setattr(parallel, "tp_group_all_gather", lambda block: torch.cat([other, block]))
    buffer = torch.full((8, 1, 2), -9, dtype=torch.int16, device="cuda")
    capture = LayerCapture(buffer, 0, 4096, new_error_counter("cuda"), RankLayout(0, 2, split_over_tp=True))
    mine = torch.zeros((capacity, 2), dtype=torch.int32, device="cuda")
    graph = captured(lambda: capture(mine))
    for step, size in enumerate([4, 1, 3, 0]):
        first, second = ids_of(0, size, step), ids_of(1, capacity, step)
        other.zero_()
        other[0] = size
        other[1 : size + 1] = first.cuda()
        mine.copy_(second)
        buffer.fill_(-9)
        graph.replay()
        torch.cuda.synchronize()
        expected = torch.cat([first, second])
        assert torch.equal(buffer[: len(expected), 0].cpu().to(torch.int32), expected), (step, size)
