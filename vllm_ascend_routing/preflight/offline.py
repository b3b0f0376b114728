# SPDX-License-Identifier: Apache-2.0
"""Run vLLM offline on a tiny MoE and check every returned row against the reference."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_ascend_routing import contract
from vllm_ascend_routing.preflight.compare import Match, compare
from vllm_ascend_routing.preflight.models import TinyMoE
from vllm_ascend_routing.preflight.reference import RouterReference

KV_CACHE_BYTES = 64 * 1024 * 1024


@dataclass
class Completion:
    prompt_ids: list[int]
    output_ids: list[int]
    routed_experts: np.ndarray | None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # vLLM 0.21.0 only: (prompt_routed_experts, routed_experts) as returned (int16, MoE-layer axis)
    native: tuple[np.ndarray | None, np.ndarray | None] | None = None
    info: dict[str, Any] | None = None  # the plugin's routed_experts_info (vLLM 0.22+; docs/output.md)
    kv_transfer_params: dict[str, Any] | None = None  # what the KV connector returned for the request (P/D)


def make_llm(model: TinyMoE, *, enforce_eager: bool = True, dtype: str = "float32", **kwargs: Any) -> Any:
    """An ``LLM`` for ``model`` with routed-experts return on: on the CPU a fixed KV cache sized for a small
    machine; on a GPU or NPU vLLM's own sizing from device memory."""
    from vllm import LLM

    options: dict[str, Any] = {
        "model": str(model.path),
        "dtype": dtype,
        "enable_return_routed_experts": True,
        "max_model_len": 1024,
        "enforce_eager": enforce_eager,
        "seed": 0,
    }
    if on_cpu():
        options["kv_cache_memory_bytes"] = KV_CACHE_BYTES
    options.update(kwargs)
    return LLM(**options)


def close(llm: Any) -> None:
    """Shut ``llm``'s engine down now, its worker processes included: what vLLM logs while stopping then comes
    before whatever the caller prints next (doctor's verdict), not after it at interpreter exit."""
    shutdown = getattr(getattr(getattr(llm, "llm_engine", None), "engine_core", None), "shutdown", None)
    if callable(shutdown):
        shutdown()


# vLLM's variables doctor sets for its engines where the environment has none, and why.
ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "the engine core in this process",
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "the workers' always-on check counters come back through collective_rpc",
    "VLLM_CPU_OMP_THREADS_BIND": "one core list per CPU rank, where vLLM would bind each to a NUMA node of its own",
}


def set_engine_env(values: dict[str, str]) -> dict[str, str]:
    """Each of ``values`` where the environment has no value of its own; the ones set here."""
    set_here = {name: value for name, value in values.items() if name not in os.environ}
    os.environ.update(set_here)
    return set_here


def engine_env_line(values: dict[str, str]) -> str:
    """The report's line for what ``set_engine_env`` set: each variable, its value and why."""
    if not values:
        return "doctor set no vLLM variable for this engine (the environment had each)"
    said = "; ".join(f"{name}={value} ({ENGINE_ENV.get(name, 'for this engine')})" for name, value in values.items())
    return f"set by doctor for this engine: {said}"


