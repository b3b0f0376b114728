# SPDX-License-Identifier: Apache-2.0
"""TEST-ONLY: put on ``PYTHONPATH`` of the Ray end-to-end tests' driver and Ray nodes (never by the plugin).

Installs the CPU Ray stand-in (``tests.harness.cpu_ray_standin``) when vLLM's CPU platform
module is imported: the platform gets a Ray device key, so vLLM's Ray executors start on a CPU machine.
"""

from tests.harness import cpu_ray_standin
from vllm_ascend_routing._post_import import when_imported

when_imported(cpu_ray_standin.CPU_PLATFORM_MODULE, cpu_ray_standin.install)
