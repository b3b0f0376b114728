# SPDX-License-Identifier: Apache-2.0
"""vLLM plugin returning exact MoE routed experts on Ascend, CUDA and CPU.

Only ``register()`` lives here: vLLM calls it (entry point ``vllm.general_plugins``) in every process.
"""

from __future__ import annotations

__version__ = "0.1.0"

_registered = False


def register() -> None:
    """Activate routed-experts capture when ``VLLM_ASCEND_ROUTING=1``.

    Cheap and idempotent: with the variable unset it returns without importing vLLM or torch (in a Ray driver
    the job's ``runtime_env`` counts as this process's environment, ``envs.adopt_ray_job_variables``); once
    active, further calls do nothing. Refuses unsupported vLLM releases with an error saying what to do.
    """
    global _registered
    import os

    from vllm_ascend_routing import envs

    adopted = envs.adopt_ray_job_variables()  # a Ray driver whose job runtime_env sets them: as its workers
    if any(name.startswith("VLLM_ASCEND_ROUTING") for name in os.environ):
        envs.declare_to_vllm()  # set, even to 0: vLLM's environment validation must know the names
    if _registered or not envs.VLLM_ASCEND_ROUTING:
        return
    from vllm_ascend_routing import integration

    integration.install()
    _registered = True
    if adopted:
        from vllm_ascend_routing._logging import get_logger

        get_logger(__name__).info("vllm-ascend-routing: %s taken from the Ray job's runtime_env", ", ".join(adopted))
