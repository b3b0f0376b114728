#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Throughput cost of routed-experts capture, measured in one run (``make bench``).

    python benchmarks/overhead.py [--pairs 5] [--requests 64] [--tokens 128] [--profile] [--out FILE]
    python benchmarks/overhead.py --versus-vllm [--compilation both] [--pairs 6] [--control]

Runs inside a per-release venv (``make bench RELEASE=0.23.0``). Workload: the model factory's
``qwen3_moe_bench`` (8 layers, 64 experts, top-8, hidden 512, float32), 64 requests of mixed prompt length
(16-256 tokens) generating 128 tokens each (greedy, EOS ignored), default compilation (torch.compile on).

One warmed engine per mode, each in its own process, all started first; then the timed batch runs in
them alternately, the order reversed every other round (off, plugin, [vllm,] [vllm,] plugin, off, ...;
``--pairs`` rounds), one engine at a time, so slow drift of the machine and the order hit every mode
alike. Modes:
  off     routed-experts return off, no plugin. Where vLLM alone cannot run the CPU MoE (0.20-0.27 on a
          CPU without AVX-512, or an AMX CPU: README "CPU compat fix") the plugin is loaded with the flag
          off, which applies only that fix: no capture, no buffers;
  plugin  VLLM_ASCEND_ROUTING=1 + enable_return_routed_experts;
  vllm    vLLM's own routed-experts path, no plugin. It records real ids on the CPU build only in
          0.30 (eager); in 0.20-0.26 its capture is bypassed by the CPU MoE (zeros) but the rest of the
          path (buffers, transport, scheduler, output) runs, so plugin/vllm isolates the plugin's own cost;
          0.27 refuses to start it on the CPU, 0.28-0.29 refuse their monolithic CPU experts (their
          source), 0.31+ need Model Runner V2, and 0.20-0.27 crash in the CPU MoE where vLLM takes its
          pure-PyTorch loop (no AVX-512, or AMX with float32), so it is left out there;
  unchecked (``--sentinel``) the plugin with its always-on check (``sentinel``: zeroing the step's rows, the
          all-zero-row and invalid-id check) replaced by no-ops: plugin/unchecked is that check's cost
          (in-process engines only, where the replacement reaches the engine core);
  control (``--control``) a second engine exactly like ``off``: control/off is an A/A ratio, so it shows
          how far two identical engines differ on this machine in this run (a run's rounds can all sit
          above or below 1 together, with no difference between the engines).
