# SPDX-License-Identifier: Apache-2.0
"""The tiny models of the test suite and the benchmarks, registered with the runtime's builder
(``vllm_ascend_routing.preflight.models``, which holds only the doctor's) when this module is imported: by the test
harness (``tests/harness/__init__.py``), the benchmarks and the GPU run, in every process that builds one by name.
"""

from __future__ import annotations

from vllm_ascend_routing.preflight import models

RECIPES: dict[str, models.Recipe] = {
    # Big enough that a forward step is not trivial on a CPU: the overhead benchmark's model.
    "qwen3_moe_bench": ("Qwen3MoeConfig", {**models.QWEN3, "hidden_size": 512, "num_attention_heads": 8,
                                           "num_key_value_heads": 4, "head_dim": 64, "num_hidden_layers": 8,
                                           "num_experts": 64, "num_experts_per_tok": 8, "moe_intermediate_size": 128,
                                           "intermediate_size": 1024}),
    # The oracle's calibration model (benchmarks/oracle_calibration.py): as deep and wide as a production MoE's
    # routing (24 MoE layers, top-8 of 64 experts), tiny otherwise (experts of 2 x 32 gate/up rows: vLLM's CPU grouped
    # GEMM), random weights (near-ties then come as rounding makes them, not tuned away).
    "qwen3_moe_deep": ("Qwen3MoeConfig", {**models.QWEN3, "num_hidden_layers": 24, "num_experts": 64,
                                          "num_experts_per_tok": 8, "moe_intermediate_size": 32}),
    # DeepSeek-V3's routed-experts rows on a tiny body: 61 decoder layers, the first 3 dense, top-8 of 256 experts
    # (vLLM's uint8 array: 61 x 8 = 488 bytes a token). The output benchmark's model (benchmarks/output.py).
    "qwen3_moe_dsv3_rows": ("Qwen3MoeConfig", {**models.QWEN3, "hidden_size": 32, "num_attention_heads": 1,
                                               "num_key_value_heads": 1, "num_hidden_layers": 61, "num_experts": 256,
                                               "num_experts_per_tok": 8, "moe_intermediate_size": 32,
                                               "intermediate_size": 64, "mlp_only_layers": [0, 1, 2]}),
    # More than 256 experts: vLLM returns uint16 (uint8 would wrap). Layer 0 is dense (DeepSeek-style first dense
    # layer). Tiny experts (2 x 32 gate/up rows: vLLM's CPU grouped GEMM) keep it cheap.
    "qwen3_moe_wide": ("Qwen3MoeConfig", {**models.QWEN3, "num_hidden_layers": 3, "num_experts": 288,
                                          "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                          "norm_topk_prob": False, "mlp_only_layers": [0]}),
}  # fmt: skip
ALL_ARCHITECTURES = (
    *models.ARCHITECTURES,
    "qwen3_moe_bench",
    "qwen3_moe_wide",
    "qwen3_moe_robust",
    "qwen3_moe_deep",
    "qwen3_moe_dsv3_rows",
)

models.register(RECIPES)
