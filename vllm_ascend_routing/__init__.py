# SPDX-License-Identifier: Apache-2.0
"""vLLM plugin returning exact MoE routed experts on Ascend, CUDA and CPU.

Only ``register()`` lives here: vLLM calls it (entry point ``vllm.general_plugins``) in every process.
"""

from __future__ import annotations

__version__ = "0.1.0"

_registered = False


def register() -> None:
    """Activate routed-experts capture when ``VLLM_ASCEND_ROUTING=1``.

    Cheap and idempotent: with the variable unset it returns without importing vLLM or torch; once
    active, further calls do nothing. Refuses unsupported vLLM releases with an error saying what to do.
    """
    global _registered
    import os

    from vllm_ascend_routing import envs

    if any(name.startswith("VLLM_ASCEND_ROUTING") for name in os.environ):
        envs.declare_to_vllm()  # set, even to 0: vLLM's environment validation must know the names
    if _registered or not envs.VLLM_ASCEND_ROUTING:
        return
    from vllm_ascend_routing import integration

    integration.install()
    _registered = True
