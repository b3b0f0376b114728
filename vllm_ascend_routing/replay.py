# SPDX-License-Identifier: Apache-2.0
"""The replay bridge: vLLM's ``routed_experts`` arrays to the tensors a trainer's routers replay.

For the trainer process; NumPy and torch only, never vLLM (the runtime plugin never imports this module).

    samples = [align(out.routed_experts, len(prompt_ids), len(output_ids)) for ...]  # one per sample, no copy
    replay = to_megatron(samples, moe_layers(hf_config), num_experts, shard=...)    # packed (THD), this rank's
    set_model_targets(model, replay)                                                  # Megatron-Core

:func:`align` places a request's array on the token axis (row ``t`` = token ``t`` of ``prompt + output``)
without copying it; :func:`to_megatron` copies the rank's rows of its MoE layers, in a narrow dtype, into one
`[num_moe_layers, N, top_k]` block with a mask of the rows that hold recorded routing, and
:func:`set_model_targets` hands each of the model's own routers its layer's rows, found by the router's
``layer_number`` and widened to int64 on the router's device, with the rows outside the mask left to the
router's own top-k. :class:`Shard` names one trainer rank's part (DP samples, pipeline layers, CP and SP rows);
:class:`Conversation` and :func:`share_prompt` keep each row once across a multi-turn conversation and across
a GRPO group. :func:`check_alignment` compares the rows with the trainer's own routing of the same tokens and
refuses a shifted token axis before training. :func:`moe_layers` and :func:`check` are validation mode's own
(``vllm_ascend_routing.contract``).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from vllm_ascend_routing.contract import UnknownMoELayersError, Violation, from_device_cache, moe_layers
from vllm_ascend_routing.contract import check as _check

if TYPE_CHECKING:
    import torch

__all__ = [
    "ROW_CONTRACTS",
    "AlignmentError",
    "Aligned",
    "Conversation",
    "MegatronReplay",
    "RowContract",
    "Shard",
    "SharedPrompt",
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
    "share_prompt",
    "to_megatron",
]

INVALID = -1  # the id Aligned.routes leaves in rows with no recorded routing: not an expert, any gather at it fails


class RowContract(NamedTuple):
    """Where a generation's rows start, as vLLM documents its array (README, "Reading the array")."""

    releases: str
    takes_prompt_start: bool  # rows from SamplingParams.routed_experts_prompt_start; else always from token 0


# The array's dtype is part of vLLM's documented contract, one per generation (the plugin returns each
# generation's own): 0.20.x's shm array is int32, 0.22+'s uint8 up to 256 experts and uint16 above. A
# converted array has lost it, so its row convention can no longer be told and is refused.
ROW_CONTRACTS: dict[np.dtype[Any], RowContract] = {
    np.dtype(np.int32): RowContract("vLLM 0.20.x", takes_prompt_start=False),
    np.dtype(np.uint8): RowContract("vLLM 0.22+", takes_prompt_start=True),
    np.dtype(np.uint16): RowContract("vLLM 0.22+", takes_prompt_start=True),
}


class Aligned(NamedTuple):
    """One sample's routing on the token axis, held as vLLM returned it: its dtype, no copy.

    ``parts`` are consecutive blocks of rows (one for :func:`align`; a shared prompt and a response, or
    one per turn, for :func:`share_prompt` and :class:`Conversation`) holding tokens ``first`` to
    ``first + num_rows - 1``; the other tokens of the ``num_tokens`` have no recorded routing.
    """

    parts: tuple[np.ndarray, ...]  # each [rows_i, num_layers, top_k], vLLM's dtype
    first: int  # the token of the first row
    num_tokens: int  # T = prompt + output

    @property
    def num_rows(self) -> int:
        return sum(int(part.shape[0]) for part in self.parts)

    @property
    def valid(self) -> np.ndarray:
        """`[T]` bool: token t went through vLLM's model with a recorded row."""
        valid = np.zeros(self.num_tokens, dtype=bool)
        valid[self.first : self.first + self.num_rows] = True
        return valid

    @property
    def routes(self) -> np.ndarray:
        """`[T, num_layers, top_k]` int64, ``INVALID`` (-1) where ``valid`` is false: a widened copy (8x a uint8
        array) for inspection; :func:`to_megatron` never builds it."""
        shape = self.parts[0].shape[1:]
        routes = np.full((self.num_tokens, *shape), INVALID, dtype=np.int64)
        row = self.first
        for part in self.parts:
            routes[row : row + part.shape[0]] = part
            row += part.shape[0]
        return routes

    @property
    def nbytes(self) -> int:
        return sum(int(part.nbytes) for part in self.parts)


