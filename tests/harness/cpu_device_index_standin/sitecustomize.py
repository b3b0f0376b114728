# SPDX-License-Identifier: Apache-2.0
"""TEST-ONLY: put on ``PYTHONPATH`` of the Mooncake P/D scenario's engine processes (``tests/harness/mooncake_pd.py``),
never by the plugin.

vLLM's Mooncake worker asks ``torch.accelerator.current_device_index()`` once, for the device its transfer engine
registers; on a CPU-only torch that raises ("Cannot access accelerator device when none is available"). Once vLLM's
Mooncake connector module is imported, it answers 0 (the CPU platform's ``set_device`` is a no-op). Nothing of the
routing or the KV hand-over changes. Self-contained: engine processes may not have the checkout on ``sys.path``.
"""

from types import ModuleType

from vllm_ascend_routing._post_import import when_imported

MOONCAKE_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector"


def _device_zero() -> int:
    return 0


def _answer_device_zero(module: ModuleType) -> None:
    module.torch.accelerator.current_device_index = _device_zero  # type: ignore[attr-defined]


when_imported(MOONCAKE_MODULE, _answer_device_zero)
