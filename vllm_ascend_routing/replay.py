# SPDX-License-Identifier: Apache-2.0
"""The replay bridge: vLLM's ``routed_experts`` arrays to the tensors a trainer's routers replay.

For the trainer process; NumPy and torch only, never vLLM (the runtime plugin never imports this module).

    routes, valid = align(out.routed_experts, len(prompt_ids), len(output_ids))      # one per sample
    replay = to_megatron([(routes, valid), ...], moe_layers(hf_config), num_experts)  # packed (THD)
    RouterReplay.set_replay_data(replay.indices)                                      # Megatron-Core

:func:`align` puts every generation's array on the token axis (row ``t`` = token ``t`` of
``prompt + output``), :func:`to_megatron` drops dense layers and packs samples into one `[N, top_k]` int64
tensor per MoE layer, with distinct filler ids where a row has no recorded routing. :func:`moe_layers` and
:func:`check` are validation mode's own (``vllm_ascend_routing.contract``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from vllm_ascend_routing.contract import UnknownMoELayersError, Violation, moe_layers
from vllm_ascend_routing.contract import check as _check

if TYPE_CHECKING:
    import torch

__all__ = [
    "Aligned",
    "MegatronReplay",
    "UnknownMoELayersError",
    "Violation",
    "align",
    "check",
    "moe_layers",
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


class MegatronReplay(NamedTuple):
    """What Megatron-Core's ``RouterReplay.set_replay_data`` takes, and where it holds recorded routing."""

    indices: list[torch.Tensor]  # one [N, top_k] int64 per MoE layer, ascending layer order
    valid: torch.Tensor  # [N] bool: false on padding and on tokens without a recorded row


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
        raise ValueError(f"routed_experts has {routed.shape[0]} rows of dtype {routed.dtype}; {expected}")
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
    return MegatronReplay(indices, torch.from_numpy(valid_all))
