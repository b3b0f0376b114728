# SPDX-License-Identifier: Apache-2.0
"""The routed-experts array contract, shared by validation mode (front-end) and the replay bridge (trainer).

Which layers of a model are MoE (read from its Hugging Face config) and the rules every row obeys: ids in
``[0, num_experts)``, no id twice in a MoE row, dense-layer rows zero. NumPy only: importing this module
imports neither vLLM nor torch.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from vllm_ascend_routing import releases

# The config fields each family's MoE layout is read from, for the error message.
KNOWN_FAMILIES = (
    "Qwen2/3-MoE (decoder_sparse_step, mlp_only_layers), DeepSeek-V2/V3 and GLM-4-MoE (first_k_dense_replace, "
    "moe_layer_freq), Mixtral (num_local_experts), OLMoE (model_type 'olmoe')"
)
_EVERY_LAYER_MODEL_TYPES = ("olmoe",)  # MoE in every layer, no field that says so


class UnknownMoELayersError(ValueError):
    """The config belongs to no family whose MoE layers :func:`moe_layers` can read."""


def moe_layers(hf_config: Any, num_layers: int | None = None) -> tuple[int, ...]:
    """Indices of the decoder layers that have a router, in ascending order, as vLLM builds the model.

    Args:
        hf_config: the model's Hugging Face config (``AutoConfig.from_pretrained(...)``, vLLM's
            ``hf_text_config``); a multimodal config is read through its ``text_config``.
        num_layers: number of decoder layers; default ``hf_config.num_hidden_layers``.

    Raises:
        UnknownMoELayersError: the config is of no known MoE family (the message names them).
    """
    if num_layers is None:
        num_layers = getattr(hf_config, "num_hidden_layers", None)
    if hasattr(hf_config, "decoder_sparse_step") or hasattr(hf_config, "mlp_only_layers"):  # Qwen2/3-MoE
        step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
        dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
        if int(getattr(hf_config, "num_experts", 1) or 0) <= 0:
            return ()
        return tuple(i for i in range(_count(num_layers)) if i not in dense and (i + 1) % step == 0)
    if hasattr(hf_config, "first_k_dense_replace"):  # DeepSeek-V2/V3, GLM-4-MoE
        if hasattr(hf_config, "n_routed_experts") and hf_config.n_routed_experts is None:
            return ()
        first = int(hf_config.first_k_dense_replace or 0)
        freq = int(getattr(hf_config, "moe_layer_freq", 1) or 1)
        return tuple(i for i in range(_count(num_layers)) if i >= first and i % freq == 0)
    model_type = getattr(hf_config, "model_type", None)
    if hasattr(hf_config, "num_local_experts") or model_type in _EVERY_LAYER_MODEL_TYPES:  # Mixtral, OLMoE
        return tuple(range(_count(num_layers)))
    text_config = getattr(hf_config, "text_config", None)
    if text_config is not None and text_config is not hf_config:
        return moe_layers(text_config, num_layers)
    raise UnknownMoELayersError(
        f"cannot tell which layers are MoE from a config of model_type {model_type!r}: known families are "
        f"{KNOWN_FAMILIES}; pass the MoE layer indices yourself"
    )


def zero_experts(hf_config: Any) -> int:
    """Zero (identity) experts of a model (LongCat-Flash's ``zero_expert_num``; 0 for others). Their logical
    ids follow the routed experts': ``[num_experts, num_experts + zero_experts)``, recorded as what they are."""
    value = getattr(hf_config, "zero_expert_num", None)
    if value is None:
        text_config = getattr(hf_config, "text_config", None)
        value = getattr(text_config, "zero_expert_num", None) if text_config is not None else None
    return int(value or 0)


def _count(num_layers: Any) -> int:
    if num_layers is None:
        raise UnknownMoELayersError("the config has no num_hidden_layers; pass num_layers")
    return int(num_layers)


@dataclass(frozen=True)
class Violation:
    """One broken rule: what, and where (layer and row of the array, when it is about one)."""

    what: str
    layer: int | None = None
    row: int | None = None
    request_id: str | None = None

    def __str__(self) -> str:
        where = " ".join(
            f"{name} {value}"
            for name, value in (("request", self.request_id), ("layer", self.layer), ("row", self.row))
            if value is not None
        )
        return f"{where}: {self.what}" if where else self.what


def check(
    routed: np.ndarray,
    *,
    num_experts: int,
    moe_layers: Collection[int] | None,
    num_layers: int | None = None,
    expected_rows: int | None = None,
    valid: np.ndarray | None = None,
    whole_request: bool = True,
    limit: int = 5,
    zero_experts: int = 0,
) -> list[Violation]:
    """Contract violations of one request's rows (at most ``limit`` per rule), in rule order.

    Rules: row count (when ``expected_rows`` is given); dense-layer rows all zero; MoE-layer ids in
    ``[0, num_experts + zero_experts)``; no id twice in a MoE row; with ``whole_request``, no MoE layer all zero across
    the rows (what a bypassed router returns; a heuristic, meaningful on a whole request).

    Args:
        routed: `[rows, num_layers, top_k]`, any integer dtype.
        num_experts: the model's routed experts.
        moe_layers: layer indices with a router; ``None`` when unknown: every layer is checked as MoE and
            all-zero rows (which may be dense) are not taken as a repeated expert.
        num_layers: the model's layer count; default ``routed.shape[1]``.
        expected_rows: the row count the contract gives for this request.
        valid: `[rows]` bool; rows where it is false are not checked.
        zero_experts: the model's zero experts (``zero_experts(hf_config)``), ids after the routed ones.
    """
    if num_layers is None:
        num_layers = routed.shape[1] if routed.ndim == 3 else -1
    if routed.ndim != 3 or routed.shape[1] != num_layers:
        return [Violation(f"shape {routed.shape}, expected (rows, {num_layers}, top_k)")]
    found: list[Violation] = []
    if expected_rows is not None and routed.shape[0] != expected_rows:
        found.append(Violation(f"{routed.shape[0]} rows, expected {expected_rows}"))
    ids = routed.astype(np.int64)
    rows_checked = np.ones(ids.shape[0], dtype=bool) if valid is None else np.asarray(valid, dtype=bool)
    moe = sorted(moe_layers) if moe_layers is not None else list(range(num_layers))
    dense = [layer for layer in range(num_layers) if moe_layers is not None and layer not in moe]

    def each(bad: npt.ArrayLike, layers: list[int], what: str) -> list[Violation]:
        rows, columns = np.nonzero(np.asarray(bad) & rows_checked[:, None])
        return [Violation(what, layers[j], int(i)) for i, j in zip(rows[:limit], columns[:limit], strict=True)]

    if dense:
        found += each((ids[:, dense] != 0).any(axis=2), dense, "non-zero ids in a dense layer")
    moe_ids = ids[:, moe]
    id_range = num_experts + zero_experts
    found += each(((moe_ids < 0) | (moe_ids >= id_range)).any(axis=2), moe, f"id outside [0, {id_range})")
    ordered = np.sort(moe_ids, axis=2)
    repeated = (ordered[:, :, 1:] == ordered[:, :, :-1]).any(axis=2)
    if moe_layers is None:  # MoE and dense layers cannot be told apart: all-zero rows are skipped
        repeated &= (moe_ids != 0).any(axis=2)
    found += each(repeated, moe, "the same expert twice in one row")
    if whole_request and moe_layers is not None and rows_checked.any():
        zero = [moe[j] for j in np.nonzero((moe_ids[rows_checked] == 0).all(axis=(0, 2)))[0]]
        found += [Violation("MoE layer all zero across the request", layer) for layer in zero[:limit]]
    return found


def request_rows(output: Any, hf_config: Any, num_layers: int | None = None) -> np.ndarray | None:
    """One ``RequestOutput``'s routed experts on the decoder-layer axis: ``CompletionOutput.routed_experts`` as
    the release returns it, or, where the release returns the prompt's rows apart (:func:`prompt_rows_apart`: vLLM
    0.21.0), its two arrays joined from token 0 and widened (:func:`from_device_cache`). ``None``: no rows."""
    apart = prompt_rows_apart(output)
    if apart is None:
        return output.outputs[0].routed_experts  # type: ignore[no-any-return]
    prompt, generated = apart
    if prompt is None and generated is None:
        return None
    if num_layers is None:
        num_layers = int(hf_config.num_hidden_layers)
    return from_device_cache(prompt, generated, moe_layers(hf_config, num_layers), num_layers)


def prompt_rows_apart(output: Any) -> tuple[np.ndarray | None, np.ndarray | None] | None:
    """A ``RequestOutput``'s prompt rows and generated tokens' rows as returned, where its release returns them apart
    (a ``prompt_rows_field`` of the release table: vLLM 0.21.0's ``prompt_routed_experts``, both on the MoE-layer
    axis); ``None`` where ``CompletionOutput.routed_experts`` holds the request's rows."""
    field = next((name for name in releases.prompt_rows_fields() if hasattr(output, name)), None)
    if field is None:
        return None
    return getattr(output, field), output.outputs[0].routed_experts


def from_device_cache(
    prompt_rows: np.ndarray | None,
    generated_rows: np.ndarray | None,
    moe_layers: Collection[int],
    num_layers: int,
) -> np.ndarray:
    """vLLM 0.21.0's two arrays as one array of every other generation's layout.

    vLLM 0.21.0 returns the prompt's rows on ``RequestOutput.prompt_routed_experts`` and the generated tokens'
    on ``CompletionOutput.routed_experts``, int16 ``[rows, MoE layers, top_k]``, the layer axis holding the
    model's MoE layers only, in decoder order (``moe_layers(hf_config)``). Returns int32
    ``[prompt rows + generated rows, num_layers, top_k]`` on the decoder-layer axis, dense layers zero: the
    layout of vLLM 0.20.x (rows from token 0, no ``prompt_start``), which :func:`check` and ``replay.align``
    take as they are.

    Raises:
        ValueError: both arrays absent, or a layer axis that is not ``len(moe_layers)`` wide.
    """
    parts = [np.asarray(rows) for rows in (prompt_rows, generated_rows) if rows is not None]
    if not parts:
        raise ValueError("no routed experts: both the prompt's and the generated tokens' arrays are None")
    layers = sorted(moe_layers)
    for part in parts:
        if part.ndim != 3 or part.shape[1] != len(layers):
            raise ValueError(f"array of shape {part.shape}: expected (rows, {len(layers)} MoE layers, top_k)")
    rows = np.concatenate(parts, axis=0)
    widened = np.zeros((rows.shape[0], num_layers, rows.shape[2]), dtype=np.int32)
    widened[:, layers] = rows
    return widened
