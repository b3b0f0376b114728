# SPDX-License-Identifier: Apache-2.0
"""The trainer's side of routing replay, in ``transformers``: a forward on ``prompt + output`` with natural
routing or with each MoE layer's routing forced to given ids, and the training-inference mismatch.

Forcing works as Megatron-Core's ``RouterReplay`` does: the router still computes its scores over every
expert; the given ids replace its top-k, and their weights are gathered from those full scores (softmax,
renormalised where the model normalises its top-k). Rows marked invalid keep the router's own choice.
Needs transformers 5 (MoE routers returning ``(logits, weights, indices)``); no vLLM.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from vllm_ascend_routing.replay import MegatronReplay

_ROUTER = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.gate$")
LN2 = math.log(2.0)


@dataclass
class Forward:
    """One sequence through the trainer."""

    logprobs: np.ndarray  # [T - 1] float64: log pi(token t + 1 | tokens <= t)
    routes: np.ndarray  # [T, num_layers, top_k] int64: the ids each MoE layer used; dense layers 0


class TrainerModel:
    """A checkpoint in ``transformers`` at a training precision, its routers tapped (and forceable)."""

    def __init__(self, path: str | Path, dtype: str = "bfloat16") -> None:
        import torch
        import transformers

        self._torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype))
        self.model.eval()
        self.routers: dict[int, Any] = {}
        for name, module in self.model.named_modules():
            match = _ROUTER.search(name)
            if match and hasattr(module, "top_k"):
                self.routers[int(match.group(1))] = module
        if not self.routers:
            raise ValueError(f"{type(self.model).__name__}: no MoE router found (transformers 5 MoE layout expected)")
        self.moe_layers = tuple(sorted(self.routers))
        self.num_layers = int(self.model.config.num_hidden_layers)
        first = self.routers[self.moe_layers[0]]
        self.top_k, self.num_experts = int(first.top_k), int(first.num_experts)

    def forward(self, tokens: list[int], replay: MegatronReplay | None = None) -> Forward:
        """``tokens`` (one sequence, ``T`` tokens) through the model.

        Args:
            tokens: ``prompt + output`` token ids.
            replay: one `[>= T, top_k]` tensor per MoE layer (``replay.to_megatron`` of this one sample) and
                its ``valid`` rows: those rows use the given ids; ``None``: natural routing everywhere.
        """
        torch = self._torch
        used: dict[int, Any] = {}
        count = len(tokens)
        with self._routing(replay, count, used), torch.no_grad():
            logits = self.model(input_ids=torch.tensor([tokens])).logits[0].float()
        logprobs = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
        routes = np.zeros((count, self.num_layers, self.top_k), dtype=np.int64)
        for layer, ids in used.items():
            routes[:, layer] = ids.numpy()
        return Forward(logprobs.double().numpy(), routes)

    @contextmanager
    def _routing(self, replay: MegatronReplay | None, count: int, used: dict[int, Any]) -> Iterator[None]:
        if replay is not None and len(replay.ids) != len(self.moe_layers):
            raise ValueError(f"{len(replay.ids)} replay tensors for {len(self.moe_layers)} MoE layers")
        originals = {}
        try:
            for j, (layer, router) in enumerate(sorted(self.routers.items())):
                forced = None if replay is None else (replay.layer(j)[:count], replay.valid[:count])
                originals[layer] = router.forward
                router.forward = self._tapped(router, router.forward, forced, used, layer)
            yield
        finally:
            for layer, forward in originals.items():
                self.routers[layer].forward = forward

    def _tapped(
        self, router: Any, forward: Callable[..., Any], forced: tuple[Any, Any] | None, used: dict[int, Any], layer: int
    ) -> Callable[..., Any]:
        torch = self._torch
        normalise = bool(getattr(router, "norm_topk_prob", True))  # Mixtral always renormalises its top-k

        def tapped(hidden_states: Any) -> Any:
            out = forward(hidden_states)
            if not (isinstance(out, tuple) and len(out) == 3):
                raise TypeError(
                    f"{type(router).__name__} returned {type(out).__name__}: expected (logits, "
                    "weights, indices) as transformers 5 MoE routers return"
                )
            logits, weights, indices = out
            if forced is not None:
                ids, valid = forced
                indices = torch.where(valid[:, None], ids.to(indices.device), indices)
                chosen = torch.softmax(logits.float(), dim=-1).gather(1, indices)  # full scores, gathered
                if normalise:
                    chosen = chosen / chosen.sum(dim=-1, keepdim=True)
                weights = chosen.to(weights.dtype)
            used[layer] = indices.detach().cpu()
            return logits, weights, indices

        return tapped


@dataclass
class Mismatch:
    """Training-inference mismatch over response tokens, and routing agreement over recorded rows."""

    deltas: list[np.ndarray] = field(default_factory=list)  # log pi_train - log pi_infer, per request
    rows: int = 0  # recorded (token, MoE layer) rows compared
    agreeing: int = 0  # of those, rows whose top-k set equals vLLM's

    def add(
        self,
        train: Forward,
        infer_logprobs: np.ndarray,
        recorded: np.ndarray,
        valid: np.ndarray,
        moe_layers: tuple[int, ...],
        prompt_len: int,
    ) -> None:
        """One request: the trainer's forward, vLLM's log-probs of the output tokens, vLLM's aligned rows."""
        self.deltas.append(train.logprobs[prompt_len - 1 :] - np.asarray(infer_logprobs, dtype=np.float64))
        used = np.sort(train.routes[valid][:, list(moe_layers)], axis=-1)
        want = np.sort(recorded[valid][:, list(moe_layers)], axis=-1)
        same = (used == want).all(axis=-1)
        self.rows += int(same.size)
        self.agreeing += int(same.sum())

    def _all(self) -> np.ndarray:
        return np.concatenate(self.deltas) if self.deltas else np.zeros(0)

    @property
    def agreement(self) -> float:
        return self.agreeing / self.rows if self.rows else 0.0

    @property
    def tokens(self) -> int:
        return int(self._all().size)

    @property
    def mean_abs(self) -> float:
        return float(np.abs(self._all()).mean())

    @property
    def max_abs(self) -> float:
        return float(np.abs(self._all()).max())

    @property
    def k3(self) -> float:
        """The k3 estimate of KL(pi_infer || pi_train): mean(e^delta - 1 - delta)."""
        delta = self._all()
        return float(np.mean(np.expm1(delta) - delta))

    @property
    def over_ln2(self) -> float:
        """Share of tokens whose probability ratio is beyond 2x either way."""
        return float(np.mean(np.abs(self._all()) > LN2))

    def summary(self) -> dict[str, float | int]:
        return {
            "routing_agreement": self.agreement,
            "rows": self.rows,
            "tokens": self.tokens,
            "mean_abs_delta": self.mean_abs,
            "max_abs_delta": self.max_abs,
            "k3": self.k3,
            "share_abs_delta_over_ln2": self.over_ln2,
        }