# Where the token axis comes from, for the messages that refuse a misaligned one.
CONVENTION = (
    "row t must be token t of prompt + output: vLLM 0.22+ returns T-1-prompt_start rows starting at token "
    "routed_experts_prompt_start (verl and NeMo RL assume 0 and place row 0 at the first prompt token), "
    "vLLM 0.20.x T-1 rows from token 0; the last token has no row"
)


class AlignmentError(ValueError):
    """The rows do not line up with the trainer's tokens (a shifted token axis, another sample's rows)."""


class MegatronReplay(NamedTuple):
    """The rows of each MoE layer for Megatron-Core's routers, and which rows hold recorded routing.

    ``ids`` stays narrow (uint8 up to 256 ids, int16 up to 32,768, else int32): :meth:`layer` widens one
    layer to the int64 Megatron's ``gather`` needs, on the device it is asked for, when the router takes it.
    Every row is full, as stock Megatron's ``RouterReplay`` demands: rows without recorded routing (before
    ``prompt_start``, the last token, padding) hold distinct filler ids, which a router must never replay.
    Hand them over with :func:`set_model_targets`, which keeps those rows on the router's own top-k;
    ``valid`` is the same mask in the form verl's ``RouterReplay.set_target_indices(idx, replay_mask=...)``
    takes, and :meth:`native_as` gives NeMo RL's form (the ids ``-1`` there).
    """

    ids: Any  # torch.Tensor [num_moe_layers, N, top_k] narrow, or a sequence of one [N, top_k] tensor per layer
    valid: torch.Tensor  # [N] bool: false on padding and on tokens without a recorded row (replay mask)
    layers: tuple[int, ...] = ()  # the model layer (0-based) of each entry of ``ids``

    def layer(self, j: int, device: Any = None) -> torch.Tensor:
        """Entry ``j``'s `[N, top_k]` ids as int64, made on ``device`` (moved narrow, then widened there)."""
        return self.ids[j].to(device=device).long()

    @property
    def indices(self) -> list[torch.Tensor]:
        """Every layer widened on the host (8x a uint8 block): for small batches and the positional
        ``RouterReplay.set_replay_data``; :func:`set_model_targets` widens one layer at a time instead."""
        return [self.layer(j) for j in range(len(self.ids))]

    def native_as(self, fill: int = INVALID, device: Any = None) -> list[torch.Tensor]:
        """The int64 ids with ``fill`` (NeMo RL: -1, "route natively") in every row without recorded routing."""
        import torch

        keep = self.valid.to(device=device).view(-1, 1)
        widened = (self.layer(j, device) for j in range(len(self.ids)))
        return [torch.where(keep, ids, torch.full_like(ids, fill)) for ids in widened]


