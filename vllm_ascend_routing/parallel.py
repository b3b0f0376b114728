# SPDX-License-Identifier: Apache-2.0
"""Which of the tokens an MoE layer routes are this rank's, under data parallel and token-split layouts.

Depending on where the MoE dispatches tokens, a layer's router sees one of:
  * ``local``: exactly this rank's tokens (dispatch after routing: all-to-all kernels, vllm-ascend's
    DP dispatch, a single engine);
  * ``all DP ranks``: every DP rank's tokens concatenated in rank order (vLLM's all-gather dispatch before
    routing): this rank's rows are the span after the lower ranks' counts;
  * ``all DP ranks' SP shards``: every DP rank's sequence-parallel shards, DP-major then TP (vLLM's naive
    DP+EP dispatch with a sequence-parallel MoE); the shard sizes include padding;
  * ``a TP shard``: this rank's tokens split over the tensor-parallel ranks before routing (sequence-parallel
    MoE; vllm-ascend MC2 / all-to-all / flash-comm): the ids are all-gathered over the TP group first.
``place`` decides from host-side counts only (vLLM's forward context keeps them on the CPU), so placing adds
no device synchronisation. Every rank's capture buffer then holds its own full step, row ``i`` = token ``i``.

Graph mode (``local_topk_ids``): the placement runs in the ``record_local_topk_ids`` op, which ``torch.compile``
keeps opaque, so a compiled graph runs it on every call with that call's counts. A CUDA/ACL graph is different:
the op's Python runs once, while the graph is captured, and every replay reuses the span it chose. A span is
therefore frozen into a graph only when it is a function of the captured token count alone: no DP counts, or DP
counts all equal (vLLM pads every DP rank to the graph's size whenever a graph runs, ``coordinate_batch_across_dp``,
so each replay of that graph has those same counts); the TP gather computes its rows on the device from the
gathered sizes at every replay. Anything else is refused at capture time (``GraphPlacementError``), and so is the
placement being traced into a graph by Dynamo instead of running in the op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class PlacementError(RuntimeError):
    """A layer routed a token count that matches no known layout: refusing beats wrong rows."""


class GraphPlacementError(PlacementError):
    """The placement would be frozen into a graph where a replay could need another span."""


@dataclass(frozen=True)
class RankLayout:
    """This engine's place in the parallel layout, fixed at load time."""

    dp_rank: int
    tp_size: int
    # Tokens split over TP before routing: vLLM's sequence-parallel MoE, or vllm-ascend's MC2 / all-to-all /
    # flash-comm (even without DP).
    split_over_tp: bool = False


@dataclass(frozen=True)
class Span:
    """Rows ``[start, start + length)`` of the routed ids (after the TP all-gather if ``gather_tp``) are
    this rank's tokens ``0 .. length-1``; ``length=None``: all of them (up to the buffer's rows)."""

    start: int
    length: int | None
    gather_tp: bool = False


def place(
    n: int,
    layout: RankLayout,
    counts: list[int] | None,
    shard_sizes: list[int] | None = None,
    capacity: int | None = None,
) -> Span:
    """Where this rank's rows are among ``n`` routed tokens.

    Args:
        n: tokens the router saw.
        counts: tokens per DP rank this step (vLLM's ``num_tokens_across_dp``), ``None`` without DP.
        shard_sizes: sequence-parallel shard sizes across the DP x TP group (padded), when vLLM set them.
        capacity: the most rows one TP shard can hold (``ceil(buffer rows / tp)``); a split layout whose
            router saw more than that saw the whole batch (e.g. vllm-ascend's EP all-gather under flash-comm).

    Raises:
        PlacementError: ``n`` fits none of the layouts.
    """
    tp = layout.tp_size
    split = layout.split_over_tp and tp > 1
    # A split layout gathers whenever its shard can be one: every TP rank decides alike (they share the
    # step, and a shard never exceeds ``capacity``). If the router in fact saw the whole batch, TP rank 0's
    # copy lands first, on rows 0..n-1, and the others' copies past the step's rows, which are never read.
    gather = split and (capacity is None or n <= capacity)
    if counts is None:  # no DP metadata: a single engine, or a DP=1 token split
        return Span(0, None, gather_tp=gather)
    local, total, widest = counts[layout.dp_rank], sum(counts), max(counts)
    if n == total:  # all DP ranks' tokens (also the case where the others have none)
        return Span(sum(counts[: layout.dp_rank]), local)
    # vLLM set the exact SP shard layout (it outranks the padded-gather guess below)
    if shard_sizes is not None and n == sum(shard_sizes) and len(shard_sizes) % len(counts) == 0:
        per_rank = len(shard_sizes) // len(counts)
        return Span(sum(shard_sizes[: layout.dp_rank * per_rank]), local)
    if n == widest * len(counts):  # all DP ranks' tokens, each padded to the widest (vllm-ascend all-gather)
        return Span(layout.dp_rank * widest, local)
    if gather:
        return Span(0, local, gather_tp=True)
    if n == local:
        return Span(0, local)
    raise PlacementError(
        f"vllm-ascend-routing: an MoE layer routed {n} tokens; none of this step's layouts fits (DP rank "
        f"{layout.dp_rank} has {local} of {total} tokens {counts}, TP size {tp}, SP shards {shard_sizes}). "
        "Report this layout; the rows would not be exact."
    )


