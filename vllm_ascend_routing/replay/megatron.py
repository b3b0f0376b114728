# SPDX-License-Identifier: Apache-2.0
"""The Megatron-Core plumbing: the model's own routers by ``layer_number`` (:func:`model_routers`), handing
them their rows (:func:`set_model_targets`), the native fallback on a stock ``RouterReplay``
(:func:`keep_native`), and the shift check against the trainer's own routing (:func:`check_alignment`).

Megatron-Core is imported inside the functions that need it; never vLLM.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from vllm_ascend_routing.replay.aligned import CONVENTION, AlignmentError
from vllm_ascend_routing.replay.pack import MegatronReplay

if TYPE_CHECKING:
    import torch


def model_routers(model: Any) -> list[tuple[int, Any]]:
    """``(layer, router)`` for every ``TopKRouter`` of a Megatron model's decoder, ``layer`` counted from 0.

    ``model`` is a module (a ``GPTModel``, a ``TransformerBlock``, wrapped or not) or the list of its
    virtual-pipeline chunks. Walking the model reaches its own routers: Megatron's process-global
    ``RouterReplay`` list also holds a reference model's, a discarded decoder's and the MTP block's, so a
    position in that list can name another model's router. MTP routers (a module path through ``mtp``) are
    left out: vLLM records no MTP routing, and their layer numbers restart at 1. A pipeline stage's model
    holds its own layers only; ``layer_number`` is global, so each stage finds its own rows.
    """
    from megatron.core.transformer.moe.router import TopKRouter

    found: list[tuple[int, Any]] = []
    for chunk in model if isinstance(model, list | tuple) else [model]:
        for name, module in chunk.named_modules():
            if isinstance(module, TopKRouter) and "mtp" not in name.split("."):
                if module.layer_number is None:
                    raise ValueError(f"Megatron router {name} has no layer_number: build it inside a TransformerLayer")
                found.append((int(module.layer_number) - 1, module))
    return found


def set_model_targets(model: Any, data: MegatronReplay, *, native_rows: bool = True) -> list[int]:
    """Give each of ``model``'s routers its layer's rows, found by layer number; returns the layers set.

    Rows without recorded routing (``data.valid`` false) stay on the router's own top-k (``native_rows``):
    through ``set_target_indices(idx, replay_mask=...)`` where the router's ``RouterReplay`` takes a mask
    (verl's), else through :func:`keep_native` (stock Megatron-Core). The rows are the model's whole local
    token axis: build ``data`` with ``to_megatron(..., shard=Shard(...))`` for this rank's DP samples, CP and
    SP rows and pipeline layers (:class:`Shard`).
    Set the replay action on the same routers (``router.router_replay.set_router_replay_action``). Each
    layer's ids are widened to int64 on its router's device, one layer at a time.

    Raises:
        ValueError: the model has no replaying router, a router's layer has no rows in ``data`` (the MoE layers
            were read from another config), or two routers claim one layer.
    """
    import torch

    routers = model_routers(model)
    if not routers and not data.layers:
        return []  # a pipeline stage of dense layers only: its shard holds no layer either
    if not data.layers:
        raise ValueError("MegatronReplay without layers: build it with to_megatron")
    if not routers:
        raise ValueError("the model has no Megatron TopKRouter: nothing to replay")
    position = {layer: j for j, layer in enumerate(data.layers)}
    mask = data.valid if native_rows and not bool(data.valid.all()) else None
    done: list[int] = []
    for layer, router in routers:
        if router.router_replay is None:
            raise ValueError(f"the router of layer {layer} has no RouterReplay: set moe_enable_routing_replay=True")
        if layer in done:
            raise ValueError(f"two routers of the model are layer {layer}'s: pass one decoder (or its VPP chunks)")
        if layer not in position:
            raise ValueError(
                f"the model routes layer {layer} (Megatron layer_number {layer + 1}) but the rows hold MoE layers "
                f"{list(data.layers)}: read moe_layers from the config the model was built from"
            )
        device = next(iter(router.parameters()), torch.empty(0)).device  # where the router gathers
        _set_targets(router.router_replay, data.layer(position[layer], device), mask)
        done.append(layer)
    return sorted(done)


def _set_targets(router_replay: Any, indices: torch.Tensor, mask: torch.Tensor | None) -> None:
    if mask is None:
        router_replay.set_target_indices(indices)
    elif "replay_mask" in inspect.signature(router_replay.set_target_indices).parameters:
        router_replay.set_target_indices(indices, replay_mask=mask)
    else:
        router_replay.set_target_indices(indices)
        keep_native(router_replay, indices, mask)


class _NativeRows:
    """The masks :func:`keep_native` attached to one ``RouterReplay``, by the tensor of ids they belong to."""

    def __init__(self) -> None:
        self.masks: list[tuple[torch.Tensor, torch.Tensor]] = []

    def mask_for(self, indices: Any) -> torch.Tensor | None:
        return next((mask for ids, mask in self.masks if ids is indices), None)

    def prune(self, live: list[Any]) -> None:
        self.masks = [(ids, mask) for ids, mask in self.masks if any(ids is t for t in live)]


def keep_native(router_replay: Any, indices: torch.Tensor, mask: torch.Tensor) -> None:
    """Make a stock Megatron-Core ``RouterReplay`` route the rows of ``indices`` where ``mask`` is false with
    the router's own top-k (REPLAY_FORWARD and REPLAY_BACKWARD alike), replaying the others.

    Stock Megatron replays every row it is given; a row without recorded routing would run through the filler
    ids. ``indices`` must be the tensor just given to ``set_target_indices``: the mask follows it into the
    backward list (the one the class's method took off that list, compared before and after the call, so
    no pop order is assumed). Costs one native top-k per routed forward, on the scores the router computed
    anyway. Why an instance is wrapped here, outside ``patching``: docs/design.md.
    """
    state = router_replay.__dict__.get("_vllm_ascend_routing_native")
    if state is None:
        state = router_replay.__dict__["_vllm_ascend_routing_native"] = _NativeRows()
        replay_topk = router_replay.get_replay_topk  # the class's, bound

        def get_replay_topk(
            scores: torch.Tensor,
            topk: int,
            num_groups: int | None = None,
            group_topk: int | None = None,
            default_compute_topk: Any = None,
        ) -> tuple[torch.Tensor, torch.Tensor]:
            import torch

            action = getattr(router_replay.router_replay_action, "value", None)
            before = list(router_replay.replay_backward_list)
            probs, top = replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
            ids = router_replay.target_topk_idx if action == "replay_forward" else None
            if action == "replay_backward":
                ids = _taken(before, router_replay.replay_backward_list)
            mask = None if ids is None else state.mask_for(ids)
            state.prune([router_replay.target_topk_idx, *router_replay.replay_backward_list])
            if mask is None:
                return probs, top
            if mask.numel() != scores.shape[0]:
                raise AlignmentError(
                    f"a replay mask of {mask.numel()} rows for {scores.shape[0]} tokens: split the mask as the tokens"
                )
            _, native = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            top = torch.where(mask.to(scores.device).view(-1, 1), top, native)
            return scores.gather(1, top), top

        router_replay.get_replay_topk = get_replay_topk
    if mask.shape != indices.shape[:1]:
        raise AlignmentError(f"a replay mask of shape {tuple(mask.shape)} for ids of shape {tuple(indices.shape)}")
    state.masks.append((indices, mask.bool()))


def _taken(before: list[Any], after: list[Any]) -> Any:
    """The tensor the class's method took off the backward list (wherever it took it from), or None."""
    if len(after) != len(before) - 1:
        return None
    return next((b for b, a in zip(before, after, strict=False) if b is not a), before[-1])