class Shard(NamedTuple):
    """The part of a micro-batch one trainer rank routes, as Megatron-Core splits it.

    * data parallel: the samples are cut into ``dp_size`` contiguous equal chunks, the rank gets chunk
      ``dp_rank`` (Megatron's pretraining sampler, verl's ``DataProto.chunk``);
    * pipeline: ``layers``, the model layers (0-based) the rank's stage builds, every virtual-pipeline chunk
      together: ``[layer for layer, _ in model_routers(model)]``, or Megatron's own
      ``get_transformer_layer_offset`` and ``get_num_layers_to_build`` per ``vp_stage``; ``None``: all.
      MTP layers are never among them (vLLM records no MTP routing; ``model_routers`` leaves them out);
    * context parallel: each sample (padded to a multiple of ``2 * cp_size``) is cut into ``2 * cp_size``
      equal chunks and the rank gets chunks ``cp_rank`` and ``2 * cp_size - 1 - cp_rank`` (Megatron's
      load-balanced split: ``get_batch_on_this_cp_rank``, Transformer Engine's THD partition per sequence);
    * sequence parallel: ``tp_size`` > 1 cuts the rank's packed rows into ``tp_size`` equal blocks and
      keeps block ``tp_rank`` (the router sees its sequence-parallel share of the tokens). Without sequence
      parallelism every TP rank routes all its rows: leave ``tp_size`` at 1.

    ``pad_to`` of :func:`to_megatron` must be a multiple of ``2 * cp_size`` (CP) times ``tp_size`` (SP), as
    Megatron pads each packed sequence.
    """

    dp_rank: int = 0
    dp_size: int = 1
    layers: Sequence[int] | None = None
    cp_rank: int = 0
    cp_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1


