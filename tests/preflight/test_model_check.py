# SPDX-License-Identifier: Apache-2.0
"""``doctor --model``'s checks once its engine is up (``model_check._check``), on a stand-in engine (no vLLM): each
layer of the table labelled MoE or dense from the model's own config, and the re-prefill workload's findings (no
prefix-cache hit, no chunked prefill) failing the check, saying which."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

from tests.preflight.test_reprefill import SMALL, VOCAB, StandInFrontEnd
from vllm_ascend_routing.preflight import model_check

# A Qwen-MoE-style config: layer 0 dense (mlp_only_layers), layers 1 and 2 with a router.
QWEN_MOE = SimpleNamespace(num_hidden_layers=3, decoder_sparse_step=1, mlp_only_layers=[0], num_experts=16)


class StandInEngine:
    """TEST-ONLY stand-in for ``preflight.frontend``'s engine as ``model_check._check`` uses it: ``generate`` is
    test_reprefill's ``StandInFrontEnd`` (text prompts made token ids byte by byte), its rows in
    ``CompletionOutput.routed_experts`` with the dense layer 0 all zero (as vLLM returns a dense layer's); the model
    and vLLM configs; the always-on check's totals."""

    def __init__(self, front: StandInFrontEnd, hf_config: Any) -> None:
        self.front = front
        self.model_config = SimpleNamespace(
            hf_text_config=hf_config,
            get_total_num_hidden_layers=lambda: 3,
            get_vocab_size=lambda: VOCAB,
            dtype="torch.float32",
        )
        self.vllm_config = SimpleNamespace(
            scheduler_config=SimpleNamespace(
                max_num_batched_tokens=SMALL.max_num_batched_tokens, max_num_seqs=SMALL.max_num_seqs
            ),
            cache_config=SimpleNamespace(block_size=SMALL.block_size, enable_prefix_caching=True),
            model_config=SimpleNamespace(max_model_len=SMALL.max_model_len),
        )

    def generate(self, prompts: list[Any], params: list[Any]) -> list[Any]:
        asked = [{"prompt_token_ids": [100 + b for b in p.encode()]} if isinstance(p, str) else p for p in prompts]
        outputs = self.front.generate(asked, params)
        for output in outputs:
            rows = np.array(output.routed_experts)
            rows[:, 0] = 0
            output.outputs[0].routed_experts = rows
        return outputs

    def sentinel_totals(self) -> dict[str, int]:
        return {"rows_checked": 100, "steps_checked": 10}


def check(engine: StandInEngine) -> tuple[bool, str, list[str]]:
    lines: list[str] = []
    ok, summary, _ = model_check._check(engine, {}, {}, 2, 6, lines.append, lambda **kw: SimpleNamespace(**kw))
    return ok, summary, lines


def layer_labels(lines: list[str]) -> list[str]:
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("layer    rows"))
    return [line.split(maxsplit=4)[4] for line in lines[start + 1 : start + 4]]


def test_each_layer_is_labelled_moe_or_dense_from_the_models_config() -> None:
    ok, summary, lines = check(StandInEngine(StandInFrontEnd(), QWEN_MOE))
    assert ok, summary
    assert layer_labels(lines) == ["dense: no router, all zero by design", "MoE", "MoE"]
    unknown = StandInEngine(StandInFrontEnd(), SimpleNamespace(num_hidden_layers=3, model_type="no-such-family"))
    assert layer_labels(check(unknown)[2]) == ["(config of an unknown family)"] * 3


def test_the_workloads_findings_fail_the_check_saying_which() -> None:
    """An engine whose prefix cache served no prompt token (its layout says it caches prefixes): every array valid,
    the oracle passes, and the check still fails, naming what the workload did not exercise."""
    ok, summary, _ = check(StandInEngine(StandInFrontEnd(prefix_cache=False), QWEN_MOE))
    assert not ok and "prefix-cache hits not exercised" in summary, summary
