# SPDX-License-Identifier: Apache-2.0
"""The replay bridge: vLLM's ``routed_experts`` arrays to the tensors a trainer's routers replay.

For the trainer process; NumPy and torch only, never vLLM (the runtime plugin never imports this module).

    routes, valid = align(out.routed_experts, len(prompt_ids), len(output_ids))      # one per sample
    replay = to_megatron([(routes, valid), ...], moe_layers(hf_config), num_experts)  # packed (THD)
    set_model_targets(model, replay)                                                  # Megatron-Core

:func:`align` puts every generation's array on the token axis (row ``t`` = token ``t`` of
``prompt + output``), :func:`to_megatron` drops dense layers and packs samples into one `[N, top_k]` int64
tensor per MoE layer with a mask of the rows that hold recorded routing, and :func:`set_model_targets` hands
each of the model's own routers its layer's tensor, found by the router's ``layer_number``, with the rows
outside the mask left to the router's own top-k. :func:`check_alignment` compares the rows with the trainer's
own routing of the same tokens and refuses a shifted token axis before training. :func:`moe_layers` and
:func:`check` are validation mode's own (``vllm_ascend_routing.contract``).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from vllm_ascend_routing.contract import UnknownMoELayersError, Violation, from_device_cache, moe_layers
from vllm_ascend_routing.contract import check as _check

if TYPE_CHECKING:
    import torch

__all__ = [
    "AlignmentError",
    "Aligned",
    "MegatronReplay",
    "UnknownMoELayersError",
    "Violation",
    "align",
    "check",
    "from_device_cache",
    "check_alignment",
    "for_nemo_rl",
    "keep_native",
    "model_routers",
    "moe_layers",
    "recorded_routes",
    "set_model_targets",
    "to_megatron",
]

# vLLM's array dtype per generation: 0.20.x int32 (rows from token 0), 0.22+ uint8 / uint16 (from prompt_start).
_V020_DTYPES = (np.dtype(np.int32),)
_V022_DTYPES = (np.dtype(np.uint8), np.dtype(np.uint16))
INVALID = -1  # the id align() leaves in rows with no recorded routing: not an expert, any gather at it fails


class Aligned(NamedTuple):
    """One sample's routing on the token axis."""

    routes: np.ndarray  # [T, num_layers, top_k] int64; INVALID where ``valid`` is false
    valid: np.ndarray  # [T] bool: token t went through vLLM's model with a recorded row


# Where the token axis comes from, for the messages that refuse a misaligned one.
CONVENTION = (
    "row t must be token t of prompt + output: vLLM 0.22+ returns T-1-prompt_start rows starting at token "
    "routed_experts_prompt_start (verl and NeMo RL assume 0 and place row 0 at the first prompt token), "
    "vLLM 0.20.x T-1 rows from token 0; the last token has no row"
)


class AlignmentError(ValueError):
    """The rows do not line up with the trainer's tokens (a shifted token axis, another sample's rows)."""


class MegatronReplay(NamedTuple):
    """One `[N, top_k]` tensor per MoE layer for Megatron-Core's routers, and which rows hold recorded routing.

    ``indices`` is full, as stock Megatron's ``RouterReplay`` demands: rows without recorded routing (before
    ``prompt_start``, the last token, padding) hold distinct filler ids there, which a router must never
    replay. Hand them over with :func:`set_model_targets`, which keeps those rows on the router's own top-k;
    ``valid`` is the same mask in the form verl's ``RouterReplay.set_target_indices(idx, replay_mask=...)``
    takes, and :meth:`native_as` gives NeMo RL's form (the ids ``-1`` there).
    """

    indices: list[torch.Tensor]  # one [N, top_k] int64 per MoE layer, ascending layer order
    valid: torch.Tensor  # [N] bool: false on padding and on tokens without a recorded row (replay mask)
    layers: tuple[int, ...] = ()  # the model layer (0-based) of each tensor in ``indices``

    def native_as(self, fill: int = INVALID) -> list[torch.Tensor]:
        """``indices`` with ``fill`` (NeMo RL: -1, "route natively") in every row without recorded routing."""
        import torch

        keep = self.valid.view(-1, 1)
        return [torch.where(keep, ids, torch.full_like(ids, fill)) for ids in self.indices]