Each engine first runs a warm-up (every prompt, 16 tokens: compilation, caches). The engine core runs in-process by
default (``--multiprocess`` for vLLM's default layout): on a machine with few cores the extra processes make
single runs swing more.
Prints tokens/s per run, the median ratio of each mode to ``off`` (of wall-clock throughput, and of tokens per
CPU-second of the engine's processes, which does not count waiting for a core), routing bytes per token, host
memory held by the capture buffers, and the time to assemble one 16k-token request's routing (61 layers, top-8,
256 experts); writes everything as JSON.

``--versus-vllm`` (``make bench VERSUS=1 RELEASE=0.30.0``): the plugin against vLLM's own capture, where that
records real ids on the CPU build: 0.30 only (0.28 and 0.29 refuse vLLM's own capture with their monolithic CPU
experts at start-up). For each compilation setting (``--compilation``: eager
= ``enforce_eager=True``, compiled = vLLM's default torch.compile; both by default) one warmed engine each of
``vllm`` (vLLM's own capture, no plugin), ``plugin`` and, with ``--control``, a second ``vllm`` engine
(``vllm-control``: control/vllm is the A/A ratio of the same run); ``--pairs`` rounds (default 6), each in the next
of the modes' orders (every mode first, middle and last equally often); 64 requests x 64 tokens by default. Two
identical engines in two processes can differ by a few percent for the whole run (docs/performance.md), so
``--fresh-engines`` starts new processes every round, turning that per-process offset into
round-to-round noise the median absorbs. Prints each round's plugin/vllm and control/vllm ratios (wall clock and
tokens per CPU-second) and their medians; writes ``results/versus-vllm-<release>.json``.
Measurements: docs/performance.md.

``--profile`` (``make bench PROFILE=1``) then runs one more plugin batch under py-spy (200 Hz, every process
of the engine) and prints the share of the model step's samples (and of all samples) spent in plugin code
(``sampling.py`` says how a sample is attributed): the plugin's cost measured directly, below the
wall-clock ratio's noise.

Modules beside this one: ``overhead_engine`` (the workload and the engine processes), ``overhead_report`` (ratios,
memory, assembly time, profile; the summary), ``overhead_versus`` (``--versus-vllm``), ``history`` (every run's
medians with its commit; ``make bench-check`` compares the newest with the one before).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

# The CPU-kernel probe (tests.harness.cpu_moe_choice) is the checkout's test harness, not in the installed package:
# the checkout goes after the environment's own paths, so the installed plugin stays the one measured.
CHECKOUT = str(Path(__file__).resolve().parents[1])
if CHECKOUT not in sys.path:
    sys.path.append(CHECKOUT)

import history  # noqa: E402
import overhead_engine as engines  # noqa: E402
import overhead_report as report  # noqa: E402
import overhead_versus  # noqa: E402
import sampling  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--pairs", type=int, default=None, help="rounds (default 5; 6 with --versus-vllm)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument(
        "--tokens", type=int, default=None, help="tokens per request (default 128; 64 with --versus-vllm)"
    )
    parser.add_argument(
        "--versus-vllm",
        action="store_true",
        help="plugin vs vLLM's own capture (0.30), eager and compiled; --control adds A/A",
    )
    parser.add_argument(
        "--compilation",
        choices=["eager", "compiled", "both"],
        default="both",
        help="with --versus-vllm: enforce_eager=True, vLLM's default torch.compile, or both",
    )
    parser.add_argument(
        "--fresh-engines",
        action="store_true",
        help="with --versus-vllm: new engine processes every round (a process's own speed, which "
        "the A/A control shows can differ by several percent, then varies between rounds)",
    )
    parser.add_argument("--eager", action="store_true", help="every engine with enforce_eager=True (no torch.compile)")
    parser.add_argument(
        "--multiprocess",
        action="store_true",
        help="engine core in its own process (default: in-process, less scheduler noise)",
    )
    parser.add_argument(
        "--control",
        action="store_true",
        help="add a second off engine (A/A control): its ratio to off is this run's noise floor",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="then sample one more plugin batch with py-spy: share of time in plugin code",
    )
    parser.add_argument(
        "--sentinel",
        action="store_true",
        help="add an 'unchecked' engine (the plugin without its always-on check): plugin/unchecked is its cost",
    )
    parser.add_argument(
        "--baseline-checkout",
        type=Path,
        default=None,
        help="add a 'before' engine: the plugin of another checkout (its folder first on PYTHONPATH), e.g. a "
        "worktree of the last commit; plugin/before is this checkout's cost against that one's",
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--worker",
        choices=["off", "control", "plugin", "before", "unchecked", "vllm", "vllm-control"],
        help=argparse.SUPPRESS,
    )
    args = parser.parse_args(argv)
    if args.pairs is None:
        args.pairs = 6 if args.versus_vllm else 5
    if args.tokens is None:
        args.tokens = 64 if args.versus_vllm else 128
    return args


def modes_for(args: argparse.Namespace) -> list[str]:
    """``off`` and ``plugin``; vLLM's own path where it starts on this CPU; the A/A control and ``unchecked``
    when asked for."""
    return (
        ["off", *(["before"] if args.baseline_checkout else []), "plugin"]
        + (["vllm"] if engines.vllm_path_starts_on_cpu() and engines.vllm_alone_runs() else [])
        + (["control"] if args.control else [])
        + (["unchecked"] if args.sentinel else [])
    )


def timed_rounds(args: argparse.Namespace, modes: list[str]) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Every engine started, then ``args.pairs`` rounds of one batch each; the runs, and the profile
    (``--profile``)."""
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="overhead_cache_") as cache_root:
        if not args.eager:  # eager engines compile nothing
            engines.prime_compile_cache(modes, args, cache_root)
        started = {mode: engines.Engine(mode, args, cache_root, eager=args.eager) for mode in modes}
        try:
            for round_index in range(args.pairs):
                # Order reversed every other round (off, plugin, plugin, off, ...): neither mode always runs
                # right after the other, so an order effect or linear drift cancels out in the medians.
                for mode in modes if round_index % 2 == 0 else modes[::-1]:
                    result = started[mode].run()
                    runs.append(result)
                    cpu_text = f", {result['tokens_per_cpu_s']:.1f} tokens/CPU-s"
                    print(
                        f"  round {round_index + 1} {mode:7s} {result['tokens_per_s']:9.1f} tokens/s "
                        f"({result['generated_tokens']} tokens in {result['seconds']:.2f} s{cpu_text})",
                        flush=True,
                    )
            profile = report.profile_plugin(started["plugin"], Path(cache_root)) if args.profile else None
        finally:
            for engine in started.values():
                engine.close()
    return runs, profile


def main() -> None:
    args = parse_args()
    if args.worker:
        engines.worker(args.worker, args.requests, args.tokens, args.eager)
        return
    engines.refuse_where_vllm_cannot_start()
    if args.sentinel and args.multiprocess:
        raise SystemExit("--sentinel needs the in-process engine: the check is replaced in this process's engine")
    if args.versus_vllm:
        overhead_versus.versus_vllm(args)
        return
    if args.profile:
        sampling.py_spy()  # fail before the engines start, not after the rounds

    import vllm

    modes = modes_for(args)
    off_baseline = (
        "vLLM alone"
        if engines.vllm_alone_runs()
        else "plugin loaded with the flag off (CPU MoE compat fix only: vLLM takes its pure-PyTorch MoE here)"
    )
    print(f"off = {off_baseline}")
    print(
        f"vLLM {vllm.__version__}: one warmed {'multi-process' if args.multiprocess else 'in-process'} engine per "
        f"mode, {args.pairs} rounds of {' / '.join(modes)} (order reversed every other round), "
        f"{args.requests} requests x {args.tokens} tokens, {engines.ARCH}",
        flush=True,
    )
    runs, profile = timed_rounds(args, modes)
    summary = report.summarize(args, vllm.__version__, modes, runs, profile, off_baseline)
    report.print_report(summary, next(r for r in runs if r["mode"] == "plugin")["routing_dtype"])
    out = args.out or Path(__file__).parent / "results" / f"overhead-vllm-{vllm.__version__}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2))
    print(f"wrote {out}")
    if args.out is None:  # a run written elsewhere is someone's experiment, not the record
        history.record("overhead", summary)


if __name__ == "__main__":
    main()