def align(routed: np.ndarray, prompt_len: int, output_len: int, prompt_start: int = 0) -> Aligned:
    """Put one request's ``routed_experts`` on the token axis of ``prompt + output`` (``T`` tokens), uncopied.

    The array's generation is part of its documented contract (:data:`ROW_CONTRACTS`): int32 (vLLM
    0.20.x) holds ``T - 1`` rows from token 0; uint8 / uint16 (0.22+) hold ``T - 1 - prompt_start`` rows
    from token ``prompt_start``. The last token never went through the model and has no row.

    Args:
        routed: `[rows, num_layers, top_k]` ``CompletionOutput.routed_experts``, unconverted.
        prompt_len: ``len(prompt_token_ids)``.
        output_len: ``len(output.token_ids)``.
        prompt_start: ``SamplingParams.routed_experts_prompt_start`` (0.22+ only).

    Returns:
        :class:`Aligned` holding ``routed`` itself (its ``valid`` is false before ``prompt_start`` and on the
        last token; ``routes`` is the int64 form with ``INVALID`` there).

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
    contract = ROW_CONTRACTS.get(routed.dtype)
    if contract is None:
        raise ValueError(f"routed_experts of dtype {routed.dtype}: pass the array as vLLM returned it; {expected}")
    if prompt_start and not contract.takes_prompt_start:
        raise ValueError(
            f"an {routed.dtype} array is {contract.releases}'s, which has no prompt_start (got {prompt_start}): "
            f"expected T-1 = {num_tokens - 1} rows from token 0"
        )
    if routed.shape[0] != new_rows:
        raise ValueError(
            f"routed_experts has {routed.shape[0]} rows of dtype {routed.dtype}; {expected} "
            "(a prompt_start other than the request's, or rows another layer already cut or padded)"
        )
    return Aligned((routed,), int(prompt_start), num_tokens)


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
    samples: Sequence[Aligned | tuple[np.ndarray, np.ndarray]],
    moe_layers: Sequence[int],
    num_experts: int,
    pad_to: int | None = None,
    zero_experts: int = 0,
    *,
    shard: Shard | None = None,
) -> MegatronReplay:
    """Pack aligned samples into Megatron-Core's replay rows: MoE layers only, narrow, this rank's part only.

    Samples are concatenated in order, as a packed (THD) batch; with ``pad_to`` each sample is padded at its
    end to a multiple of ``pad_to`` tokens (Megatron pads every packed sequence to a multiple of
    ``tp_size * cp_size * 2`` under context parallelism, ``tp_size`` under sequence parallelism). Padding
    rows and rows without recorded routing get distinct filler ids (packed row ``n``: ``(n * top_k + j) %
    num_experts``, ``n`` counted over the rank's data-parallel samples before the CP/SP split, so a shard is
    row for row the slice of the whole), never a row of zeros: a repeated id breaks Megatron's token
    dispatch. ``valid`` marks the recorded rows, for trainers that route natively elsewhere.

    Only the rows and layers the result holds are read and copied: vLLM's arrays stay as they are, and
    the result is one narrow `[num_moe_layers, N, top_k]` block (:class:`MegatronReplay`); each layer is
    widened to int64 when a router takes it.

    Args:
        samples: :func:`align` results (or :func:`share_prompt`'s, :class:`Conversation`'s), or
            ``(routes [T_i, num_layers, top_k], valid [T_i])`` pairs in any integer dtype.
        moe_layers: layer indices with a router (:func:`moe_layers` of the model's config).
        num_experts: routed experts per MoE layer.
        pad_to: pad each sample to a multiple of this many tokens.
        zero_experts: the model's zero experts (``contract.zero_experts(hf_config)``): their ids
            ``[num_experts, num_experts + zero_experts)`` are replayed as recorded; filler ids stay routed experts.
        shard: this rank's part (:class:`Shard`); ``None``: every sample, layer and row.

    Raises:
        ValueError: shapes disagree, the shard does not divide the batch, or a recorded row breaks the
            contract (:func:`check`'s per-row rules).
    """
    import torch

    shard = shard or Shard()
    layers = sorted(set(moe_layers))
    if not samples:
        raise ValueError("no samples")
    if pad_to is not None and pad_to < 1:
        raise ValueError(f"pad_to={pad_to}: expected a positive token count")
    shape = _row_shape(samples[0])
    if len(shape) != 2 or not layers or layers[0] < 0 or layers[-1] >= shape[0]:
        raise ValueError(f"routes of shape [T, *{shape}]: expected [T, num_layers, top_k] holding MoE layers {layers}")
    top_k = int(shape[1])
    if top_k > num_experts:
        raise ValueError(f"top_k {top_k} > num_experts {num_experts}: no row of distinct ids exists")
    for name, rank, size in (("dp", shard.dp_rank, shard.dp_size), ("cp", shard.cp_rank, shard.cp_size)):
        if not 0 <= rank < size:
            raise ValueError(f"{name}_rank={rank} outside [0, {name}_size={size})")
    if not 0 <= shard.tp_rank < shard.tp_size:
        raise ValueError(f"tp_rank={shard.tp_rank} outside [0, tp_size={shard.tp_size})")
    if len(samples) % shard.dp_size:
        raise ValueError(f"{len(samples)} samples do not split into dp_size={shard.dp_size} equal chunks")
    per_rank = len(samples) // shard.dp_size
    first_sample = shard.dp_rank * per_rank
    ours = [_sample(first_sample + i, s, shape) for i, s in enumerate(samples[first_sample : first_sample + per_rank])]
    rank_layers = layers if shard.layers is None else [layer for layer in layers if layer in set(shard.layers)]
    segments = _rank_segments(ours, pad_to, shard)
    rows = sum(stop - start for _, start, stop, _ in segments)
    out = np.empty((len(rank_layers), rows, top_k), dtype=_narrow_dtype(num_experts + zero_experts))
    valid_out = np.zeros(rows, dtype=bool)
    dst = 0
    for sample, start, stop, packed_row in segments:
        mask = sample.valid_in(start, stop)
        for token, part in sample.blocks(start, stop):
            _check_rows(
                sample, part, token, mask[token - start : token - start + len(part)], layers, num_experts, zero_experts
            )
            at = dst + token - start
            for j, layer in enumerate(rank_layers):
                out[j, at : at + len(part)] = part[:, layer]
        valid_out[dst : dst + stop - start] = mask
        empty = np.nonzero(~mask)[0]
        n = (packed_row + empty)[:, None]
        filler = (n * top_k + np.arange(top_k)) % num_experts  # [rows without routing, top_k]
        out[:, dst + empty] = filler.astype(out.dtype)[None]
        dst += stop - start
    return MegatronReplay(torch.from_numpy(out), torch.from_numpy(valid_out), tuple(rank_layers))


_CHECK_IDS = 1 << 14  # ids per contract-check chunk: its int64 temporaries stay a few hundred KB


def _narrow_dtype(id_range: int) -> np.dtype[Any]:
    """The narrowest dtype torch widens natively that holds ids ``[0, id_range)``."""
    return np.dtype(next(d for d in (np.uint8, np.int16, np.int32) if id_range - 1 <= np.iinfo(d).max))


def _row_shape(sample: Aligned | tuple[np.ndarray, np.ndarray]) -> tuple[int, ...]:
    if isinstance(sample, Aligned):
        return tuple(np.shape(sample.parts[0])[1:])
    return tuple(np.shape(sample[0])[1:])


class _Sample(NamedTuple):
    """One sample as ``to_megatron`` reads it: row blocks from token ``first`` on, or one block and a mask."""

    number: int  # its position in the samples given
    parts: tuple[np.ndarray, ...]
    first: int
    num_tokens: int
    mask: np.ndarray | None  # [T] for (routes, valid) pairs; None: the rows of ``parts`` are the recorded ones

    def valid_in(self, start: int, stop: int) -> np.ndarray:
        """`[stop - start]` bool over tokens ``start..stop-1`` (padding beyond ``num_tokens``: false)."""
        valid = np.zeros(stop - start, dtype=bool)
        end = min(stop, self.num_tokens)
        if self.mask is not None:
            valid[: max(0, end - start)] = self.mask[start:end]
        else:
            rows = sum(len(part) for part in self.parts)
            lo, hi = max(start, self.first), min(end, self.first + rows)
            valid[max(0, lo - start) : max(0, hi - start)] = True
        return valid

    def blocks(self, start: int, stop: int) -> Iterator[tuple[int, np.ndarray]]:
        """``(token, rows)`` of the row blocks that fall in tokens ``start..stop-1``: views, never copies."""
        token = self.first
        for part in self.parts:
            lo, hi = max(start, token), min(stop, token + len(part))
            if lo < hi:
                yield lo, part[lo - token : hi - token]
            token += len(part)


def _sample(index: int, sample: Aligned | tuple[np.ndarray, np.ndarray], shape: tuple[int, ...]) -> _Sample:
    if isinstance(sample, Aligned):
        parts = tuple(np.asarray(part) for part in sample.parts)
        if any(part.ndim != 3 or part.shape[1:] != shape for part in parts):
            got = [part.shape for part in parts]
            raise ValueError(f"sample {index}: row blocks {got}; expected [rows, *{shape}]")
        if sample.first < 0 or sample.first + sum(map(len, parts)) > sample.num_tokens:
            raise ValueError(f"sample {index}: rows from token {sample.first} beyond its {sample.num_tokens} tokens")
        return _Sample(index, parts, int(sample.first), int(sample.num_tokens), None)
    routes, valid = np.asarray(sample[0]), np.asarray(sample[1], dtype=bool)
    if routes.shape[1:] != shape or valid.shape != routes.shape[:1]:
        raise ValueError(f"sample {index}: routes {routes.shape} and valid {valid.shape}; expected [T, *{shape}], [T]")
    return _Sample(index, (routes,), 0, len(routes), valid)


def _rank_segments(samples: list[_Sample], pad_to: int | None, shard: Shard) -> list[tuple[_Sample, int, int, int]]:
    """``(sample, first token, end token, packed row of the first token)`` of every run of rows the rank holds,
    in the rank's order: each sample's CP chunks ``cp_rank`` and ``2cp-1-cp_rank``, then the SP block."""
    unit = (2 * shard.cp_size if shard.cp_size > 1 else 1) * shard.tp_size
    local: list[tuple[_Sample, int, int, int]] = []
    packed = 0
    for sample in samples:
        length = sample.num_tokens if pad_to is None else -(-sample.num_tokens // pad_to) * pad_to
        if length % unit:
            raise ValueError(
                f"sample {sample.number}: {length} tokens (padded) do not split over cp_size={shard.cp_size} x "
                f"tp_size={shard.tp_size}: pass pad_to a multiple of {unit}, as Megatron pads each packed sequence"
            )
        if shard.cp_size > 1:
            chunk = length // (2 * shard.cp_size)
            for c in (shard.cp_rank, 2 * shard.cp_size - 1 - shard.cp_rank):
                local.append((sample, c * chunk, (c + 1) * chunk, packed + c * chunk))
        else:
            local.append((sample, 0, length, packed))
        packed += length
    if shard.tp_size == 1:
        return local
    total = sum(stop - start for _, start, stop, _ in local)
    lo, hi = total // shard.tp_size * shard.tp_rank, total // shard.tp_size * (shard.tp_rank + 1)
    kept, at = [], 0
    for sample, start, stop, row in local:
        a, b = max(lo, at), min(hi, at + stop - start)
        if a < b:
            kept.append((sample, start + a - at, start + b - at, row + a - at))
        at += stop - start
    return kept


def _check_rows(
    sample: _Sample,
    rows: np.ndarray,
    token: int,
    valid: np.ndarray,
    layers: list[int],
    num_experts: int,
    zero_experts: int,
) -> None:
    """The contract's per-row rules on ``rows`` (tokens from ``token``), a few hundred rows at a time."""
    step = max(1, _CHECK_IDS // max(1, rows.shape[1] * rows.shape[2]))
    for at in range(0, len(rows), step):
        problems = _check(
            rows[at : at + step],
            num_experts=num_experts,
            moe_layers=layers,
            valid=valid[at : at + step],
            whole_request=False,
            zero_experts=zero_experts,
        )
        if problems:
            where = [replace(p, row=None if p.row is None else p.row + token + at) for p in problems]
            raise ValueError(
                f"sample {sample.number} breaks the routed-experts contract: " + "; ".join(map(str, where))
            )


def for_nemo_rl(aligned: Aligned | tuple[np.ndarray, np.ndarray], num_experts: int) -> np.ndarray:
    """One sample in NeMo RL's form: `[T-1, num_layers, top_k]`, row ``t`` = token ``t``, ``-1`` (its missing-route
    sentinel: route natively) in rows without recorded routing, in its carry dtype for ``num_experts`` (the
    narrowest signed integer holding ``num_experts - 1``: int8, int16, int32).

    NeMo RL reads vLLM's array from token 0; with ``routed_experts_prompt_start > 0`` it would take row 0 for
    token 0. This puts the rows at their tokens and the prompt rows before ``prompt_start`` on native routing.
    A signed dtype also spares NeMo RL's conversion the uint16 arrays (more than 256 experts) it fails on.
    """
    dtype = next(d for d in (np.int8, np.int16, np.int32) if num_experts - 1 <= np.iinfo(d).max)
    if isinstance(aligned, Aligned):  # written in the carry dtype directly, never widened to int64
        out = np.full((aligned.num_tokens - 1, *aligned.parts[0].shape[1:]), INVALID, dtype=dtype)
        token = aligned.first
        for part in aligned.parts:
            part = part[: max(0, aligned.num_tokens - 1 - token)]  # the last token has no row in NeMo RL's form
            if part.size and (part.max() >= num_experts or part.min() < 0):
                raise ValueError(f"an expert id outside [0, {num_experts}) in the recorded rows")
            out[token : token + len(part)] = part
            token += len(part)
        return out
    routes, valid = np.asarray(aligned[0]), np.asarray(aligned[1], dtype=bool)
    rows = routes[:-1].copy()
    rows[~valid[:-1]] = INVALID
    if rows.size and (rows.max() >= num_experts or rows[valid[:-1]].min(initial=0) < 0):
        raise ValueError(f"an expert id outside [0, {num_experts}) in the recorded rows")
    return rows.astype(dtype)


class SharedPrompt(NamedTuple):
    """A GRPO group's rows with its prompt's rows held once: :func:`share_prompt`'s result.

    ``prompt_rows`` are tokens ``prompt_start .. prompt_len - 1`` (the last prompt token's row included: it
    was forwarded in the prefill), ``responses[i]`` sample ``i``'s rows after its prompt (tokens
    ``prompt_len .. T_i - 2``). Ship these instead of the n arrays; :meth:`sample` rebuilds sample ``i``
    for :func:`to_megatron` without a copy.
    """

    prompt_rows: np.ndarray  # [prompt_len - prompt_start, num_layers, top_k], vLLM's dtype
    responses: tuple[np.ndarray, ...]  # one [output_len_i - 1, num_layers, top_k] per sample
    prompt_len: int
    prompt_start: int = 0

    def sample(self, i: int) -> Aligned:
        response = self.responses[i]
        return Aligned((self.prompt_rows, response), self.prompt_start, self.prompt_len + len(response) + 1)

    @property
    def nbytes(self) -> int:
        """What shipping the group this way costs."""
        return int(self.prompt_rows.nbytes) + sum(int(r.nbytes) for r in self.responses)


def share_prompt(
    group: Sequence[np.ndarray], prompt_len: int, output_lens: Sequence[int], prompt_start: int = 0
) -> SharedPrompt:
    """Hold a GRPO group's shared prompt rows once: the n samples of one prompt, as vLLM returned them.

    Under prefix caching every sample of a prompt routes the prompt's tokens the same way, so its rows
    are the same n times; this keeps sample 0's and checks that every other sample's are identical.

    Args:
        group: each sample's ``routed_experts``, unconverted, for the same prompt.
        prompt_len: the prompt's token count.
        output_lens: each sample's ``len(output.token_ids)``.
        prompt_start: ``routed_experts_prompt_start`` the group was sampled with (0.22+).

    Raises:
        ValueError: a sample's array breaks :func:`align`'s contract, or its prompt rows differ from sample
            0's (not prefix-cached, or not the same prompt): the message names the sample, token and layer.
    """
    if not group or len(group) != len(output_lens):
        raise ValueError(f"{len(group)} arrays for {len(output_lens)} output lengths: one per sample, at least one")
    aligned = [align(routed, prompt_len, out, prompt_start) for routed, out in zip(group, output_lens, strict=True)]
    shared = prompt_len - prompt_start  # rows of tokens prompt_start .. prompt_len - 1
    if shared < 1:
        raise ValueError(f"prompt_start={prompt_start} leaves no prompt row of a {prompt_len}-token prompt to share")
    first = aligned[0].parts[0]
    prompt_rows = first[:shared]
    for i, sample in enumerate(aligned[1:], start=1):
        rows = sample.parts[0]
        if rows.dtype != first.dtype or rows.shape[1:] != first.shape[1:]:
            raise ValueError(
                f"sample {i}: {rows.dtype} {rows.shape[1:]} rows, sample 0 has {first.dtype} {first.shape[1:]}"
            )
        differ = np.nonzero((rows[:shared] != prompt_rows).any(axis=2))
        if len(differ[0]):
            token, layer = int(differ[0][0]) + prompt_start, int(differ[1][0])
            raise ValueError(
                f"sample {i}'s prompt rows differ from sample 0's ({len(differ[0])} (token, layer) rows, first at "
                f"token {token} layer {layer}): not one prompt served from the prefix cache; send its rows whole"
            )
    responses = tuple(sample.parts[0][shared:] for sample in aligned)
    return SharedPrompt(prompt_rows, responses, int(prompt_len), int(prompt_start))


class Conversation:
    """A multi-turn conversation's rows, each token's received once.

    Each turn re-sends the whole context; ask vLLM 0.22+ for the new rows only with
    ``SamplingParams(routed_experts_prompt_start=conversation.prompt_start)`` (or, with this plugin, the
    per-request ``routed_experts_omit``: ``conversation.prompt_start`` or ``"cached"``; then pass the start it
    reports, ``routed_experts_info["first_token"]``) and :meth:`add_turn` the array:

        conversation = Conversation()
        for turn in turns:
            params = SamplingParams(..., routed_experts_prompt_start=conversation.prompt_start)
            out = llm.generate(context, params)
            conversation.add_turn(out.routed_experts, len(context), len(out.token_ids), conversation.prompt_start)
        sample = conversation.aligned()   # the whole conversation, for to_megatron

    A token's row is the one recorded by the turn that first forwarded it (the turn that sampled it, for
    a response token), which is what that turn's log-probs came from: a turn whose rows start before the rows
    held (``"cached"`` starts at a KV block's first token) has its re-sent rows dropped. vLLM 0.20.x (int32
    arrays) has no ``prompt_start`` and returns every row every turn: pass ``prompt_start=0``; the rows already
    held are dropped here (what vLLM sends is not reduced, what the trainer keeps and ships is).
    """

    def __init__(self) -> None:
        self._parts: list[np.ndarray] = []
        self._num_tokens = 0

    @property
    def prompt_start(self) -> int:
        """The next turn's ``routed_experts_prompt_start``: the rows held (tokens 0 .. this - 1)."""
        return sum(len(part) for part in self._parts)

    def add_turn(self, routed: np.ndarray, prompt_len: int, output_len: int, prompt_start: int) -> int:
        """Add one turn's array (``prompt_len`` tokens of context, this turn's ``output_len``); returns the rows
        added.

        Raises:
            ValueError: the array breaks :func:`align`'s contract, ``prompt_start`` is past the rows held (a
                0.22+ turn missing rows), the context is shorter than the conversation so far, or the dtype or
                layers changed.
        """
        held = self.prompt_start
        if prompt_len < self._num_tokens:
            raise ValueError(
                f"a turn of {prompt_len} context tokens after a conversation of {self._num_tokens}: each turn's "
                "prompt is the whole conversation so far plus the new message"
            )
        aligned = align(routed, prompt_len, output_len, prompt_start)
        rows = aligned.parts[0]
        contract = ROW_CONTRACTS[rows.dtype]
        if self._parts and (rows.dtype != self._parts[0].dtype or rows.shape[1:] != self._parts[0].shape[1:]):
            raise ValueError(f"a turn of {rows.dtype} {rows.shape[1:]} rows after {self._parts[0].dtype} ones")
        if contract.takes_prompt_start:
            if prompt_start > held:
                raise ValueError(
                    f"a turn whose rows start at token {prompt_start}, but {held} rows are held: the rows of tokens "
                    f"{held}..{prompt_start - 1} were neither held nor sent; ask with at most "
                    f"conversation.prompt_start ({held})"
                )
            new = rows[held - prompt_start :]  # rows re-sent (prefix-cache omission starts at a block) are held
        else:
            new = rows[held:]  # 0.20.x: every row from token 0 again; keep the new ones
        self._parts.append(new)
        self._num_tokens = prompt_len + output_len
        return len(new)

    def aligned(self) -> Aligned:
        """The whole conversation on its token axis (its last turn's ``prompt + output``), without a copy."""
        if not self._parts:
            raise ValueError("a conversation without turns")
        return Aligned(tuple(self._parts), 0, self._num_tokens)

    @property
    def nbytes(self) -> int:
        return sum(int(part.nbytes) for part in self._parts)


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
    anyway. Why an instance is wrapped here, outside ``patching``: docs/architecture.md.
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
