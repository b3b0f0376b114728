# SPDX-License-Identifier: Apache-2.0
"""The trainer half of the trainer hand-off test: vLLM's arrays through verl's own R3 code into Megatron-Core.

    python -m tests.harness.verl_replay [--tp 1|2] HANDOFF_DIR...

Runs in a trainer environment (verl + Megatron-Core, ``scripts/venv.py trainer-MCORE``; no vLLM) on the
directories ``tests/harness/verl_handoff.py`` wrote, and prints one ``RESULT <json>`` line. For each model the
requests go through verl 0.9.1 as a rollout + Megatron training step runs them:

1. **Agent loop.** Each request becomes verl's ``AgentLoopOutput`` holding vLLM's array as returned (uint8 or
   uint16). verl's ``AgentLoopWorker._agent_loop_postprocess`` (the real method, on a worker whose
   ``__init__`` is skipped: it would start tools, Ray handles and a teacher; the attributes it sets that the
   method reads are set here: the model's tokenizer, no processor, no reward workers, no distillation,
   prompt/response lengths) pads the request and places the array at ``prompt_pad - len(prompt)`` in an
   int16 ``[1, prompt_pad + response_pad, L, K]`` tensor. verl's ``_postprocess`` stacks the batch. verl's other
   placement, ``AgentLoopOutput.as_dict`` (its TransferQueue trainer: no padding, ``T`` rows), must give every
   token the same row as the padded batch once unpadded.
2. **Trainer.** ``left_right_2_no_padding`` (unpad to jagged tensors), ``prepare_micro_batches`` (dynamic
   batch size: the requests are regrouped into micro-batches), then per micro-batch what
   ``MegatronEngine.forward_step`` does for R3: ``prepare_model_inputs``, the global ``REPLAY_FORWARD``
   action, ``align_r3_router_replay_data``, ``build_r3_replay_mask``, ``set_router_replay_data(...,
   model=block)``, after verl's ``apply_router_replay_patch()`` was applied before the model was built.
3. **Megatron.** A real ``TransformerBlock`` with the model's layer count, dense layers, experts and top-k
   (local spec, CPU, gloo; ``--tp 2``: two tensor-parallel ranks, verl pads each sequence to the TP size and
   scatters the rows as for sequence parallelism, each rank routing its slice). Every router's
   ``TopKRouter.routing`` runs on drawn logits in ``REPLAY_FORWARD`` and again in ``REPLAY_BACKWARD`` (the
   recompute), and each (row, MoE layer) is checked: rows verl replays must hold the reference's top-k set
   (which vLLM's row must equal too), rows verl leaves native must be exactly each sequence's last token and
   its padding, and hold the native top-k of the logits.

Stand-ins, only for what needs a GPU or a cluster: verl's device platform reports ``cpu`` (registered
through verl's ``PlatformRegistry``, its extension point), so verl moves replay tensors to the CPU instead of
``cuda``; the router logits are drawn (Megatron's gating linear needs CUDA); Megatron's model-parallel state
is one or two gloo ranks. verl's routing code and Megatron's routers run as released.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

ARRAYS = "handoff.npz"  # as tests/harness/verl_handoff.py writes them (not imported: that module is vLLM's side)
META = "meta.json"
TOKENIZER = "tokenizer"
# Tokens per micro-batch for verl's dynamic batch size: below the four requests' total, so they are regrouped.
MAX_TOKEN_LEN_PER_GPU = 80
HIDDEN = 32  # the Megatron block's width: routing never reads it (the logits are drawn)


@dataclass
class Counts:
    """(token row, MoE layer) pairs of one request in one routing pass."""

    right: int = 0  # replayed, holding the reference's (and vLLM's) set
    wrong: int = 0  # replayed with another set, or native where a recorded row should replay, or vice versa
    native_last: int = 0  # the last token's rows, left native and holding the native top-k
    native_padding: int = 0  # verl's alignment padding, left native and holding the native top-k
    discriminating: int = 0  # right rows whose native top-k differs from vLLM's: replay made the difference
    problems: list[str] = field(default_factory=list)

    def add(self, other: Counts) -> None:
        self.right += other.right
        self.wrong += other.wrong
        self.native_last += other.native_last
        self.native_padding += other.native_padding
        self.discriminating += other.discriminating
        self.problems += other.problems[: max(0, 5 - len(self.problems))]

    def as_dict(self) -> dict[str, Any]:
        return {
            "right": self.right,
            "wrong": self.wrong,
            "native_last": self.native_last,
            "native_padding": self.native_padding,
            "discriminating": self.discriminating,
            "problems": self.problems[:5],
        }

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Counts:
        return Counts(**data)


@dataclass
class Handoff:
    """One model's arrays as the vLLM side saved them."""

    path: Path
    meta: dict[str, Any]
    routed: list[np.ndarray]  # exactly as vLLM returned them
    prompts: list[list[int]]
    outputs: list[list[int]]
    reference: list[np.ndarray]  # [T-1, L, K] sorted top-k of prompt + output[:-1], dense layers 0