def recorded_routes(model: Any, layers: Sequence[int]) -> list[torch.Tensor]:
    """The top-k each of ``model``'s routers recorded in its last RECORD forward, in the order of ``layers``."""
    recorded = {layer: router.router_replay.get_recorded_indices() for layer, router in model_routers(model)}
    missing = [layer for layer in layers if recorded.get(layer) is None]
    if missing:
        raise ValueError(f"no recorded routing for layers {missing}: run a forward with RouterReplayAction.RECORD")
    return [recorded[layer] for layer in layers]


def check_alignment(data: MegatronReplay, recorded: Sequence[torch.Tensor], min_agreement: float = 0.5) -> float:
    """Refuse rows that do not line up with the tokens: compare them with the trainer's own routing.

    ``recorded``: the trainer's top-k for the same packed tokens, one `[N, top_k]` per MoE layer in
    ``data.layers`` order (a forward with ``RouterReplayAction.RECORD``: :func:`recorded_routes`). A
    trainer's own routing agrees with inference's on most rows (about 98% in bfloat16 on the test model), and
    on few rows of a neighbouring token. Returns the share of recorded rows (token, MoE layer) whose top-k
    set equals the trainer's.

    Raises:
        AlignmentError: the rows agree better with the trainer's routing one token earlier or later, or on
            fewer than ``min_agreement`` of them; the message names the row convention.
    """
    if len(recorded) != len(data.ids):
        raise ValueError(f"{len(recorded)} recorded tensors for {len(data.ids)} MoE layers")
    valid = data.valid.detach().cpu().numpy().astype(bool)
    ours = [np.sort(data.layer(j).numpy(), axis=1) for j in range(len(data.ids))]
    theirs = [np.sort(np.asarray(r.detach().cpu().numpy(), dtype=np.int64), axis=1) for r in recorded]
    if any(t.shape != o.shape for t, o in zip(theirs, ours, strict=True)):
        raise AlignmentError(f"recorded routing of shape {theirs[0].shape} for rows of shape {ours[0].shape}")

    def agreement(shift: int) -> float:
        n = len(valid)
        rows = np.nonzero(valid)[0]
        rows = rows[(rows + shift >= 0) & (rows + shift < n)]
        if not len(rows):
            return 0.0
        same = [np.all(o[rows] == t[rows + shift], axis=1) for o, t in zip(ours, theirs, strict=True)]
        return float(np.mean(np.concatenate(same)))

    at = {shift: agreement(shift) for shift in (-1, 0, 1)}
    best = max(at, key=lambda shift: at[shift])
    if best != 0 or at[0] < min_agreement:
        raise AlignmentError(
            f"row t agrees with the trainer's own routing of token t on {at[0]:.1%} of rows, of token t-1 on "
            f"{at[-1]:.1%}, of token t+1 on {at[1]:.1%}: {CONVENTION}"
        )
    return at[0]