def align(routed: np.ndarray, prompt_len: int, output_len: int, prompt_start: int = 0) -> Aligned:
    """Put one request's ``routed_experts`` on the token axis of ``prompt + output`` (``T`` tokens).

    The array's generation is told by its dtype, as vLLM returns it: int32 (vLLM 0.20.x) holds ``T - 1``
    rows from token 0; uint8 / uint16 (0.22+) hold ``T - 1 - prompt_start`` rows from token
    ``prompt_start``. The last token never went through the model and has no row.

    Args:
        routed: `[rows, num_layers, top_k]` ``CompletionOutput.routed_experts``, unconverted.
        prompt_len: ``len(prompt_token_ids)``.
        output_len: ``len(output.token_ids)``.
        prompt_start: ``SamplingParams.routed_experts_prompt_start`` (0.22+ only).

    Returns:
        ``(routes, valid)``: routes `[T, num_layers, top_k]` int64, ``INVALID`` (-1) in rows without a
        recorded row; valid `[T]` bool, false before ``prompt_start`` and on the last token.

    Raises:
        ValueError: the array matches no generation's contract for these lengths; the message names
            the row count expected.
    """
    routed = np.asarray(routed)
    num_tokens = int(prompt_len) + int(output_len)
    if prompt_len < 0 or output_len < 0 or num_tokens < 1:
        raise ValueError(f"prompt_len={prompt_len}, output_len={output_len}: a request has at least one token")
    if not 0 <= prompt_start < num_tokens:
        raise ValueError(f"prompt_start={prompt_start} outside [0, {num_tokens}) for {num_tokens} tokens")
    new_rows = num_tokens - 1 - prompt_start
    expected = (
        f"vLLM 0.20.x: int32 with T-1 = {num_tokens - 1} rows, or vLLM 0.22+: uint8/uint16 with "
        f"T-1-prompt_start = {new_rows} rows (T = {prompt_len} prompt + {output_len} output tokens)"
    )
    if routed.ndim != 3:
        raise ValueError(f"routed_experts of shape {routed.shape}: expected [rows, num_layers, top_k]; {expected}")
    if routed.dtype in _V020_DTYPES:
        if prompt_start:
            raise ValueError(
                f"an int32 array is vLLM 0.20.x's, which has no prompt_start (got {prompt_start}): "
                f"expected T-1 = {num_tokens - 1} rows from token 0"
            )
        first, rows = 0, num_tokens - 1
    elif routed.dtype in _V022_DTYPES:
        first, rows = prompt_start, new_rows
    else:
        raise ValueError(f"routed_experts of dtype {routed.dtype}: pass the array as vLLM returned it; {expected}")
    if routed.shape[0] != rows:
        raise ValueError(
            f"routed_experts has {routed.shape[0]} rows of dtype {routed.dtype}; {expected} "
            "(a prompt_start other than the request's, or rows another layer already cut or padded)"
        )
    routes = np.full((num_tokens, *routed.shape[1:]), INVALID, dtype=np.int64)
    routes[first : first + rows] = routed
    valid = np.zeros(num_tokens, dtype=bool)
    valid[first : first + rows] = True
    return Aligned(routes, valid)


def check(
    routed: np.ndarray,
    num_experts: int,
    moe_layers: Sequence[int] | None,
    *,
    valid: np.ndarray | None = None,
    expected_rows: int | None = None,
    limit: int = 5,
    zero_experts: int = 0,
) -> list[Violation]:
    """Rows that break the contract: validation mode's rules (``contract.check``), for a trainer.

    Ids in ``[0, num_experts + zero_experts)`` (zero experts, e.g. LongCat-Flash's, follow the routed ones:
    ``contract.zero_experts(hf_config)``) and distinct within a MoE-layer row, dense-layer rows zero, no MoE layer
    all zero across the rows. Works on vLLM's array or on :func:`align`'s ``routes`` (pass its ``valid``:
    rows without recorded routing are not checked). Empty list: the rows are fit to replay.
    """
    return _check(
        np.asarray(routed),
        num_experts=num_experts,
        moe_layers=moe_layers,
        valid=valid,
        expected_rows=expected_rows,
        limit=limit,
        zero_experts=zero_experts,
    )