def load_handoff(path: Path) -> Handoff:
    meta = json.loads((path / META).read_text())
    with np.load(path / ARRAYS) as data:
        count = len(meta["requests"])
        return Handoff(
            path=path,
            meta=meta,
            routed=[data[f"routed_{i}"] for i in range(count)],
            prompts=[data[f"prompt_{i}"].tolist() for i in range(count)],
            outputs=[data[f"output_{i}"].tolist() for i in range(count)],
            reference=[data[f"reference_{i}"] for i in range(count)],
        )


def use_cpu_platform() -> None:
    """Make verl's device platform the CPU, before any verl module reads it (some read it at import)."""
    from verl.plugin.platform.platform_cuda import PlatformCUDA
    from verl.plugin.platform.platform_manager import PlatformRegistry, set_platform

    @PlatformRegistry.register(platform="cpu")
    class CpuStandIn(PlatformCUDA):  # type: ignore[misc]
        """CUDA's platform with every tensor kept on the CPU (replay tensors are moved to ``device_name``)."""

        @property
        def device_name(self) -> str:
            return "cpu"

        @property
        def vendor_name(self) -> str:
            return "cpu"

        def is_available(self) -> bool:
            return True

        def communication_backend_name(self) -> str:
            return "gloo"

    set_platform(CpuStandIn())


def agent_loop_batch(handoff: Handoff) -> tuple[Any, list[torch.Tensor]]:
    """verl's agent-loop output for the requests: its ``_agent_loop_postprocess`` per request, then its
    ``_postprocess`` (a ``DataProto`` of left-padded prompts, right-padded responses, routed experts); and
    each request's routes as ``AgentLoopOutput.as_dict`` places them (verl's TransferQueue trainer)."""
    from transformers import AutoTokenizer
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput, AgentLoopWorker
    from verl.workers.config import RolloutConfig

    worker = AgentLoopWorker.__new__(AgentLoopWorker)
    worker.tokenizer = AutoTokenizer.from_pretrained(str(handoff.path / TOKENIZER))
    worker.processor = None  # text only: no multimodal inputs, 1-D position ids
    worker.rollout_config = RolloutConfig(
        prompt_length=max(map(len, handoff.prompts)), response_length=max(map(len, handoff.outputs))
    )
    worker.reward_loop_worker_handles = None  # no reward model: the score step does nothing
    worker.distillation_enabled = False  # no teacher: no teacher log-probs
    worker.mm_processor_kwargs = {}

    unpadded: list[torch.Tensor] = []

    async def postprocess_all() -> list[Any]:
        padded = []
        for prompt, output, routed in zip(handoff.prompts, handoff.outputs, handoff.routed, strict=True):
            loop_output = AgentLoopOutput(
                prompt_ids=prompt,
                response_ids=output,
                response_mask=[1] * len(output),  # every response token is the model's (single turn)
                # SingleTurnAgentLoop keeps rows [: prompt + response_length]: all of vLLM's T-1 rows here.
                routed_experts=routed[: len(prompt) + worker.rollout_config.response_length],
                metrics=AgentLoopMetrics(),
                num_turns=2,
            )
            unpadded.append(loop_output.as_dict()["routed_experts"])
            padded.append(
                await worker._agent_loop_postprocess(loop_output, validate=False, raw_prompt=[{"role": "user"}])
            )
        return padded

    batch = worker._postprocess(asyncio.run(postprocess_all()), input_non_tensor_batch=None, validate=False)
    return batch, unpadded


