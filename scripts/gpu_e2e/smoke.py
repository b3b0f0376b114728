#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The payload's first proof on the GPU (``make gpu-e2e``'s smoke step): vLLM 0.26.0's own CUDA kernels, cut to
sm_90 (``fatbin.py``), load and compute what torch computes.

Imports ``vllm.platforms.cuda`` (loads ``_C``) and ``vllm._custom_ops`` (loads ``_moe_C``), then runs ``rms_norm``
and ``topk_softmax`` against torch. "no kernel image is available for execution on the device" here means the cut
removed code this GPU needs. Exit status 0 only if both match.
"""

from __future__ import annotations

import sys


def main() -> int:
    import torch
    import vllm
    import vllm._custom_ops as ops
    import vllm.platforms.cuda  # noqa: F401  (loads _C)

    torch.manual_seed(0)
    x = torch.randn(8, 64, device="cuda")
    weight = torch.ones(64, device="cuda")
    out = torch.empty_like(x)
    ops.rms_norm(out, x, weight, 1e-6)
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    gating = torch.randn(8, 16, device="cuda")
    weights = torch.empty(8, 4, device="cuda")
    ids = torch.empty(8, 4, dtype=torch.int32, device="cuda")
    token_expert = torch.empty_like(ids)
    ops.topk_softmax(weights, ids, token_expert, gating, True)
    torch.cuda.synchronize()
    error = float((out - expected).abs().max())
    same_ids = torch.equal(ids.sort(-1).values.long(), gating.topk(4, -1).indices.sort(-1).values)
    print(
        f"vLLM {vllm.__version__} on {torch.cuda.get_device_name(0)}: rms_norm max error {error:.2e}, "
        f"topk_softmax ids match torch.topk: {same_ids}",
        flush=True,
    )
    return 0 if same_ids and error < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