def to_megatron(
    samples: Sequence[tuple[np.ndarray, np.ndarray]],
    moe_layers: Sequence[int],
    num_experts: int,
    pad_to: int | None = None,
    zero_experts: int = 0,
) -> MegatronReplay:
    """Pack aligned samples into Megatron-Core's replay tensors: one per MoE layer, dense layers dropped.

    Samples are concatenated in order, as a packed (THD) batch; with ``pad_to`` each sample is padded at its
    end to a multiple of ``pad_to`` tokens (Megatron pads every packed sequence to a multiple of
    ``tp_size * cp_size * 2`` under context parallelism, ``tp_size`` under sequence parallelism). Padding
    rows and rows without recorded routing get distinct filler ids (row ``n``: ``(n * top_k + j) %
    num_experts``), never a row of zeros: a repeated id breaks Megatron's token dispatch. ``valid`` marks
    the recorded rows, for trainers that route natively elsewhere. Pipeline stages, TP/SP/CP splits and
    MTP routers are the caller's: Megatron's ``set_replay_data`` wants exactly one tensor per router.

    Args:
        samples: :func:`align` results ``(routes [T_i, num_layers, top_k], valid [T_i])``.
        moe_layers: layer indices with a router (:func:`moe_layers` of the model's config).
        num_experts: routed experts per MoE layer.
        pad_to: pad each sample to a multiple of this many tokens.
        zero_experts: the model's zero experts (``contract.zero_experts(hf_config)``): their ids
            ``[num_experts, num_experts + zero_experts)`` are replayed as recorded; filler ids stay routed experts.

    Raises:
        ValueError: shapes disagree, or a recorded row breaks the contract (:func:`check`'s per-row rules).
    """
    import torch

    layers = sorted(set(moe_layers))
    if not samples:
        raise ValueError("no samples")
    if pad_to is not None and pad_to < 1:
        raise ValueError(f"pad_to={pad_to}: expected a positive token count")
    shape = np.shape(samples[0][0])[1:]
    if len(shape) != 2 or not layers or layers[0] < 0 or layers[-1] >= shape[0]:
        raise ValueError(f"routes of shape [T, *{shape}]: expected [T, num_layers, top_k] holding MoE layers {layers}")
    top_k = int(shape[1])
    if top_k > num_experts:
        raise ValueError(f"top_k {top_k} > num_experts {num_experts}: no row of distinct ids exists")
    blocks: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    for i, (routes, valid) in enumerate(samples):
        routes, valid = np.asarray(routes), np.asarray(valid, dtype=bool)
        if routes.shape[1:] != shape or valid.shape != routes.shape[:1]:
            raise ValueError(f"sample {i}: routes {routes.shape} and valid {valid.shape}; expected [T, *{shape}], [T]")
        problems = _check(
            routes,
            num_experts=num_experts,
            moe_layers=layers,
            valid=valid,
            whole_request=False,
            zero_experts=zero_experts,
        )
        if problems:
            raise ValueError(f"sample {i} breaks the routed-experts contract: " + "; ".join(map(str, problems)))
        length = routes.shape[0] if pad_to is None else -(-routes.shape[0] // pad_to) * pad_to
        block = np.zeros((length, len(layers), top_k), dtype=np.int64)
        block[: routes.shape[0]] = routes[:, layers]
        mask = np.zeros(length, dtype=bool)
        mask[: routes.shape[0]] = valid
        blocks.append(block)
        masks.append(mask)
    packed, valid_all = np.concatenate(blocks), np.concatenate(masks)
    filler = (np.arange(packed.shape[0])[:, None] * top_k + np.arange(top_k)) % num_experts  # [N, top_k]
    packed[~valid_all] = filler[~valid_all][:, None, :]
    indices = [torch.from_numpy(np.ascontiguousarray(packed[:, j])) for j in range(len(layers))]
    return MegatronReplay(indices, torch.from_numpy(valid_all), tuple(layers))


def for_nemo_rl(aligned: Aligned | tuple[np.ndarray, np.ndarray], num_experts: int) -> np.ndarray:
    """One sample in NeMo RL's form: `[T-1, num_layers, top_k]`, row ``t`` = token ``t``, ``-1`` (its missing-route
    sentinel: route natively) in rows without recorded routing, in its carry dtype for ``num_experts`` (the
    narrowest signed integer holding ``num_experts - 1``: int8, int16, int32).

    NeMo RL reads vLLM's array from token 0; with ``routed_experts_prompt_start > 0`` it would take row 0 for
    token 0. This puts the rows at their tokens and the prompt rows before ``prompt_start`` on native routing.
    A signed dtype also spares NeMo RL's conversion the uint16 arrays (more than 256 experts) it fails on.
    """
    routes, valid = np.asarray(aligned[0]), np.asarray(aligned[1], dtype=bool)
    dtype = next(d for d in (np.int8, np.int16, np.int32) if num_experts - 1 <= np.iinfo(d).max)
    rows = routes[:-1].copy()
    rows[~valid[:-1]] = INVALID
    if rows.size and (rows.max() >= num_experts or rows[valid[:-1]].min(initial=0) < 0):
        raise ValueError(f"an expert id outside [0, {num_experts}) in the recorded rows")
    return rows.astype(dtype)


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
    token axis: split ``data`` first as the tokens are split (TP/SP/CP), as for ``RouterReplay.set_replay_data``.
    Set the replay action on the same routers (``router.router_replay.set_router_replay_action``).

    Raises:
        ValueError: the model has no replaying router, a router's layer has no rows in ``data`` (the MoE layers
            were read from another config), or two routers claim one layer.
    """
    if not data.layers:
        raise ValueError("MegatronReplay without layers: build it with to_megatron")
    position = {layer: j for j, layer in enumerate(data.layers)}
    routers = model_routers(model)
    if not routers:
        raise ValueError("the model has no Megatron TopKRouter: nothing to replay")
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
        _set_targets(router.router_replay, data.indices[position[layer]], mask)
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
    backward list. Costs one native top-k per routed forward, on the scores the router computed anyway.
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
            ids = router_replay.target_topk_idx if action == "replay_forward" else None
            if action == "replay_backward" and router_replay.replay_backward_list:
                ids = router_replay.replay_backward_list[0]  # the one the class's method pops
            mask = None if ids is None else state.mask_for(ids)
            probs, top = replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
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
    if len(recorded) != len(data.indices):
        raise ValueError(f"{len(recorded)} recorded tensors for {len(data.indices)} MoE layers")
    valid = data.valid.detach().cpu().numpy().astype(bool)
    ours = [np.sort(ids.detach().cpu().numpy(), axis=1) for ids in data.indices]
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