def megatron_block(meta: dict[str, Any], tp: int) -> tuple[Any, Any]:
    """A Megatron ``TransformerBlock`` routed like the model (layers, dense layers, experts, top-k)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_config import TransformerConfig

    num_layers = int(meta["num_hidden_layers"])
    config = TransformerConfig(
        num_layers=num_layers,
        hidden_size=HIDDEN,
        num_attention_heads=2,
        ffn_hidden_size=64,
        moe_ffn_hidden_size=8,
        num_moe_experts=int(meta["num_experts"]),
        moe_router_topk=int(meta["top_k"]),
        moe_layer_freq=[1 if layer in meta["moe_layers"] else 0 for layer in range(num_layers)],
        moe_enable_routing_replay=True,  # what verl's engine sets when router replay is on
        moe_router_load_balancing_type="none",
        tensor_model_parallel_size=tp,
        # verl scatters the replay rows over the TP ranks (sequence parallel) and each router routes its own
        # slice: the logits drawn here are that slice. The flag itself stays off, because the local spec's
        # torch LayerNorm refuses it (Transformer Engine's is the one that supports it) and routing never reads it.
        sequence_parallel=False,
        use_cpu_initialization=True,
        add_bias_linear=False,
    )
    block = TransformerBlock(config, get_gpt_decoder_block_spec(config, use_transformer_engine=False))
    return block, config


def routed_sets(routing_map: torch.Tensor) -> list[frozenset[int]]:
    return [frozenset(torch.nonzero(row).flatten().tolist()) for row in routing_map]


def row_owners(cu_padded: list[int], lengths: list[int]) -> list[tuple[int, int]]:
    """For each row of verl's packed THD layout: (sample in the micro-batch, token), token -1 for padding."""
    owners: list[tuple[int, int]] = []
    for sample, length in enumerate(lengths):
        size = cu_padded[sample + 1] - cu_padded[sample]
        owners += [(sample, token if token < length else -1) for token in range(size)]
    return owners


def check_pass(
    routers: list[tuple[int, Any]],
    logits: dict[int, torch.Tensor],
    owners: list[tuple[int, int]],
    requests: list[int],
    lengths: list[int],
    handoff: Handoff,
    top_k: int,
) -> dict[int, Counts]:
    """Route every router's logits in the current replay action and count each (row, MoE layer) per request."""
    counts = {request: Counts() for request in requests}
    for layer_number, router_module in routers:
        layer = layer_number - 1  # Megatron numbers layers from 1; vLLM's and the reference's axis from 0
        scores = logits[layer_number]
        mask = router_module.router_replay.target_replay_mask
        with torch.no_grad():
            _, routing_map = router_module.routing(scores)
        got = routed_sets(routing_map)
        native = [frozenset(row.tolist()) for row in torch.topk(scores.view(len(owners), -1), top_k, dim=1).indices]
        for row, (sample, token) in enumerate(owners):
            request = requests[sample]
            tally = counts[request]
            recorded = 0 <= token < lengths[sample] - 1  # vLLM routed it; the last token never went through
            replayed = bool(mask[row]) if mask is not None else True
            where = f"request {request} token {token} layer {layer}"
            if recorded != replayed:
                tally.wrong += 1
                tally.problems.append(f"{where}: verl {'replays' if replayed else 'leaves native'} it")
            elif not replayed:
                if got[row] != native[row]:
                    tally.wrong += 1
                    tally.problems.append(f"{where}: native row {sorted(got[row])} != top-k {sorted(native[row])}")
                elif token < 0:
                    tally.native_padding += 1
                else:
                    tally.native_last += 1
            else:
                want = frozenset(handoff.reference[request][token, layer].tolist())
                from_vllm = frozenset(handoff.routed[request][token, layer].astype(np.int64).tolist())
                if got[row] == want == from_vllm:
                    tally.right += 1
                    tally.discriminating += int(native[row] != want)
                else:
                    tally.wrong += 1
                    tally.problems.append(
                        f"{where}: replayed {sorted(got[row])}, reference {sorted(want)}, vLLM {sorted(from_vllm)}"
                    )
    return counts


