# SPDX-License-Identifier: Apache-2.0
"""One tensor-parallel rank of the token-split test (``test_token_split.py`` starts ``world`` of these, in a
gloo group): vllm-ascend's real MoE layer and method, with its real ``PrepareAndFinalize`` splitting the step's
tokens across TP ranks before ``select_experts`` the way MC2 / all-to-all do (``prepare``), or the step's
tokens arriving already split the way flash-comm's reduce-scatter leaves them. vLLM's real TP group
(``init_distributed_environment`` + ``initialize_model_parallel`` over gloo) carries the plugin's gather.

    python -m tests.ascend.token_split_rank RANK WORLD PORT

Prints one JSON line (``RESULT``): for each comm mode, method and token count, whether this rank's buffer
holds the unsplit step's router top-k on every row. 310P layers are left out: vllm-ascend runs them only
with its all-gather comm method (``select_moe_comm_method``: "On 310P, always use all-gather"), which does not
split tokens across TP, and their ``forward_impl`` does not take flash-comm's split.
"""

from __future__ import annotations

import importlib
import json
import math
import sys
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.ascend import conftest, moe_methods, real_moe  # conftest: vllm-ascend's source on the path, NPU stub
from vllm_ascend_routing.backends import BACKENDS
from vllm_ascend_routing.capture import LayerCapture, new_capture_buffer, new_error_counter
from vllm_ascend_routing.parallel import RankLayout

PREPARE = "vllm_ascend.ops.fused_moe.prepare_finalize"
TOKEN_COUNTS = (1, 2, 5, 7, 16, 23)  # fewer tokens than ranks, uneven splits, a multiple of the TP size
BUFFER_ROWS, NUM_LAYERS = 32, 4
DP_METHODS = ("AscendUnquantizedFusedMoEMethod", "AscendW8A8DynamicFusedMoEMethod")


class SplittingComm(real_moe.StubCommMethod):
    """The MoE comm method with vllm-ascend's real ``prepare`` (token padding and TP split); dispatch and
    combine stay stand-ins (they need an NPU and do not change which tokens were routed)."""

    def __init__(self, prepare_finalize: Any) -> None:
        super().__init__()
        self.prepare_finalize = prepare_finalize

    def prepare(self, hidden_states: torch.Tensor, router_logits: torch.Tensor, **kwargs: Any) -> Any:
        return self.prepare_finalize.prepare(hidden_states, router_logits, **kwargs)


def real_prepare_finalize(name: str) -> Any:
    cls = getattr(importlib.import_module(PREPARE), name)
    instance = object.__new__(cls)
    instance.moe_config = SimpleNamespace()
    instance.multistream_overlap_gate = False
    instance.lora_context = None  # 0.26+
    instance.dynamic_mx_quant_scale_alg = 0  # 0.30+
    if hasattr(instance, "_restore_tp_across_dp"):  # MC2 / all-to-all: TP size and rank from vLLM's state
        instance._restore_tp_across_dp()
    return instance


def run_mode(mode: str, cls: type, rank: int, world: int) -> dict[str, bool]:
    verdicts: dict[str, bool] = {}
    with pytest.MonkeyPatch.context() as patch:
        conftest.native_routing.__wrapped__(patch)  # type: ignore[attr-defined]
        moe = real_moe.build(patch, moe_methods.method_instance(cls), layer_cls=moe_methods.layer_class(cls))
        prepare = real_prepare_finalize(
            "PrepareAndFinalizeWithMC2" if mode == "mc2" else "PrepareAndFinalizeWithAll2All"
        )
        moe.comm.prepare = SplittingComm(prepare).prepare  # type: ignore[method-assign]
        if real_moe.design() == "router":  # the router design's SP: vLLM's sequence-parallel MoE, pre-chunked
            moe.experts.moe_config.is_sequence_parallel = mode == "flashcomm"
        context = importlib.import_module("vllm.forward_context")._forward_context
        buffer = new_capture_buffer(BUFFER_ROWS, NUM_LAYERS, real_moe.TOP_K, real_moe.NUM_EXPERTS, "cpu")
        errors = new_error_counter("cpu")
        capture = LayerCapture(buffer, moe.layer_id, real_moe.NUM_EXPERTS, errors, RankLayout(0, world, True))
        backend = next(backend for _, backend in BACKENDS if backend.handles(moe.layer))
        backend.bind(moe.layer, capture, moe.layer.layer_name)
        for tokens in TOKEN_COUNTS:
            generator = torch.Generator().manual_seed(tokens)  # the same step on every rank
            hidden = torch.randn(tokens, real_moe.HIDDEN, generator=generator)
            logits = torch.randn(tokens, real_moe.NUM_EXPERTS, generator=generator)
            padded = math.ceil(tokens / world) * world
            context.num_tokens, context.flash_comm_v1_enabled = tokens, mode == "flashcomm"
            context.padded_num_tokens = padded
            context.mc2_mask = torch.arange(padded) < tokens
            if mode == "flashcomm":  # reduce-scattered before the MoE: padded to a multiple of TP, then split
                pad = padded - tokens
                hidden = torch.nn.functional.pad(hidden, (0, 0, 0, pad)).tensor_split(world)[rank]
                routed_logits = torch.nn.functional.pad(logits, (0, 0, 0, pad)).tensor_split(world)[rank]
            else:
                routed_logits = logits
            buffer.fill_(-5)
            moe.forward(hidden, routed_logits)
            expected = real_moe.reference_top_k(logits, real_moe.TOP_K)
            exact = torch.equal(buffer[:tokens, moe.layer_id].long(), expected)
            verdicts[str(tokens)] = bool(exact) and int(errors) == 0
    return verdicts


