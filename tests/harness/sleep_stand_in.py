# SPDX-License-Identifier: Apache-2.0
"""Test-only stand-in for vLLM's level-2 sleep on the CPU build (which has no sleep mode): device memory comes back
with its contents lost, except what vLLM saves and restores. Never installed by the plugin.

On a GPU (and vllm-ascend's NPU), ``sleep(level=2)`` discards the memory pool every load-time allocation lives in:
the weights and everything the plugin allocates while the model loads. ``wake_up`` maps fresh memory at the same
addresses, then copies back the model's registered buffers (``model.named_buffers()``, saved to the host before the
sleep). The RL framework then loads the weights again. So, for the rows after a wake-up to be right, every device
tensor the plugin keeps from one step to the next must be either rewritten every step before it is read or one of
the model's registered buffers.

``lose_device_memory`` does in a worker what that cycle does to the plugin's state and the model's buffers, in
vLLM's own order: save the model's buffers, overwrite every tensor the plugin's capture holds and every model buffer
with a byte pattern, copy the saved buffers back. The weights are left as they are (reloading them is checked apart:
``weight_reload_suite``), so the model computes what it did and every row must stay exact.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from vllm_ascend_routing.preflight import weight_reload

LABEL = "level-2 sleep (CPU stand-in)"
PATTERN = 0x5A  # every byte of lost memory; as int64 a large positive count, as int16 ids 23130 (no expert's)


def sleep_part(llm: Any) -> dict[str, Any]:
    """The same prompts before and after the stand-in, every row against the reference (``weight_reload.across``)."""
    arch = Path(llm.llm_engine.model_config.model).name
    workers: list[dict[str, Any]] = []
    result = weight_reload.across(llm, arch, lambda: workers.extend(llm.collective_rpc(lose_device_memory)), LABEL)
    return {"sleep": {**result, "workers": workers}}


def lose_device_memory(worker: Any) -> dict[str, Any]:
    """In a worker (``collective_rpc``): the level-2 cycle's effect on the plugin's state and the model's buffers."""
    from vllm_ascend_routing import runner_state

    runner = worker.model_runner
    model = runner.model
    saved = {name: buffer.cpu().clone() for name, buffer in model.named_buffers()}  # vLLM's sleep(level=2)
    prepared = runner_state.prepared_capture(runner)
    plugin = plugin_tensors(prepared)
    for tensor in plugin + [buffer for _, buffer in model.named_buffers()]:
        overwrite(tensor)
    for name, buffer in model.named_buffers():  # vLLM's wake_up
        if name in saved:
            buffer.data.copy_(saved[name].data)
    return {
        "plugin_tensors_lost": len(plugin),
        "buffers_restored": len(saved),
        "plugin_buffers_restored": sorted(name for name in saved if "vllm_ascend_routing" in name),
    }


def plugin_tensors(root: Any) -> list[torch.Tensor]:
    """Every tensor reachable from ``root`` through the plugin's own objects (dataclass fields, attributes,
    containers), each once; model modules (a capture's deferred layers) are not followed."""
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    pending = [root]
    while pending:
        item = pending.pop()
        if id(item) in seen or item is None or isinstance(item, torch.nn.Module):
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            found.setdefault(id(item), item)
        elif isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, list | tuple | set | frozenset):
            pending.extend(item)
        elif type(item).__module__.startswith("vllm_ascend_routing"):
            if dataclasses.is_dataclass(item):
                pending.extend(getattr(item, f.name) for f in dataclasses.fields(item))
            pending.extend(getattr(item, "__dict__", {}).values())
    return list(found.values())


def overwrite(tensor: torch.Tensor) -> None:
    """Every byte of ``tensor``'s memory set to ``PATTERN`` (what a discarded and remapped page may hold)."""
    data = tensor.data
    if data.is_contiguous() and data.numel():
        data.view(-1).view(torch.uint8).fill_(PATTERN)
    else:
        data.fill_(1)