def run_model(handoff: Handoff, tp: int, rank: int) -> dict[str, Any]:
    """One model's requests through verl's agent loop and trainer step into a Megatron block; counts per pass."""
    from megatron.core.transformer.moe.router import TopKRouter
    from verl.models.mcore.util import preprocess_thd_engine
    from verl.utils import tensordict_utils as tu
    from verl.utils.megatron.router_replay_patch import RouterReplay, RouterReplayAction, apply_router_replay_patch
    from verl.utils.megatron.router_replay_utils import (
        RouterReplayHelper,
        align_r3_router_replay_data,
        build_r3_replay_mask,
        iter_model_routers,
        set_model_router_replay_action,
        set_router_replay_data,
    )
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead
    from verl.workers.engine.utils import prepare_micro_batches
    from verl.workers.utils.padding import left_right_2_no_padding

    meta = handoff.meta
    apply_router_replay_patch()  # as verl's Megatron engine does before it builds the model
    block, tf_config = megatron_block(meta, tp)
    routers = sorted(
        ((module.layer_number, module) for module in block.modules() if isinstance(module, TopKRouter)),
        key=lambda pair: pair[0],
    )
    if [number - 1 for number, _ in routers] != list(meta["moe_layers"]):
        raise RuntimeError(f"Megatron built routers for layers {[n - 1 for n, _ in routers]}, not {meta['moe_layers']}")
    # verl's model walk reaches exactly these routers, each holding verl's RouterReplay (its patch is in place).
    walked = sorted(iter_model_routers(block), key=lambda pair: pair[0])
    if [(n, id(r)) for n, r in walked] != [(n, id(m.router_replay)) for n, m in routers] or not all(
        isinstance(r, RouterReplay) for _, r in walked
    ):
        raise RuntimeError("verl's iter_model_routers does not reach the block's routers with verl's RouterReplay")

    padded, as_dict_routes = agent_loop_batch(handoff)
    batch = left_right_2_no_padding(padded.to_tensordict())
    # verl's two placements (padded batch, then unpadded; as_dict) must give each token the same row.
    as_dict_agrees = all(
        torch.equal(batch["routed_experts"][i], routes) for i, routes in enumerate(as_dict_routes)
    ) and len(as_dict_routes) == len(handoff.routed)
    tu.assign_non_tensor(batch, use_dynamic_bsz=True, max_token_len_per_gpu=MAX_TOKEN_LEN_PER_GPU)
    micro_batches, micro_indices = prepare_micro_batches(batch, dp_group=None)

    passes: dict[str, dict[int, Counts]] = {"forward": {}, "backward": {}}
    generator = torch.Generator().manual_seed(1000 * rank + 7)
    # What verl's forward_backward_batch sets before the micro-batches run (R3: always replay).
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    for micro_batch, requests in zip(micro_batches, micro_indices, strict=True):
        model_inputs = MegatronEngineWithLMHead.prepare_model_inputs(None, micro_batch)  # reads only the batch
        input_ids = model_inputs["input_ids"]
        lengths = input_ids.offsets().diff().tolist()
        for sample, request in enumerate(requests):  # the regrouped samples are the requests they claim to be
            expected = handoff.prompts[request] + handoff.outputs[request]
            if input_ids[sample].tolist() != expected:
                raise RuntimeError(f"micro-batch sample {sample} is not request {request}")
        # forward_step: a backward replay left by the previous micro-batch goes back to forward replay.
        if RouterReplayHelper.is_replay_backward_action(tf_config, 0, model=block):
            set_model_router_replay_action(block, RouterReplayAction.REPLAY_FORWARD)
        if not RouterReplayHelper.is_replay_forward_action(tf_config, 0, model=block):
            raise RuntimeError("verl's routers are not in REPLAY_FORWARD")
        routes = align_r3_router_replay_data(model_inputs["routed_experts"], input_ids)
        replay_mask = build_r3_replay_mask(input_ids, micro_batch["response_mask"])
        set_router_replay_data(
            routes,
            model_inputs["attention_mask"],
            tf_config,
            0,
            replay_mask=replay_mask,
            local_cp_size=None,
            model=block,
        )
        # The model packs its tokens with the same function: its layout says which row is which token.
        _, packed, _ = preprocess_thd_engine(input_ids, pre_process=True)
        cu_padded = packed.cu_seqlens_q_padded.tolist()
        owners = row_owners(cu_padded, lengths)
        local = len(owners) // tp  # sequence parallel: this rank routes one contiguous slice
        owners = owners[rank * local : (rank + 1) * local]
        logits = {number: torch.randn(local, 1, int(meta["num_experts"]), generator=generator) for number, _ in routers}
        for name, action in (
            ("forward", None),
            ("backward", RouterReplayAction.REPLAY_BACKWARD),  # what forward_step sets for the recompute
        ):
            if action is not None:
                set_model_router_replay_action(block, action)
            counts = check_pass(routers, logits, owners, list(requests), lengths, handoff, int(meta["top_k"]))
            for request, tally in counts.items():
                passes[name].setdefault(request, Counts()).add(tally)
    RouterReplay.clear_global_indices()
    RouterReplay.clear_global_router_replay_action()
    result: dict[str, Any] = {
        name: {str(request): tally.as_dict() for request, tally in sorted(per.items())} for name, per in passes.items()
    }
    result["micro_batches"] = [list(map(int, requests)) for requests in micro_indices]
    result["as_dict_agrees"] = as_dict_agrees
    return result


