#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The re-prefill oracle calibrated where it runs: how often a clean engine's two passes disagree, per MoE layer
and per token, and the near-tie budget and per-token allowance that data supports.

    python benchmarks/oracle_calibration.py [--arch qwen3_moe_deep] [--dtypes bfloat16,float32] [--runs 3]
    python benchmarks/oracle_calibration.py --model /models/your-moe --dtypes bfloat16 -- --tensor-parallel-size 8
    make bench-oracle [RELEASE=0.30.0] [RUNS=3] [ARCH=qwen3_moe_deep]

On one engine per dtype (a process of its own), with the plugin on: ``runs`` times doctor's workload
(``preflight.reprefill``: a full batch of mixed prompts, chunked prefills at the step budget, prefix-cache
hits, a different seed each run), then the re-prefill; the oracle's analysis (``preflight.consistency``) of each.
Printed and stored (``benchmarks/results/oracle-calibration-<platform>-vllm-<release>.json``):

- per MoE layer, the share of rows whose top-k differs between the passes: prompt rows (two prefills in batches
  of other shapes) and decode rows (a decode step against a prefill: other kernels, other batch shapes);
- per token, how many MoE layers disagree at once, against what independent per-layer near-ties predict
  (the Poisson-binomial law of each run's per-layer rates: ``preflight.token_faults``); the tokens that tail
  alone would name on these clean runs, and the largest share of the layers where their origin differs that
  they hold (``token_faults.WHOLE_TOKEN`` must stay above it); what the oracle as shipped says (any FAIL on a
  clean run is a false alarm);
- the budget the data supports (``consistency.TIE_BUDGET``): the worst rate of one class of rows (prompt or
  decode) in one layer of one run, times ``BUDGET_MARGIN``: a workload of that class of rows only would still
  pass (decode rows disagree most: another kernel than the re-prefill's).

The defaults are the oracle's calibration model (``qwen3_moe_deep``: 24 MoE layers, top-8 of 64 experts, random
weights), doctor's engine defaults (step budget 64, 8 sequences, prefix caching), eager mode. ``--model PATH``
and engine flags after ``--`` calibrate a user's own model and layout (docs/preflight.md); ``--batch-invariant``
runs vLLM's batch-invariant mode (``VLLM_BATCH_INVARIANT=1``, CUDA and XPU). On a GPU machine, ``calibrate(...)``
runs one dtype in the calling process and ``run(...)`` every dtype, each in a process of its own (what
``make gpu-e2e`` calls: ``run(["bfloat16", "float32"], runs=2, out_dir=...)``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_ARCH = "qwen3_moe_deep"
ENGINE_DEFAULTS: dict[str, Any] = {  # doctor --model's (preflight.engine_flags.DEFAULTS)
    "max_model_len": 1024,
    "max_num_batched_tokens": 64,
    "max_num_seqs": 8,
    "enable_prefix_caching": True,
}
MAX_TOKENS = 16
BUDGET_MARGIN = 1.25  # the suggested budget: this times the worst per-run, per-layer rate of one class of rows


def calibrate(
    dtype: str,
    runs: int = 3,
    arch: str = DEFAULT_ARCH,
    model_path: str | None = None,
    engine_options: dict[str, Any] | None = None,
    max_tokens: int = MAX_TOKENS,
    eager: bool = True,
    requests: int | None = None,
    dump: str | None = None,
) -> dict[str, Any]:
    """One engine in ``dtype`` in this process: ``runs`` clean oracle runs (``requests`` first-wave requests, else
    the layout's full batch); their statistics (``summarise``). ``dump``: a folder to save each run's rows in
    (``run-<seed>-<dtype>.npz``: both passes' arrays, prompt lengths and tokens, for ``analyse`` offline)."""
    os.environ.setdefault("VLLM_ASCEND_ROUTING", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    import tests.harness.model_recipes  # noqa: F401 (the benchmark models' recipes)
    from vllm_ascend_routing import contract
    from vllm_ascend_routing.preflight import consistency, models, offline, reprefill, scenarios

    built = model_path is None
    if model_path is None:
        model_path = str(models.build_tiny_moe(arch, scenarios.model_dir() / arch).path)
    options: dict[str, Any] = {
        **ENGINE_DEFAULTS,
        "model": model_path,
        "dtype": dtype,
        "enable_return_routed_experts": True,
        "enforce_eager": eager,
        "seed": 0,
        **(engine_options or {}),
    }
    if offline.on_cpu() and "kv_cache_memory_bytes" not in options:
        options["kv_cache_memory_bytes"] = 512 * 1024 * 1024
    llm = LLM(**options)
    config = llm.llm_engine.model_config
    layout = reprefill.Layout.of(llm.llm_engine.vllm_config)
    results, seconds, planted = [], [], []
    for seed in range(runs):
        start = time.monotonic()
        collected = reprefill.collect(
            lambda prompts, params: llm.generate(prompts, params, use_tqdm=False),
            lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
            layout,
            int(config.get_vocab_size()),
            max_tokens,
            lambda output: contract.request_rows(output, config.hf_text_config),
            requests,
            seed,
        )
        pairs = collected.pairs()
        if dump is not None:
            save_pairs(Path(dump) / f"run-{seed}-{dtype}.npz", pairs)
        result = consistency.analyse(pairs, dtype)
        seconds.append(time.monotonic() - start)
        results.append(result)
        planted.append(sensitivity(pairs, dtype))
        print(f"[{dtype} run {seed}] {result.summary()} ({seconds[-1]:.0f} s)", flush=True)
    out = summarise(results)
    out["sensitivity"] = {
        "single_rows_planted": sum(found["single_rows_planted"] for found in planted),
        "single_rows_named": sum(found["single_rows_named"] for found in planted),
        "mutations_named": sum(found["mutations_named"] for found in planted),
        "mutations": sum(found["mutations"] for found in planted),
        "missed": [miss for found in planted for miss in found["missed"]],
    }
    out.update(
        dtype=dtype,
        model=model_path,
        arch=arch if built else None,
        layout=vars(collected.work)["layout"],
        seconds=seconds,
        engine_options={k: v for k, v in options.items() if k != "model"},
        **environment(),
    )
    return out


def sensitivity(pairs: list[Any], dtype: str) -> dict[str, Any]:
    """On one clean run's rows: each request's first decode row given the previous token's routing (one at a
    time), and each fault of ``tests/harness/routing_mutations.py`` where the checkout has it; how many the
    oracle names (the token and its kind; the fault)."""
    from vllm_ascend_routing.preflight import consistency

    generation = [np.asarray(pair.generation) for pair in pairs]
    prompts = [int(pair.prompt_tokens) for pair in pairs]

    def analysed(rows: list[np.ndarray]) -> Any:
        return consistency.analyse(
            [
                consistency.Pair(p.request, g, p.reprefill, p.prompt_tokens, p.tokens)
                for p, g in zip(pairs, rows, strict=True)
            ],
            dtype,
        )

    found: dict[str, Any] = {"single_rows_planted": 0, "single_rows_named": 0, "mutations": 0, "mutations_named": 0}
    found["missed"] = []
    for r, prompt in enumerate(prompts):
        if len(generation[r]) <= prompt or prompt < 1:
            continue  # one output token: no decode row
        rows = [g.copy() for g in generation]
        rows[r][prompt] = rows[r][prompt - 1]
        result = analysed(rows)
        found["single_rows_planted"] += 1
        if [(f.request, f.row, f.kind) for f in result.token_faults] == [(pairs[r].request, prompt, "late")]:
            found["single_rows_named"] += 1
        else:
            found["missed"].append(f"first decode row of request {r}: {result.summary()}")
    try:
        from tests.harness import routing_mutations
    except ImportError:  # an installed package without the checkout's test harness
        return found
    for name, (mutate, fault) in routing_mutations.MUTATIONS.items():
        result = analysed(mutate(generation, prompts))
        found["mutations"] += 1
        if result.verdict == fault:
            found["mutations_named"] += 1
        else:
            found["missed"].append(f"{name}: {result.summary()}")
    return found


def save_pairs(path: Path, pairs: list[Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, np.ndarray] = {}
    for i, pair in enumerate(pairs):
        arrays[f"gen_{i}"], arrays[f"ref_{i}"] = np.asarray(pair.generation), np.asarray(pair.reprefill)
        arrays[f"tokens_{i}"] = np.asarray(pair.tokens if pair.tokens is not None else [], dtype=np.int64)
    arrays["prompts"] = np.asarray([pair.prompt_tokens for pair in pairs], dtype=np.int64)
    np.savez_compressed(path, **arrays)  # type: ignore[arg-type]


def load_pairs(path: Path) -> list[Any]:
    """The pairs ``save_pairs`` stored (``consistency.Pair``s)."""
    from vllm_ascend_routing.preflight import consistency

    with np.load(path) as data:
        prompts = data["prompts"].tolist()
        return [
            consistency.Pair(str(i), data[f"gen_{i}"], data[f"ref_{i}"], prompts[i], data[f"tokens_{i}"].tolist())
            for i in range(len(prompts))
        ]


def environment() -> dict[str, Any]:
    import torch
    import vllm

    from vllm_ascend_routing.preflight import offline

    device = "cpu"
    if not offline.on_cpu() and torch.cuda.is_available():
        device = torch.cuda.get_device_name(0)
    return {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "platform": "cpu" if offline.on_cpu() else "gpu",
        "device": device,
        "batch_invariant": os.environ.get("VLLM_BATCH_INVARIANT", "0") == "1",
    }


def summarise(results: list[Any]) -> dict[str, Any]:
    """Per-layer rates (prompt and decode rows), the per-token histogram against independence, false alarms."""
    from vllm_ascend_routing.preflight import token_faults
    from vllm_ascend_routing.preflight.token_faults import AGREE, UNTRACED, ZERO

    moe_layers = [layer.layer for layer in results[0].layers]
    count = len(moe_layers)
    layers = {
        "rows": np.zeros(count, int),
        "wrong": np.zeros(count, int),
        "prompt_rows": np.zeros(count, int),
        "prompt_wrong": np.zeros(count, int),
        "decode_rows": np.zeros(count, int),
        "decode_wrong": np.zeros(count, int),
        "untraced": np.zeros(count, int),
    }
    per_run_rates = []
    worst_class = 0.0  # the worst rate of prompt rows or of decode rows, in one layer of one run
    observed = np.zeros(count + 1)
    expected = np.zeros(count + 1)
    for result in results:
        run_wrong = np.zeros(count)
        run_rows = 0
        class_wrong = {True: np.zeros(count), False: np.zeros(count)}  # prompt rows / decode rows
        class_rows = {True: 0, False: 0}
        for codes, prompt in zip(result.codes, result.prompt_tokens, strict=True):
            wrong = (codes != AGREE) & (codes != ZERO)
            is_prompt = np.arange(len(codes)) < (prompt if prompt is not None else len(codes))
            layers["rows"] += len(codes)
            layers["wrong"] += wrong.sum(axis=0)
            layers["prompt_rows"] += int(is_prompt.sum())
            layers["prompt_wrong"] += wrong[is_prompt].sum(axis=0)
            layers["decode_rows"] += int((~is_prompt).sum())
            layers["decode_wrong"] += wrong[~is_prompt].sum(axis=0)
            layers["untraced"] += (codes == UNTRACED).sum(axis=0)
            observed += np.bincount(wrong.sum(axis=1), minlength=count + 1)
            run_wrong += wrong.sum(axis=0)
            run_rows += len(codes)
            for prompt_rows in (True, False):
                chosen = is_prompt if prompt_rows else ~is_prompt
                class_wrong[prompt_rows] += wrong[chosen].sum(axis=0)
                class_rows[prompt_rows] += int(chosen.sum())
        for prompt_rows, rows in class_rows.items():
            if rows:
                worst_class = max(worst_class, float(np.max(class_wrong[prompt_rows])) / rows)
        rates = run_wrong / max(run_rows, 1)
        per_run_rates.append(rates)
        expected += run_rows * _pmf(rates)
    table = [
        {
            "layer": layer,
            "rows": int(layers["rows"][j]),
            "rate": _share(layers["wrong"][j], layers["rows"][j]),
            "prompt_rate": _share(layers["prompt_wrong"][j], layers["prompt_rows"][j]),
            "decode_rate": _share(layers["decode_wrong"][j], layers["decode_rows"][j]),
            "max_run_rate": float(max(rates[j] for rates in per_run_rates)),
            "untraced_share": _share(layers["untraced"][j], layers["wrong"][j]),
        }
        for j, layer in enumerate(moe_layers)
    ]
    alarms = [fault.as_dict() for result in results for fault in result.token_faults]
    tail_only = [fault for result in results for fault in tail_alone(result)]
    highest = max((row["max_run_rate"] for row in table), default=0.0)
    return {
        "runs": len(results),
        "moe_layers": count,
        "verdicts": [result.verdict for result in results],
        "summaries": [result.summary() for result in results],
        "layers": table,
        "traced": {kind: int(sum(layer.traced.get(kind, 0) for r in results for layer in r.layers)) for kind in TRACED},
        "tokens": int(observed.sum()),
        "disagreeing_layers_observed": observed.astype(int).tolist(),
        "disagreeing_layers_expected": expected.round(3).tolist(),
        "false_alarms": alarms,
        "failing_runs": sum(1 for result in results if not result.ok),
        "tail_alone": [fault.as_dict() for fault in tail_only],
        "largest_share": max((share(fault) for fault in tail_only), default=0.0),
        "whole_token": token_faults.WHOLE_TOKEN,
        "thresholds": [result.token_thresholds for result in results],
        "highest_layer_rate": highest,
        "worst_row_class_rate": worst_class,
        "suggested_budget": round(BUDGET_MARGIN * worst_class, 4),
        "false_alarm_bound": token_faults.FALSE_ALARM,
    }


TRACED = ("late", "early", "other", "stale", "none")


def tail_alone(result: Any) -> list[Any]:
    """The tokens the Poisson-binomial tail alone names in ``result`` (``whole_token`` 0)."""
    from vllm_ascend_routing.preflight import token_faults

    return token_faults.find(
        [str(i) for i in range(len(result.codes))],
        result.codes,
        [np.full(codes.shape, -1) for codes in result.codes],
        [layer.layer for layer in result.layers],
        result.prompt_tokens,
        result.refs,
        whole_token=0.0,
    )[0]


def share(fault: Any) -> float:
    """The share of the layers where its origin differs that a token's rows hold (what ``WHOLE_TOKEN`` bounds)."""
    return len(fault.layers) / max(fault.differing or fault.moe_layers, 1)


def _pmf(rates: np.ndarray) -> np.ndarray:
    law = np.zeros(len(rates) + 1)
    law[0] = 1.0
    for p in rates:
        law[1:] = law[1:] * (1.0 - p) + law[:-1] * p
        law[0] *= 1.0 - p
    return law


def _share(part: Any, whole: Any) -> float:
    return float(part) / float(whole) if whole else 0.0


def report(found: dict[str, Any]) -> list[str]:
    """The printed tables of one dtype's calibration."""
    lines = [
        f"== {found['dtype']} on {found['device']} (vLLM {found['vllm']}): {found['runs']} runs, {found['tokens']} "
        f"tokens x {found['moe_layers']} MoE layers; verdicts {', '.join(found['verdicts'])}",
        "  layer     rows   rate%  prompt%  decode%  max-run%  untraced",
    ]
    for row in found["layers"]:
        lines.append(
            f"  {row['layer']:5d}  {row['rows']:7d}  {100 * row['rate']:6.2f}  {100 * row['prompt_rate']:7.2f}  "
            f"{100 * row['decode_rate']:7.2f}  {100 * row['max_run_rate']:8.2f}  {row['untraced_share']:8.2f}"
        )
    observed, expected = found["disagreeing_layers_observed"], found["disagreeing_layers_expected"]
    shown = max([k for k, n in enumerate(observed) if n] + [k for k, e in enumerate(expected) if e >= 0.05] + [1])
    lines.append("  tokens disagreeing in k MoE layers at once: observed / expected if independent")
    lines += [f"    k={k:2d}: {observed[k]:7d} / {expected[k]:10.2f}" for k in range(shown + 1)]
    highest, budget = 100 * found["highest_layer_rate"], 100 * found["suggested_budget"]
    lines.append(
        f"  highest per-layer rate in a run {highest:.2f}%, of prompt or decode rows alone "
        f"{100 * found['worst_row_class_rate']:.2f}% -> budget {budget:.2f}% (x{BUDGET_MARGIN}); wrong rows traced "
        f"{found['traced']}; the tail alone names {len(found['tail_alone'])} token(s), holding at most "
        f"{found['largest_share']:.2f} of their origin's differing layers (WHOLE_TOKEN {found['whole_token']}); "
        f"the oracle as shipped: {found['failing_runs']}/{found['runs']} runs FAIL"
    )
    lines += [f"    tail alone: {fault['text']}" for fault in found["tail_alone"][:8]]
    planted = found.get("sensitivity")
    if planted:
        lines.append(
            f"  planted on these rows: {planted['single_rows_named']}/{planted['single_rows_planted']} single misfiled "
            f"rows named (each request's first decode row), {planted['mutations_named']}/{planted['mutations']} "
            "faults of tests/harness/routing_mutations.py named"
        )
        lines += [f"    missed: {miss}" for miss in planted["missed"][:5]]
    lines += [f"    false alarm: {alarm['text']}" for alarm in found["false_alarms"][:5]]
    return lines


def run(
    dtypes: list[str],
    runs: int,
    arch: str = DEFAULT_ARCH,
    model_path: str | None = None,
    engine_options: dict[str, Any] | None = None,
    eager: bool = True,
    out_dir: Path = RESULTS,
    timeout: int = 3600,
    requests: int | None = None,
    max_tokens: int = MAX_TOKENS,
    label: str = "",
    batch_invariant: bool = False,
    dump: str | None = None,
) -> dict[str, Any]:
    """Each dtype in a process of its own (one engine each): printed, and stored under ``out_dir``.
    ``batch_invariant``: vLLM's batch-invariant mode on (``VLLM_BATCH_INVARIANT=1``: CUDA and XPU kernels only)."""
    found: dict[str, Any] = {}
    for dtype in dtypes:
        with tempfile.TemporaryDirectory() as tmp:
            target = Path(tmp) / "one.json"
            job = {"dtype": dtype, "runs": runs, "arch": arch, "model_path": model_path, "eager": eager,
                   "engine_options": engine_options, "requests": requests, "max_tokens": max_tokens,
                   "dump": dump}  # fmt: skip
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
            if batch_invariant:
                env["VLLM_BATCH_INVARIANT"] = "1"
            done = subprocess.run(
                [sys.executable, __file__, "--one", json.dumps(job), "--one-out", str(target)],
                env=env,
                timeout=timeout,
                check=False,
            )
            if done.returncode != 0 or not target.exists():
                raise SystemExit(f"oracle calibration: the {dtype} engine exited {done.returncode}")
            found[dtype] = json.loads(target.read_text())
        for line in report(found[dtype]):
            print(line, flush=True)
    any_run = next(iter(found.values()))
    name = f"oracle-calibration-{any_run['platform']}-vllm-{any_run['vllm']}"
    if model_path is not None:
        name += "-" + Path(model_path).name
    elif arch != DEFAULT_ARCH:
        name += f"-{arch}"
    name += "-batch-invariant" if batch_invariant else ""
    name += f"-{label}" if label else ""
    out_dir.mkdir(parents=True, exist_ok=True)
    stored = out_dir / f"{name}.json"
    stored.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "commit": _commit(), "dtypes": found}, indent=1))
    print(f"stored {stored.relative_to(ROOT) if stored.is_relative_to(ROOT) else stored}")
    return found


def _commit() -> str | None:
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    except OSError:
        return None
    return done.stdout.strip() or None


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--arch", default=DEFAULT_ARCH)
    parser.add_argument("--model", default=None, help="a model of your own instead of --arch")
    parser.add_argument("--compiled", action="store_true", help="vLLM's default compilation instead of eager")
    parser.add_argument("--requests", type=int, default=None, help="first-wave requests (default max_num_seqs + 2)")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    parser.add_argument("--label", default="", help="added to the results file's name")
    parser.add_argument("--batch-invariant", action="store_true", help="VLLM_BATCH_INVARIANT=1 (CUDA, XPU)")
    parser.add_argument("--dump", default=None, help="a folder to save each run's rows in (.npz)")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--one-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one is not None:  # the child: one engine
        job = json.loads(args.one)
        Path(args.one_out).write_text(json.dumps(calibrate(**job)))
        return
    options = None
    if flags:
        from vllm_ascend_routing.preflight import engine_flags

        options = {k: v for k, v in engine_flags.parse(args.model or "unused", flags).items() if k != "model"}
    run(
        args.dtypes.split(","),
        args.runs,
        args.arch,
        args.model,
        options,
        not args.compiled,
        Path(args.out),
        requests=args.requests,
        max_tokens=args.max_tokens,
        label=args.label,
        batch_invariant=args.batch_invariant,
        dump=args.dump,
    )


if __name__ == "__main__":
    main()
