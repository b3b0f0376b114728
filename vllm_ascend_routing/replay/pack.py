# SPDX-License-Identifier: Apache-2.0
"""Megatron-Core's replay rows: :func:`to_megatron` packs aligned samples (THD) into one narrow block of the
MoE layers with its mask, one trainer rank's part only (:class:`Shard`), checking each recorded row against the
contract a chunk of ids at a time.

NumPy and torch only, never vLLM (the runtime plugin never imports ``vllm_ascend_routing.replay``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from vllm_ascend_routing.contract import check as _check
from vllm_ascend_routing.replay.aligned import INVALID, Aligned
from vllm_ascend_routing.store.layout import StoredRows

if TYPE_CHECKING:
    import torch


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

    Only the rows and layers the result holds are read and copied (from a key: those bytes only are read from the
    store, one ranged read per layer and row run): vLLM's arrays stay as they are, and
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
            block: np.ndarray
            checked: list[int]
            taken: Sequence[int]
            if isinstance(part, StoredRows):  # a key: read the rank's layers of these tokens only
                block, checked, taken = part.read(rank_layers), list(range(len(rank_layers))), range(len(rank_layers))
            else:
                block, checked, taken = part, layers, rank_layers
            valid = mask[token - start : token - start + len(block)]
            _check_rows(sample, block, token, valid, checked, num_experts, zero_experts)
            at = dst + token - start
            for j, layer in enumerate(taken):
                out[j, at : at + len(block)] = block[:, layer]
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
    parts: tuple[Any, ...]  # np.ndarray, or StoredRows (a key: read a slice at a time)
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

    def blocks(self, start: int, stop: int) -> Iterator[tuple[int, Any]]:
        """``(token, rows)`` of the row blocks that fall in tokens ``start..stop-1``: views, never copies."""
        token = self.first
        for part in self.parts:
            lo, hi = max(start, token), min(stop, token + len(part))
            if lo < hi:
                yield lo, part[lo - token : hi - token]
            token += len(part)


def _sample(index: int, sample: Aligned | tuple[np.ndarray, np.ndarray], shape: tuple[int, ...]) -> _Sample:
    if isinstance(sample, Aligned):
        parts = tuple(part if isinstance(part, StoredRows) else np.asarray(part) for part in sample.parts)
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
