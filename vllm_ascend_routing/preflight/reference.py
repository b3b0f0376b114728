# SPDX-License-Identifier: Apache-2.0
"""The oracle: Hugging Face ``transformers`` on the same weights, router top-k per layer and token."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class RouterReference:
    """Runs the checkpoint in transformers (float32) and returns each token's top-k expert sets."""

    def __init__(self, path: str | Path, num_hidden_layers: int, num_experts: int, top_k: int) -> None:
        import torch
        import transformers

        self._torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32)
        self.model.eval()
        self.shape = (num_hidden_layers, top_k)
        self.num_experts = num_experts
        self._logits: dict[int, Any] = {}
        # Hook every router ("...layers.N....gate" producing [tokens, num_experts] logits). Hooks keep
        # this independent of transformers' output-recording API, which changed between 4.x and 5.x.
        for name, module in self.model.named_modules():
            match = _LAYER.search(name)
            if match and name.endswith(".gate"):
                module.register_forward_hook(self._hook(int(match.group(1))))

    def _hook(self, layer: int) -> Any:
        def hook(module: Any, args: Any, output: Any) -> None:
            logits = output if isinstance(output, self._torch.Tensor) else output[0]
            if logits.shape[-1] == self.num_experts:
                self._logits[layer] = logits.reshape(-1, self.num_experts)

        return hook

    def routed_experts(self, token_ids: list[int]) -> np.ndarray:
        """`[len(token_ids), num_hidden_layers, top_k]` int64, each row's ids sorted; dense layers 0."""
        return self.routed_experts_and_logits(token_ids)[0]

    def routed_experts_and_logits(self, token_ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """The routed experts, and the router logits `[len(token_ids), num_hidden_layers, num_experts]`
        (float32, zero in dense layers) that decide near-ties."""
        self._logits.clear()
        with self._torch.no_grad():
            self.model(input_ids=self._torch.tensor([token_ids]))
        out = np.zeros((len(token_ids), *self.shape), dtype=np.int64)
        logits_out = np.zeros((len(token_ids), self.shape[0], self.num_experts), dtype=np.float32)
        for layer, logits in self._logits.items():
            top = self._torch.topk(logits.float(), self.shape[1], dim=-1).indices
            out[:, layer] = np.sort(top.numpy(), axis=-1)
            logits_out[:, layer] = logits.float().numpy()
        return out, logits_out