def cpu_thread_binding(ranks: int) -> str | None:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``ranks`` local CPU workers: this process's allowed cores in ``ranks``
    contiguous lists (a core shared where there are fewer cores than ranks); ``None`` for one rank. vLLM's CPU
    build otherwise binds each rank to a NUMA node of its own, and refuses more ranks than nodes."""
    if ranks <= 1:
        return None
    cores = sorted(os.sched_getaffinity(0))
    per_rank = max(1, len(cores) // ranks)
    lists = [cores[min(rank * per_rank, len(cores) - 1) :][:per_rank] for rank in range(ranks)]
    return "|".join(",".join(map(str, group)) for group in lists)


def on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def platform_dtype() -> str:
    """The dtype a self-check runs in by default: float32 (the reference's) where the platform serves it well
    (the CPU), else bfloat16 where the device supports it, else float16."""
    if on_cpu():
        return "float32"
    import torch
    from vllm.platforms import current_platform

    device = getattr(torch, str(current_platform.device_type), None)  # torch.cuda, torch.npu (torch_npu)
    supports_bf16 = getattr(device, "is_bf16_supported", None)
    return "bfloat16" if not callable(supports_bf16) or supports_bf16() else "float16"


def generate(
    llm: Any,
    prompts: list[list[int]],
    max_tokens: int | list[int] = 8,
    prompt_start: int = 0,
    cache_salt: str = "",
    kv_transfer_params: list[dict[str, Any] | None] | None = None,
    extra_args: list[dict[str, Any] | None] | None = None,
    salts: list[str] | None = None,
) -> list[Completion]:
    """Greedy generation of exactly ``max_tokens`` tokens per prompt (one value, or one per prompt; EOS
    ignored), in prompt order; ``prompt_start`` > 0 asks vLLM 0.22+ for rows from that prompt token on;
    ``cache_salt``: each prompt salted with it and its index (vLLM's prefix cache then finds none of its blocks);
    ``kv_transfer_params``: one per prompt (or ``None``), for its KV connector (P/D: vLLM's offline form);
    ``extra_args``: one per prompt (or ``None``), its ``SamplingParams.extra_args`` (per-request options);
    ``salts``: one ``cache_salt`` per prompt, as given (a shared KV cache's weight version), for ``cache_salt``."""
    from vllm import SamplingParams

    counts = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    start = {"routed_experts_prompt_start": prompt_start} if prompt_start else {}
    transfer = kv_transfer_params or [None] * len(prompts)
    extras = [
        {**(extra or {}), **({"kv_transfer_params": dict(kv)} if kv is not None else {})}
        for kv, extra in zip(transfer, extra_args or [None] * len(prompts), strict=True)
    ]
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=n, ignore_eos=True, **start, **({"extra_args": extra} if extra else {})
        )
        for n, extra in zip(counts, extras, strict=True)
    ]
    given = salts or [f"{cache_salt}-{i}" if cache_salt else "" for i in range(len(prompts))]
    salted = [
        {"prompt_token_ids": p, **({"cache_salt": salt} if salt else {})}
        for p, salt in zip(prompts, given, strict=True)
    ]
    outputs = llm.generate(salted, params, use_tqdm=False)
    return [
        Completion(
            list(o.prompt_token_ids),
            list(o.outputs[0].token_ids),
            routed_rows(llm, o),
            int(getattr(o, "num_cached_tokens", 0) or 0),
            native_arrays(o),
            getattr(o.outputs[0], "routed_experts_info", None),
            getattr(o, "kv_transfer_params", None),
        )
        for o in outputs
    ]


def native_arrays(output: Any) -> tuple[np.ndarray | None, np.ndarray | None] | None:
    """vLLM 0.21.0's two arrays as it returned them (prompt's, generated tokens'); ``None`` on other releases
    (``contract.prompt_rows_apart``)."""
    return contract.prompt_rows_apart(output)


def routed_rows(llm: Any, output: Any) -> np.ndarray | None:
    """The request's array in the layout of its release, vLLM 0.21.0's two arrays joined and widened to
    every decoder layer (``contract.request_rows``), so every release is compared the same way."""
    return contract.request_rows(output, llm.llm_engine.model_config.hf_text_config)


def check(
    reference: RouterReference,
    model: TinyMoE,
    completions: list[Completion],
    prompt_start: int = 0,
    dtype: str = "float32",
    layers: tuple[int, ...] | None = None,
) -> Match:
    """Every (token, MoE layer) row of every completion against the (float32) reference, exactly; near-ties by
    the rule for the engine's ``dtype`` (``compare.tie_tolerance``). ``layers``: those decoder layers only (MoE
    layers), instead of every layer (dense ones must be zero)."""
    total = Match()
    for i, c in enumerate(completions):
        tokens = c.prompt_ids + c.output_ids[:-1]  # the last sampled token is never forwarded
        expected, logits = reference.routed_experts_and_logits(tokens)
        got, expected, logits = c.routed_experts, expected[prompt_start:], logits[prompt_start:]
        moe_layers = model.moe_layers
        if layers is not None:
            got = None if got is None else got[:, list(layers)]
            expected, logits, moe_layers = expected[:, list(layers)], logits[:, list(layers)], tuple(range(len(layers)))
        total.add(compare(got, expected, moe_layers, label=f"request {i}", logits=logits, dtype=dtype))
    return total


def _sentinel_of_this_worker(worker: Any = None) -> dict[str, Any]:
    """Run in each worker (``collective_rpc``): its always-on check's counters and first reports."""
    from vllm_ascend_routing import sentinel

    return {"stats": sentinel.stats().as_dict(), "reports": sentinel.first_reports()}


def worker_sentinels(llm: Any) -> list[dict[str, Any]]:
    """The always-on check's counters and first reports of each of the engine's workers. Sent as a function
    (``collective_rpc``): where the workers are processes of their own (0.20.x's CPU build, TP) vLLM needs
    ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (the e2e harness sets it); without it, this process's own."""
    try:
        return list(llm.collective_rpc(_sentinel_of_this_worker))
    except Exception:  # vLLM refuses to send a function: the counters of this process (in-process engines)
        return [_sentinel_of_this_worker()]


def sentinel_totals(llm: Any) -> dict[str, int]:
    """``worker_sentinels``' counters summed over the workers."""
    totals: dict[str, int] = {}
    for worker in worker_sentinels(llm):
        for name, value in worker["stats"].items():
            totals[name] = totals.get(name, 0) + int(value)
    return totals


def reference_for(model: TinyMoE) -> RouterReference:
    return RouterReference(model.path, model.num_hidden_layers, model.num_experts, model.top_k)
