# SPDX-License-Identifier: Apache-2.0
"""The bridge's recipe on vLLM's own arrays, into Megatron-Core's routers: the trainer hand-off test's other half.

    python -m tests.harness.bridge_replay HANDOFF_DIR...

Runs in a trainer environment (``scripts/venv.py trainer-MCORE``; no vLLM) on the directories
``tests/harness/verl_handoff.py`` wrote: each request's array as vLLM returned it, once with rows from token 0 and once
with ``routed_experts_prompt_start`` (``PROMPT_START`` there). For each, the recipe of docs/training.md:
``replay.align`` → ``replay.to_megatron`` (packed, padded to a multiple of ``PAD_TO``) → ``replay.set_model_targets``
into a real ``TransformerBlock`` built like the model, in both mask forms:

* ``stock``: Megatron-Core's own ``RouterReplay`` (no mask parameter): the bridge's ``keep_native``;
* ``verl``: after verl's ``apply_router_replay_patch()``, whose ``RouterReplay.set_target_indices`` takes
  ``replay_mask``.

Every router routes drawn logits in ``REPLAY_FORWARD`` and ``REPLAY_BACKWARD``; each (row, MoE layer) must hold
the reference's top-k where vLLM recorded it, and the native top-k of the logits elsewhere (rows before
``prompt_start``, each request's last token, the padding). Then the shift check: the reference's own router
logits (the trainer's routing of the same tokens) routed with ``RECORD``, ``replay.check_alignment`` must pass on
the rows as vLLM returned them and refuse the same rows shifted by one token. Prints one ``RESULT <json>`` line.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.harness.verl_replay import ARRAYS, load_handoff, megatron_block, routed_sets, versions
from vllm_ascend_routing import replay

PAD_TO = 8  # as Megatron pads packed sequences (TP x CP x 2 elsewhere): padding rows in every request


def requests_of(path: Path, prompt_start: int) -> list[tuple[np.ndarray, int, int]]:
    """``(array as vLLM returned it, prompt_len, output_len)`` per request, for rows from ``prompt_start``."""
    handoff = load_handoff(path)
    if prompt_start:
        with np.load(path / ARRAYS) as data:
            routed = [data[f"routed_start_{i}"] for i in range(len(handoff.routed))]
    else:
        routed = handoff.routed
    return [(r, len(p), len(o)) for r, p, o in zip(routed, handoff.prompts, handoff.outputs, strict=True)]


def expected_rows(path: Path, prompt_start: int, layer: int) -> list[frozenset[int] | None]:
    """Per packed row: the reference's set where vLLM recorded routing, ``None`` where the row stays native."""
    handoff = load_handoff(path)
    rows: list[frozenset[int] | None] = []
    for reference, prompt, output in zip(handoff.reference, handoff.prompts, handoff.outputs, strict=True):
        length = len(prompt) + len(output)
        for token in range(-(-length // PAD_TO) * PAD_TO):
            recorded = prompt_start <= token < length - 1
            rows.append(frozenset(reference[token, layer].tolist()) if recorded else None)
    return rows


def replay_pass(path: Path, meta: dict[str, Any], prompt_start: int, seed: int) -> dict[str, Any]:
    """The recipe once: every row of every MoE layer, forward and recompute, against what it should hold."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    samples = [replay.align(r, p, o, prompt_start) for r, p, o in requests_of(path, prompt_start)]
    data = replay.to_megatron(samples, meta["moe_layers"], meta["num_experts"], pad_to=PAD_TO)
    block, _ = megatron_block(meta, tp=1)
    layers = replay.set_model_targets(block, data)
    routers = dict(replay.model_routers(block))
    generator = torch.Generator().manual_seed(seed)
    logits = {layer: torch.randn(len(data.valid), 1, meta["num_experts"], generator=generator) for layer in layers}
    with torch.no_grad():
        native = {layer: routed_sets(routers[layer].routing(logits[layer])[1]) for layer in layers}
    expected = {layer: expected_rows(path, prompt_start, layer) for layer in layers}  # read once, both passes
    counts = {"replayed": 0, "native": 0, "wrong": 0, "discriminating": 0}
    problems: list[str] = []
    for action in (RouterReplayAction.REPLAY_FORWARD, RouterReplayAction.REPLAY_BACKWARD):
        for layer in layers:  # the forward and its recompute, each in the action's own enum (verl's or Megatron's)
            kind = type(routers[layer].router_replay).__module__
            enum = RouterReplayAction if kind.startswith("megatron") else _verl_action()
            routers[layer].router_replay.set_router_replay_action(getattr(enum, action.name))
        for layer in layers:
            with torch.no_grad():
                got = routed_sets(routers[layer].routing(logits[layer])[1])
            for n, want in enumerate(expected[layer]):
                if got[n] == (native[layer][n] if want is None else want):
                    counts["native" if want is None else "replayed"] += 1
                    counts["discriminating"] += int(want is not None and want != native[layer][n])
                else:
                    counts["wrong"] += 1
                    if len(problems) < 5:
                        problems.append(f"{action.name} layer {layer} row {n}: {sorted(got[n])}, want {want}")
    return {**counts, "problems": problems}


def _verl_action() -> Any:
    from verl.utils.megatron.router_replay_patch import RouterReplayAction

    return RouterReplayAction


def shift_check(path: Path, meta: dict[str, Any], prompt_start: int) -> dict[str, Any]:
    """``check_alignment`` against the trainer's own routing (the reference's router logits, RECORD)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    requests = requests_of(path, prompt_start)
    with np.load(path / ARRAYS) as arrays:
        reference_logits = [arrays[f"logits_{i}"] for i in range(len(requests))]
    block, _ = megatron_block(meta, tp=1)
    routers = dict(replay.model_routers(block))
    packed = []  # the trainer's logits on the packed token axis: the last token and padding get none
    for logits, (_, prompt_len, output_len) in zip(reference_logits, requests, strict=True):
        length = prompt_len + output_len
        block_logits = np.zeros((-(-length // PAD_TO) * PAD_TO, *logits.shape[1:]), dtype=np.float32)
        block_logits[: length - 1] = logits
        packed.append(block_logits)
    trainer_logits = torch.from_numpy(np.concatenate(packed))
    for layer, router in routers.items():
        router.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
        with torch.no_grad():
            router.routing(trainer_logits[:, layer].unsqueeze(1).contiguous())
    samples = [replay.align(r, p, o, prompt_start) for r, p, o in requests]
    data = replay.to_megatron(samples, meta["moe_layers"], meta["num_experts"], pad_to=PAD_TO)
    recorded = replay.recorded_routes(block, data.layers)
    result: dict[str, Any] = {"agreement": replay.check_alignment(data, recorded)}
    # The same arrays one token late: row 0 repeated, the last row dropped (the row count unchanged).
    late = [np.concatenate([r[:1], r[:-1]]) for r, _, _ in requests]
    shifted = [replay.align(r, p, o, prompt_start) for r, (_, p, o) in zip(late, requests, strict=True)]
    try:
        replay.check_alignment(replay.to_megatron(shifted, meta["moe_layers"], meta["num_experts"], PAD_TO), recorded)
        result["shift_refused"] = ""
    except replay.AlignmentError as error:
        result["shift_refused"] = str(error)
    result["requests"] = len(requests)
    return result


def run(dirs: list[Path]) -> list[dict[str, Any]]:
    from megatron.core import parallel_state

    results = []
    with tempfile.TemporaryDirectory(prefix="bridge_replay_") as scratch:
        init = os.path.join(scratch, "process_group")
        torch.distributed.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
        parallel_state.initialize_model_parallel()
        try:
            metas = {path: load_handoff(path).meta for path in dirs}
            for form in ("stock", "verl"):
                if form == "verl":  # process-global: verl's RouterReplay on every router built from here on
                    from verl.utils.megatron.router_replay_patch import apply_router_replay_patch

                    apply_router_replay_patch()
                for path, meta in metas.items():
                    for prompt_start in (0, int(meta["prompt_start"])):
                        counts = replay_pass(path, meta, prompt_start, seed=prompt_start + 1)
                        row = {"arch": meta["arch"], "form": form, "prompt_start": prompt_start, **counts}
                        row["requests"] = [
                            {"prompt_len": p, "output_len": o, "rows": int(r.shape[0]), "dtype": str(r.dtype)}
                            for r, p, o in requests_of(path, prompt_start)
                        ]
                        row["moe_layers"] = len(meta["moe_layers"])
                        if form == "stock":
                            row["shift"] = shift_check(path, meta, prompt_start)
                        results.append(row)
        finally:
            parallel_state.destroy_model_parallel()
            torch.distributed.destroy_process_group()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("dirs", nargs="+", help="hand-off directories (tests/harness/verl_handoff.py)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # Megatron warns that Transformer Engine and Apex are absent
    started = time.monotonic()
    results = run([Path(d).resolve() for d in args.dirs])
    out = {**versions(), "pad_to": PAD_TO, "runs": results, "wall_s": round(time.monotonic() - started, 1)}
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
