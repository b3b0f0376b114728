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
default (``--multiprocess`` for vLLM's default layout): on a 2-core machine the extra processes make single
runs swing by +-10%.
Prints tokens/s per run, the median ratio of each mode to ``off`` (of wall-clock throughput, and of tokens per
CPU-second of the engine's processes, which does not count waiting for a core), routing bytes per token, host
memory held by the capture buffers, and the time to assemble one 16k-token request's routing (61 layers, top-8,
256 experts); writes everything as JSON.

``--versus-vllm`` (``make bench VERSUS=1 RELEASE=0.30.0``): the plugin against vLLM's own capture, where that
records real ids on the CPU build: 0.30 only (0.28 and 0.29 refuse vLLM's own capture with their monolithic CPU
experts at start-up, measured 2026-11-24). For each compilation setting (``--compilation``: eager
= ``enforce_eager=True``, compiled = vLLM's default torch.compile; both by default) one warmed engine each of
``vllm`` (vLLM's own capture, no plugin), ``plugin`` and, with ``--control``, a second ``vllm`` engine
(``vllm-control``: control/vllm is the A/A ratio of the same run); ``--pairs`` rounds (default 6), each in the next
of the modes' orders (every mode first, middle and last equally often); 64 requests x 64 tokens by default. Two
identical engines in two processes can differ by a few percent for the whole run (measured: A/A median 0.95 eager on
0.30.0), so ``--fresh-engines`` starts new processes every round, turning that per-process offset into
round-to-round noise the median absorbs. Prints each round's plugin/vllm and control/vllm ratios (wall clock and
tokens per CPU-second) and their medians; writes ``results/versus-vllm-<release>.json``.

``--profile`` (``make bench PROFILE=1``) then runs one more plugin batch under py-spy (200 Hz, every process
of the engine) and prints the share of the model step's samples (and of all samples) spent in plugin code
(``sampling.py`` says how a sample is attributed): the plugin's cost measured directly, below the
wall-clock ratio's noise.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import sampling

# The CPU-kernel probe (tests.harness.cpu_moe_choice) is the checkout's test harness, not in the installed package:
# the checkout goes after the environment's own paths, so the installed plugin stays the one measured.
CHECKOUT = str(Path(__file__).resolve().parents[1])
if CHECKOUT not in sys.path:
    sys.path.append(CHECKOUT)

ARCH = "qwen3_moe_bench"
KV_CACHE_BYTES = 512 * 1024 * 1024


def engine_cpu_seconds() -> float:
    """CPU seconds (user + system, every thread) of this process and its children: the whole engine's work,
    whichever process layout the release uses; unlike wall time it does not count time spent waiting for a
    core that something else on the machine holds."""
    import psutil  # type: ignore[import-untyped]  # a vLLM requirement; no stubs in the dev environment

    me = psutil.Process()
    total = 0.0
    for process in [me, *me.children(recursive=True)]:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def worker(mode: str, requests: int, tokens: int, eager: bool = False) -> None:
    """One engine, one mode: warm up, print READY, then time one batch per ``run`` line read from stdin."""
    from vllm import LLM, SamplingParams

    from vllm_ascend_routing.selfcheck import models, scenarios

    if mode == "unchecked":  # the plugin with its always-on check's per-step work removed (in-process engine)
        from vllm_ascend_routing.sentinel import Sentinel

        def skip(self: Sentinel, *args: Any) -> None:
            return None

        setattr(Sentinel, "clear", skip)  # noqa: B010
        setattr(Sentinel, "after_forward", skip)  # noqa: B010
    model = models.build_tiny_moe(ARCH, scenarios.model_dir() / ARCH)
    llm = LLM(
        model=str(model.path),
        dtype="float32",
        enable_return_routed_experts=(mode in ("plugin", "unchecked", "vllm", "vllm-control")),
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        max_model_len=1024,
        seed=0,
        enforce_eager=eager,
    )
    prompts = [{"prompt_token_ids": p} for p in models.mixed_prompts(requests, seed=3, min_len=16, max_len=256)]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    # Warm-up: the whole prompt set, so every prefill and decode batch shape the timed batch meets has
    # been compiled and every cache touched once (a smaller warm-up left the first timed batch ~35% slow).
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    config = llm.llm_engine.vllm_config
    print("OVERHEAD_READY", flush=True)
    for command in sys.stdin:
        if command.strip() != "run":
            break
        start, cpu_start = time.perf_counter(), engine_cpu_seconds()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        cpu_seconds = engine_cpu_seconds() - cpu_start
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        routed = [o.outputs[0].routed_experts for o in outputs]
        result = {
            "mode": mode,
            "max_num_batched_tokens": int(config.scheduler_config.max_num_batched_tokens),
            "kv_block_size": int(config.cache_config.block_size),
            "seconds": seconds,
            "generated_tokens": generated,
            "tokens_per_s": generated / seconds,
            "cpu_seconds": cpu_seconds,
            "tokens_per_cpu_s": generated / cpu_seconds,
            "routing_bytes_per_token": None if routed[0] is None else int(routed[0][0].nbytes),
            "routing_dtype": None if routed[0] is None else str(routed[0].dtype),
        }
        print("OVERHEAD_RESULT " + json.dumps(result), flush=True)


class Engine:
    """A warmed worker process for one mode; ``run()`` times one batch in it."""

    def __init__(self, mode: str, args: argparse.Namespace, cache_root: str, eager: bool = False) -> None:
        env = dict(os.environ, VLLM_CACHE_ROOT=cache_root)
        if not args.multiprocess:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        env.pop("VLLM_ASCEND_ROUTING", None)
        if mode in ("plugin", "unchecked") or (mode in ("off", "control") and not vllm_alone_runs()):
            env["VLLM_ASCEND_ROUTING"] = "1"
        self.mode = mode
        # stderr (vLLM's logging) goes to a file, shown if the worker fails; closed in close().
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            mode,
            "--requests",
            str(args.requests),
            "--tokens",
            str(args.tokens),
            *(["--eager"] if eager else []),
        ]
        self.proc = subprocess.Popen(
            cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True
        )
        self._expect("OVERHEAD_READY")

    def _expect(self, prefix: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line.removeprefix(prefix).strip()
        self.log.seek(0)
        raise SystemExit(f"{self.mode} engine failed ({self.proc.wait()}):\n{self.log.read()[-4000:]}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def run(self) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return dict(json.loads(self._expect("OVERHEAD_RESULT ")))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=120)
        self.log.close()


def cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as cpuinfo:
        return next((set(line.split(":", 1)[1].split()) for line in cpuinfo if line.startswith("flags")), set())


def machine() -> str:
    flags = cpu_flags()
    isa = "AVX-512" if "avx512f" in flags else "AVX2, no AVX-512"
    return f"{os.cpu_count()} CPUs, {isa}{', AMX' if 'amx_tile' in flags else ''}"


@functools.cache
def vllm_alone_runs() -> bool:
    """vLLM 0.20-0.27 crash in their pure-PyTorch CPU MoE unless the plugin's compat fix is applied; they
    take it without the grouped-GEMM kernels (CPUs without AVX-512) and, for float32, on AMX CPUs."""
    from tests.harness.cpu_moe_choice import CpuMoeKernel, vllm_cpu_moe_kernel

    return vllm_cpu_moe_kernel(ARCH) is not CpuMoeKernel.PURE_TORCH


def refuse_where_vllm_cannot_start() -> None:
    """vLLM 0.27 refuses float32 MoE weights on AMX CPUs (no kernel for them), plugin or not."""
    from tests.harness.cpu_moe_choice import CpuMoeKernel, vllm_cpu_moe_kernel

    if vllm_cpu_moe_kernel(ARCH) is CpuMoeKernel.REFUSED:
        import vllm

        raise SystemExit(
            f"vLLM {vllm.__version__} refuses the float32 benchmark model's CPU MoE on this AMX CPU (its "
            "grouped-GEMM kernel there needs bfloat16 and it will not fall back): use another release"
        )


def vllm_path_starts_on_cpu() -> bool:
    """Whether vLLM's own routed-experts path starts on the CPU build: not in 0.27 (refused for the CPU
    MoE), 0.28-0.29 (monolithic CPU experts refused) or 0.31+ (needs Model Runner V2)."""
    import vllm

    minor = int(vllm.__version__.split(".")[1])
    return minor <= 26 or minor == 30


def capture_memory(num_layers: int, top_k: int, num_experts: int, max_batched: int, kv_slots: int) -> dict[str, int]:
    """Host bytes held by capture buffers for this generation (CPU build: device buffer is host memory)."""
    from vllm_ascend_routing.compat import get_api

    generation = get_api().generation.value
    step_buffer = max_batched * num_layers * top_k * 2  # our int16 [max_batched, L, K]
    narrow = 1 if num_experts <= 256 else 2
    if generation == "shm":
        return {"step_buffer": step_buffer, "shared_memory_store": kv_slots * num_layers * top_k * narrow}
    # vLLM's runner mirrors the step buffer in pinned host memory; its scheduler keeps a slot buffer.
    return {
        "step_buffer": step_buffer,
        "pinned_mirror": step_buffer,
        "scheduler_slot_buffer": kv_slots * num_layers * top_k * narrow,
    }


def assemble_16k(num_layers: int = 61, top_k: int = 8, num_experts: int = 256, tokens: int = 16384) -> dict[str, float]:
    """Seconds to assemble one 16k-token request's routing from a KV-slot store, as each generation does."""
    from vllm_ascend_routing.compat import _shm_store as store

    rng = np.random.default_rng(0)
    block = 16
    slots = np.random.default_rng(1).permutation(tokens * 2)[: tokens // block] * block  # scattered blocks
    slot_ids = (slots[:, None] + np.arange(block)[None, :]).ravel()
    spec = store.SegmentSpec.for_engine(f"bench{os.getpid()}", 0, (tokens * 2 * block, num_layers, top_k), num_experts)
    writer = store.SegmentWriter(spec)
    try:
        reader = store.SegmentReader(spec)
        rows = rng.integers(0, num_experts, (tokens, num_layers, top_k), dtype=np.int16)
        writer.write(slot_ids, rows)
        start = time.perf_counter()
        got = reader.read(slot_ids)  # 0.20.x: one read when the request stops, widened to int32
        shm_s = time.perf_counter() - start
        assert np.array_equal(got, rows)
        reader.close()
    finally:
        writer.close()
    # 0.22-0.30 (vLLM's own scheduler code, modelled): prompt rows read from the slot buffer at prefill end,
    # decode rows arrive per step, the output processor concatenates the chunks at finish.
    slot_buffer = np.zeros((tokens * 2 * block, num_layers, top_k), dtype=np.uint8)
    slot_buffer[slot_ids] = rows
    start = time.perf_counter()
    prompt = slot_buffer[slot_ids[: tokens - 128]]
    chunks = [prompt] + [slot_buffer[slot_ids[i : i + 1]] for i in range(tokens - 128, tokens)]
    joined = np.concatenate(chunks, axis=0)
    runner_output_s = time.perf_counter() - start
    assert joined.shape == (tokens, num_layers, top_k)
    return {"shm_read_widen_s": shm_s, "slot_buffer_read_and_concat_s": runner_output_s}


def profile_plugin(engine: Engine, scratch: Path) -> dict[str, Any]:
    """One more timed batch in the plugin engine, sampled by py-spy; the plugin's share of the samples."""
    raw = scratch / "plugin.pyspy.txt"
    with sampling.sampled(engine.pid, raw, rate=200):
        result = engine.run()
    share = sampling.plugin_share(raw.read_text().splitlines())
    return {
        "samples": share.samples,
        "plugin_samples": share.plugin_samples,
        "plugin_share": share.share,
        "step_samples": share.step_samples,
        "plugin_step_samples": share.plugin_step_samples,
        "plugin_step_share": share.step_share,
        "top_functions": share.top(),
        "tokens_per_s_while_sampled": result["tokens_per_s"],
    }


def vllm_capture_records_on_cpu() -> bool:
    """Whether vLLM's own capture records real ids on the CPU build (router ``capture_fn``): 0.30 only. Up to
    0.26 the CPU MoE bypasses the router (zeros); 0.27-0.29 refuse the flag with their monolithic CPU experts
    (``ValueError: Routed-experts capture is not supported with monolithic MoE kernel CPUUnquantizedExperts``
    on 0.28.0 and 0.29.0); from 0.31 the path needs Model Runner V2 (not on the CPU)."""
    import vllm

    return vllm_path_starts_on_cpu() and int(vllm.__version__.split(".")[1]) >= 28


def ratio_text(values: list[float]) -> str:
    return f"median {statistics.median(values):.4f} (rounds: {', '.join(f'{v:.3f}' for v in values)})"


def versus_vllm(args: argparse.Namespace) -> None:
    """Plugin against vLLM's own capture, eager and/or compiled, alternating rounds, with the A/A control."""
    import vllm

    if not vllm_capture_records_on_cpu():
        raise SystemExit(
            f"--versus-vllm: vLLM {vllm.__version__}'s own routed-experts capture does not record on "
            "the CPU build (only 0.30's does): run it with RELEASE=0.30.0"
        )
    settings = ["eager", "compiled"] if args.compilation == "both" else [args.compilation]
    modes = ["vllm", "plugin"] + (["vllm-control"] if args.control else [])
    engine = "multi-process" if args.multiprocess else "in-process"
    print(
        f"vLLM {vllm.__version__}: plugin vs vLLM's own capture ({', '.join(settings)}), one warmed {engine} "
        f"engine per mode, {args.pairs} rounds of {' / '.join(modes)} (each order of the modes in turn), "
        f"{args.requests} requests x {args.tokens} tokens, {ARCH}",
        flush=True,
    )
    summary: dict[str, Any] = {
        "vllm": vllm.__version__,
        "machine": machine(),
        "workload": {
            "model": ARCH,
            "requests": args.requests,
            "tokens": args.tokens,
            "engine": f"one warmed {engine} engine per mode, batches alternated",
        },
        "settings": {},
    }
    # Every order of the modes in turn (6 for three modes): each mode runs first, middle and last equally often,
    # so a position effect (the engine that runs right after another, or right after start) cancels.
    orders = list(itertools.permutations(modes))
    for setting in settings:
        runs: list[dict[str, Any]] = []
        print(f"== {setting}", flush=True)
        with tempfile.TemporaryDirectory(prefix="overhead_cache_") as cache_root:
            engines: dict[str, Engine] = {}
            try:
                for round_index in range(args.pairs):
                    order = orders[round_index % len(orders)]
                    if args.fresh_engines or not engines:  # fresh: new processes every round, started in order
                        for started in engines.values():
                            started.close()
                        engines = {mode: Engine(mode, args, cache_root, eager=setting == "eager") for mode in order}
                    for mode in order:
                        run = engines[mode].run()
                        runs.append(run)
                        print(
                            f"  round {round_index + 1} {mode:12s} {run['tokens_per_s']:9.1f} tokens/s "
                            f"({run['seconds']:.2f} s, {run['tokens_per_cpu_s']:.1f} tokens/CPU-s)",
                            flush=True,
                        )
            finally:
                for started in engines.values():
                    started.close()
        by_mode = {m: [r for r in runs if r["mode"] == m] for m in modes}
        setting_summary: dict[str, Any] = {"runs": runs}
        for mode in modes[1:]:
            for key, label in (("tokens_per_s", "throughput"), ("tokens_per_cpu_s", "tokens-per-CPU-second")):
                ratios = [b[key] / a[key] for a, b in zip(by_mode["vllm"], by_mode[mode], strict=True)]
                setting_summary[f"{mode}/vllm {label}"] = {"median": statistics.median(ratios), "rounds": ratios}
                print(f"  {setting} {label} ratio {mode}/vllm: {ratio_text(ratios)}", flush=True)
        summary["settings"][setting] = setting_summary
    out = args.out or Path(__file__).parent / "results" / f"versus-vllm-{vllm.__version__}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2))
    print(f"wrote {out}")


def main() -> None:
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
    parser.add_argument("--eager", action="store_true", help=argparse.SUPPRESS)
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
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--worker", choices=["off", "control", "plugin", "unchecked", "vllm", "vllm-control"], help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.pairs is None:
        args.pairs = 6 if args.versus_vllm else 5
    if args.tokens is None:
        args.tokens = 64 if args.versus_vllm else 128
    if args.worker:
        worker(args.worker, args.requests, args.tokens, args.eager)
        return
    refuse_where_vllm_cannot_start()
    if args.sentinel and args.multiprocess:
        raise SystemExit("--sentinel needs the in-process engine: the check is replaced in this process's engine")
    if args.versus_vllm:
        versus_vllm(args)
        return
    if args.profile:
        sampling.py_spy()  # fail before the engines start, not after the rounds

    import vllm

    modes = (
        ["off", "plugin"]
        + (["vllm"] if vllm_path_starts_on_cpu() and vllm_alone_runs() else [])
        + (["control"] if args.control else [])
        + (["unchecked"] if args.sentinel else [])
    )
    engine = "multi-process" if args.multiprocess else "in-process"
    off_baseline = (
        "vLLM alone"
        if vllm_alone_runs()
        else "plugin loaded with the flag off (CPU MoE compat fix only: vLLM takes its pure-PyTorch MoE here)"
    )
    print(f"off = {off_baseline}")
    print(
        f"vLLM {vllm.__version__}: one warmed {engine} engine per mode, {args.pairs} rounds of "
        f"{' / '.join(modes)} (order reversed every other round), "
        f"{args.requests} requests x {args.tokens} tokens, {ARCH}",
        flush=True,
    )
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="overhead_cache_") as cache_root:
        engines = {mode: Engine(mode, args, cache_root) for mode in modes}  # started one after another
        try:
            for round_index in range(args.pairs):
                # Order reversed every other round (off, plugin, plugin, off, ...): neither mode always runs
                # right after the other, so an order effect or linear drift cancels out in the medians.
                for mode in modes if round_index % 2 == 0 else modes[::-1]:
                    result = engines[mode].run()
                    runs.append(result)
                    cpu_text = f", {result['tokens_per_cpu_s']:.1f} tokens/CPU-s"
                    print(
                        f"  round {round_index + 1} {mode:7s} {result['tokens_per_s']:9.1f} tokens/s "
                        f"({result['generated_tokens']} tokens in {result['seconds']:.2f} s{cpu_text})",
                        flush=True,
                    )
            profile = profile_plugin(engines["plugin"], Path(cache_root)) if args.profile else None
        finally:
            for started in engines.values():
                started.close()
    by_mode = {m: [r["tokens_per_s"] for r in runs if r["mode"] == m] for m in modes}
    ratios = {
        m: statistics.median(b / a for a, b in zip(by_mode["off"], by_mode[m], strict=True))
        for m in modes
        if m != "off"
    }
    cpu_by_mode = {m: [r["tokens_per_cpu_s"] for r in runs if r["mode"] == m] for m in modes}
    cpu_ratios = {
        m: statistics.median(b / a for a, b in zip(cpu_by_mode["off"], cpu_by_mode[m], strict=True))
        for m in modes
        if m != "off"
    }
    plugin_run = next(r for r in runs if r["mode"] == "plugin")
    from vllm_ascend_routing.selfcheck import models, scenarios

    info = models.build_tiny_moe(ARCH, scenarios.model_dir() / ARCH)
    # KV slots the 512 MiB KV budget holds: K and V, every layer, 4 KV heads x 64 dims, float32.
    kv_slots = KV_CACHE_BYTES // (2 * info.num_hidden_layers * 4 * 64 * 4)
    memory = capture_memory(
        info.num_hidden_layers, info.top_k, info.num_experts, plugin_run["max_num_batched_tokens"], kv_slots
    )
    assemble = assemble_16k()
    summary = {
        "vllm": vllm.__version__,
        "machine": machine(),
        "off_baseline": off_baseline,
        "workload": {
            "model": ARCH,
            "requests": args.requests,
            "tokens": args.tokens,
            "engine": f"one warmed {engine} engine per mode, batches alternated",
        },
        "runs": runs,
        "median_ratio_vs_off": ratios,
        "round_ratios_vs_off": {m: [b / a for a, b in zip(by_mode["off"], by_mode[m], strict=True)] for m in ratios},
        "median_cpu_time_ratio_vs_off": cpu_ratios,
        "routing_bytes_per_token": plugin_run["routing_bytes_per_token"],
        "capture_host_memory_bytes": memory,
        "assemble_16k_request": assemble,
        "profile": profile,
    }
    for mode, ratio in ratios.items():
        per_round = ", ".join(f"{b / a:.3f}" for a, b in zip(by_mode["off"], by_mode[mode], strict=True))
        print(f"median throughput ratio {mode}/off: {ratio:.4f} (rounds: {per_round})")
    # The plugin against vLLM's own capture, and against itself without the always-on check: round by round
    # (both engines ran in the same round).
    for baseline, key, what in (
        ("vllm", "median_ratio_plugin_vs_vllm", ""),
        ("unchecked", "median_ratio_plugin_vs_unchecked", " (the always-on check's cost)"),
    ):
        if baseline in by_mode:
            paired = [b / a for a, b in zip(by_mode[baseline], by_mode["plugin"], strict=True)]
            summary[key] = statistics.median(paired)
            print(
                f"median throughput ratio plugin/{baseline}{what}: {statistics.median(paired):.4f} "
                f"(rounds: {', '.join(f'{r:.3f}' for r in paired)})"
            )
    for mode, ratio in cpu_ratios.items():
        per_round = ", ".join(f"{b / a:.3f}" for a, b in zip(cpu_by_mode["off"], cpu_by_mode[mode], strict=True))
        print(f"median tokens-per-CPU-second ratio {mode}/off: {ratio:.4f} (rounds: {per_round})")
    print(f"routing bytes per token: {summary['routing_bytes_per_token']} ({plugin_run['routing_dtype']})")
    print("capture host memory (bytes): " + ", ".join(f"{k}={v}" for k, v in memory.items()))
    print(
        "assemble one 16k-token request (61 layers, top-8, 256 experts): "
        + ", ".join(f"{k}={v * 1e3:.2f} ms" for k, v in assemble.items())
    )
    if profile is not None:
        print(
            f"profile (py-spy, one more plugin batch): plugin code {100 * profile['plugin_step_share']:.3f}% of "
            f"the {profile['step_samples']} model-step samples, {100 * profile['plugin_share']:.3f}% of all "
            f"{profile['samples']} engine samples; by function (of all): "
            + ", ".join(f"{name} {100 * share:.3f}%" for name, share in profile["top_functions"])
        )
    out = args.out or Path(__file__).parent / "results" / f"overhead-vllm-{vllm.__version__}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