def run_rank(rank: int, tp: int, init_file: str, dirs: list[str], out_file: str) -> None:
    """One trainer rank: model-parallel state, then every hand-off directory; counts written to ``out_file``."""
    warnings.filterwarnings("ignore")  # Megatron warns that Transformer Engine and Apex are absent
    use_cpu_platform()
    from megatron.core import parallel_state

    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=tp)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        results = {directory: run_model(load_handoff(Path(directory)), tp, rank) for directory in dirs}
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()
    Path(out_file).write_text(json.dumps(results))


def summarize(handoff: Handoff, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts of all ranks per request and pass, with what the request should have."""
    meta = handoff.meta
    shapes = []
    for i, request in enumerate(meta["requests"]):
        row = {
            "shape_name": request["shape_name"],
            "prompt_len": len(handoff.prompts[i]),
            "output_len": len(handoff.outputs[i]),
            "array_shape": list(handoff.routed[i].shape),
            "dtype": str(handoff.routed[i].dtype),
            # Every row vLLM recorded, in every MoE layer, must come back right.
            "recorded_rows": int(handoff.routed[i].shape[0]) * len(meta["moe_layers"]),
            "moe_layers": len(meta["moe_layers"]),
        }
        for name in ("forward", "backward"):
            total = Counts()
            for rank_result in per_rank:
                total.add(Counts.from_dict(rank_result[name][str(i)]))
            row[name] = total.as_dict()
        shapes.append(row)
    return {
        "arch": meta["arch"],
        "vllm": meta["vllm"],
        "num_experts": meta["num_experts"],
        "top_k": meta["top_k"],
        "moe_layers": meta["moe_layers"],
        "num_hidden_layers": meta["num_hidden_layers"],
        "dtypes": sorted({str(a.dtype) for a in handoff.routed}),
        "micro_batches": per_rank[0]["micro_batches"],  # verl's regrouping of the requests (rank 0's)
        "as_dict_agrees": all(rank_result["as_dict_agrees"] for rank_result in per_rank),
        "shapes": shapes,
    }


def versions() -> dict[str, str]:
    import importlib.metadata

    return {
        "python": platform.python_version(),
        "megatron_core": importlib.metadata.version("megatron-core"),
        "verl": importlib.metadata.version("verl"),
        "torch": torch.__version__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("dirs", nargs="+", help="hand-off directories (tests/harness/verl_handoff.py)")
    parser.add_argument("--tp", type=int, default=1, choices=[1, 2], help="tensor-parallel ranks (gloo)")
    args = parser.parse_args()
    started = time.monotonic()
    dirs = [str(Path(d).resolve()) for d in args.dirs]
    with tempfile.TemporaryDirectory(prefix="verl_replay_") as scratch:
        init_file = os.path.join(scratch, "process_group")
        outs = [os.path.join(scratch, f"rank{rank}.json") for rank in range(args.tp)]
        if args.tp == 1:
            run_rank(0, 1, init_file, dirs, outs[0])
        else:
            import torch.multiprocessing as mp

            mp.start_processes(
                _spawned_rank, args=(args.tp, init_file, dirs, outs), nprocs=args.tp, start_method="spawn"
            )
        per_rank = [json.loads(Path(out).read_text()) for out in outs]
    models = [summarize(load_handoff(Path(d)), [ranks[d] for ranks in per_rank]) for d in dirs]
    result = {**versions(), "tp": args.tp, "models": models, "wall_s": round(time.monotonic() - started, 1)}
    print("RESULT " + json.dumps(result), flush=True)


def _spawned_rank(rank: int, tp: int, init_file: str, dirs: list[str], outs: list[str]) -> None:
    run_rank(rank, tp, init_file, dirs, outs[rank])


if __name__ == "__main__":
    main()