# Tokens per DP rank, per step (uneven, a rank with one token, equal counts).
DP_STEPS = {
    2: ([5, 2], [1, 7], [4, 4]),
    3: ([5, 2, 7], [1, 1, 9], [3, 3, 3]),
    4: ([5, 2, 7, 1], [1, 1, 1, 9], [3, 3, 3, 3]),
}


def run_dp_mode(mode: str, cls: type, rank: int, world: int) -> dict[str, bool]:
    """Each process a DP rank (TP 1) with its own tokens; vllm-ascend's real all-gather ``prepare`` pads every
    rank's tokens to the widest (``max_tokens_across_dp``) and gathers them in rank order before routing, as
    with DP > 1 and the all-gather comm method. The forward context's per-rank counts follow vllm-ascend's
    ``_sync_metadata_across_dp``: the raw counts in eager mode (``dp-eager``), every rank padded to the widest
    (``[max] * dp``) in graph mode and with its all-gather / MC2 comm (``dp-padded``). The plugin places this
    rank's rows from those counts; rows past the rank's real tokens are padding (never read)."""
    from contextlib import nullcontext

    from vllm.distributed import get_tp_group

    verdicts: dict[str, bool] = {}
    with pytest.MonkeyPatch.context() as patch:
        conftest.native_routing.__wrapped__(patch)  # type: ignore[attr-defined]
        moe = real_moe.build(patch, moe_methods.method_instance(cls), layer_cls=moe_methods.layer_class(cls))
        prepare = real_prepare_finalize("PrepareAndFinalizeWithAllGather")
        # this gloo world as the DP group (its coordinator's all_gather is the real collective over ranks)
        prepare.moe_config = SimpleNamespace(
            dp_size=world, dp_group=get_tp_group(), pcp_size=1, is_sequence_parallel=False
        )
        prepare.multistream_overlap_gate = False
        patch.setattr(importlib.import_module(PREPARE), "enable_sp", lambda *a, **k: False, raising=False)
        patch.setattr(importlib.import_module(PREPARE), "enable_sp_by_pass", lambda *a, **k: False, raising=False)
        # 0.20.2rc1 asks its (uninitialised) ascend config whether prefill context parallelism is on: it is not
        patch.setattr(
            importlib.import_module(PREPARE), "prefill_context_parallel_enable", lambda *a, **k: False, raising=False
        )
        moe.comm.prepare = SplittingComm(prepare).prepare  # type: ignore[method-assign]
        context = importlib.import_module("vllm.forward_context")._forward_context
        buffer = new_capture_buffer(BUFFER_ROWS, NUM_LAYERS, real_moe.TOP_K, real_moe.NUM_EXPERTS, "cpu")
        errors = new_error_counter("cpu")
        capture = LayerCapture(buffer, moe.layer_id, real_moe.NUM_EXPERTS, errors, RankLayout(rank, 1, False))
        backend = next(backend for _, backend in BACKENDS if backend.handles(moe.layer))
        backend.bind(moe.layer, capture, moe.layer.layer_name)
        for counts in DP_STEPS[world]:
            widest = max(counts)
            across_dp = [widest] * world if mode == "dp-padded" else counts
            context.dp_metadata = SimpleNamespace(
                num_tokens_across_dp_cpu=torch.tensor(across_dp),
                local_sizes=None,
                sp_local_sizes=lambda sp_size: nullcontext(),
            )
            context.max_tokens_across_dp = widest
            tokens = counts[rank]
            generator = torch.Generator().manual_seed(100 * rank + tokens)  # each rank its own tokens
            hidden = torch.randn(tokens, real_moe.HIDDEN, generator=generator)
            logits = torch.randn(tokens, real_moe.NUM_EXPERTS, generator=generator)
            buffer.fill_(-5)
            moe.forward(hidden, logits)
            expected = real_moe.reference_top_k(logits, real_moe.TOP_K)
            exact = torch.equal(buffer[:tokens, moe.layer_id].long(), expected)
            verdicts["/".join(map(str, counts))] = bool(exact) and int(errors) == 0
        context.dp_metadata = None
    return verdicts


def main() -> None:
    rank, world, port = (int(arg) for arg in sys.argv[1:4])
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    with set_current_vllm_config(VllmConfig()):
        parallel_state.init_distributed_environment(
            world_size=world,
            rank=rank,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            local_rank=rank,
            backend="gloo",
        )
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
        result: dict[str, Any] = {"rank": rank, "world": world}
        methods = [cls for cls in moe_methods.method_classes() if moe_methods.layer_class(cls) is None]
        for mode in ("mc2", "alltoall", "flashcomm"):
            result[mode] = {moe_methods.method_id(cls): run_mode(mode, cls, rank, world) for cls in methods}
        dp_methods = [cls for cls in methods if cls.__name__ in DP_METHODS]
        for mode in ("dp-eager", "dp-padded"):
            result[mode] = {moe_methods.method_id(cls): run_dp_mode(mode, cls, rank, world) for cls in dp_methods}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
