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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class PlacementError(RuntimeError):
    """A layer routed a token count that matches no known layout: refusing beats wrong rows."""


@dataclass(frozen=True)
class RankLayout:
    """This engine's place in the parallel layout, fixed at load time."""

    dp_rank: int
    tp_size: int
    # vllm-ascend with MC2 / all-to-all / flash-comm: every MoE layer routes a TP shard, even without DP.
    split_over_tp: bool = False


@dataclass(frozen=True)
class Span:
    """Rows ``[start, start + length)`` of the routed ids (after the TP all-gather if ``gather_tp``) are
    this rank's tokens ``0 .. length-1``; ``length=None``: all of them (up to the buffer's rows)."""

    start: int
    length: int | None
    gather_tp: bool = False


def place(n: int, layout: RankLayout, counts: list[int] | None, shard_sizes: list[int] | None = None) -> Span:
    """Where this rank's rows are among ``n`` routed tokens.

    Args:
        n: tokens the router saw.
        counts: tokens per DP rank this step (vLLM's ``num_tokens_across_dp``), ``None`` without DP.
        shard_sizes: sequence-parallel shard sizes across the DP x TP group (padded), when vLLM set them.

    Raises:
        PlacementError: ``n`` fits none of the layouts.
    """
    tp = layout.tp_size
    if counts is None:  # no DP metadata: a single engine, or the dummy-free DP=1 case
        return Span(0, None, gather_tp=layout.split_over_tp and tp > 1)
    local = counts[layout.dp_rank]
    total = sum(counts)
    if n == total:  # all DP ranks' tokens (also the case where the others have none)
        return Span(sum(counts[: layout.dp_rank]), local)
    if n == local and not layout.split_over_tp:
        return Span(0, local)
    if shard_sizes is not None and n == sum(shard_sizes) and len(shard_sizes) % len(counts) == 0:
        per_rank = len(shard_sizes) // len(counts)
        return Span(sum(shard_sizes[: layout.dp_rank * per_rank]), local)
    if tp > 1 and n == -(-local // tp):
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


def tp_all_gather(topk_ids: torch.Tensor) -> torch.Tensor:
    """Concatenate every TP rank's shard in rank order (vLLM's TP group: NCCL/HCCL, graph-capturable)."""
    from vllm.distributed import get_tp_group

    return get_tp_group().all_gather(topk_ids, dim=0)


def local_topk_ids(topk_ids: torch.Tensor, layout: RankLayout) -> torch.Tensor:
    """This rank's rows of ``topk_ids``, token ``i`` at row ``i`` (a view unless gathered)."""
    counts, shards = step_counts()
    span = place(int(topk_ids.shape[0]), layout, counts, shards)
    ids = tp_all_gather(topk_ids) if span.gather_tp else topk_ids
    end = ids.shape[0] if span.length is None else span.start + span.length
    return ids[span.start : end]