def step_counts() -> tuple[list[int] | None, list[int] | None]:
    """This step's tokens per DP rank and SP shard sizes from vLLM's forward context (host-side lists)."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None, None
    metadata = getattr(get_forward_context(), "dp_metadata", None)
    if metadata is None:
        return None, None
    shards = getattr(metadata, "local_sizes", None)
    return metadata.num_tokens_across_dp_cpu.tolist(), None if shards is None else list(shards)


def tp_group_all_gather(block: torch.Tensor) -> torch.Tensor:
    """vLLM's TP-group all-gather along dim 0 (NCCL/HCCL on devices, graph-capturable)."""
    from vllm.distributed import get_tp_group

    return get_tp_group().all_gather(block, dim=0)


def gather_tp_shards(shard: torch.Tensor, tp_size: int, capacity: int, rows: int) -> torch.Tensor:
    """Every TP rank's shard, assembled in token order without a host synchronisation: ``[rows, K]``.

    Shards may differ in size (``torch.tensor_split`` of a batch that is not a multiple of TP), so each rank
    sends a fixed ``[capacity + 1, K]`` block: its size in row 0, then its ids, then zeros (a valid id). Row
    ``j`` of the result is then looked up on the device: the rank ``r`` whose span ``[sizes[0] + ... +
    sizes[r-1], ... + sizes[r])`` holds ``j``, its row ``j - start``. Rows past the gathered total read some
    valid gathered row: they lie past the step's tokens, which no one reads (as padding rows elsewhere).
    """
    import torch

    n, k = shard.shape
    if n > capacity:
        raise PlacementError(f"vllm-ascend-routing: a TP shard of {n} tokens exceeds the {capacity} a shard can hold.")
    block = shard.new_zeros((capacity + 1, k))
    block[0].fill_(n)
    block[1 : n + 1] = shard
    gathered = tp_group_all_gather(block).view(tp_size, capacity + 1, k)
    ends = torch.cumsum(gathered[:, 0, 0].to(torch.int64), 0)
    token = torch.arange(min(rows, tp_size * capacity), device=shard.device)
    rank = torch.searchsorted(ends, token, right=True).clamp_(max=tp_size - 1)
    start = torch.cat([ends.new_zeros(1), ends[:-1]])[rank]
    source = (rank * capacity + (token - start)).clamp_(0, tp_size * capacity - 1)
    return gathered[:, 1:].reshape(tp_size * capacity, k)[source]


def graph_capturing(device: torch.device) -> bool:
    """Whether ``device``'s current stream is capturing a graph (a CUDA graph; an ACL graph through torch_npu's
    ``torch.npu``, which has the same probe): what runs now is recorded once and replayed without running again.
    A query of the stream's capture state: no synchronisation."""
    if device.type == "cpu":
        return False
    import torch

    probe = getattr(getattr(torch, device.type, None), "is_current_stream_capturing", None)
    return bool(probe()) if callable(probe) else False


def _describe(layout: RankLayout, n: int, counts: list[int] | None, shards: list[int] | None) -> str:
    split = ", tokens split over TP" if layout.split_over_tp else ""
    return (
        f"DP rank {layout.dp_rank}, TP size {layout.tp_size}{split}; {n} routed tokens, DP counts {counts}, "
        f"SP shards {shards}"
    )


def check_graph_placement(
    device: torch.device, layout: RankLayout, n: int, counts: list[int] | None, shards: list[int] | None
) -> None:
    """Refuse a span that a graph capture would freeze although a replay of the same graph could need another:
    one that depends on more than the captured token count (DP counts not all equal)."""
    if counts is not None and len(set(counts)) > 1 and graph_capturing(device):
        raise GraphPlacementError(
            "vllm-ascend-routing: a graph is being captured with unequal DP token counts "
            f"({_describe(layout, n, counts, shards)}). "
            "The rows this rank records would be chosen from these counts once and reused by every replay, "
            "whatever that step's counts are. vLLM pads every DP rank to the graph's size whenever a graph runs, so "
            "this layout is one the plugin does not know: run with enforce_eager=True (or cudagraph_mode NONE) and "
            "report it."
        )


def local_topk_ids(topk_ids: torch.Tensor, layout: RankLayout, buffer_rows: int) -> torch.Tensor:
    """This rank's ids, token ``i`` at row ``i``, at most ``buffer_rows`` of them (a view unless gathered).

    Raises:
        GraphPlacementError: traced by Dynamo (the counts would be baked into the compiled code), or a graph
            capture would freeze a span that depends on more than the captured token count (module docstring).
    """
    import torch

    if torch.compiler.is_compiling():
        raise GraphPlacementError(
            f"vllm-ascend-routing: the parallel placement of routed ids ({layout}) is being traced by "
            "torch.compile: the step's DP counts would be baked into the compiled code. It must run in the "
            "record_local_topk_ids op (opaque to the compiler), which LayerCapture emits; call the op, not "
            "parallel.local_topk_ids."
        )
    capacity = -(-buffer_rows // layout.tp_size)
    counts, shards = step_counts()
    n = int(topk_ids.shape[0])
    check_graph_placement(topk_ids.device, layout, n, counts, shards)
    span = place(n, layout, counts, shards, capacity)
    if span.gather_tp:
        return gather_tp_shards(topk_ids, layout.tp_size, capacity, buffer_rows)
    end = topk_ids.shape[0] if span.length is None else span.start + span.length
    return topk_ids[span.start : min(end, span.start + buffer_rows)]
