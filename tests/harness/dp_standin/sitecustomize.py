# SPDX-License-Identifier: Apache-2.0
"""TEST-ONLY: put on ``PYTHONPATH`` of the data-parallel end-to-end tests' vLLM processes (never by the plugin).

* Installs the CPU collectives stand-in (``tests.harness.cpu_dp_collectives``) when vLLM's CPU
  communicator is imported.
* With ``ROUTING_TEST_DP_EVENTS`` set to a file, each DP engine appends one line per request it is given
  (``<dp_rank> request``) and per dummy batch it runs while another rank has work (``<dp_rank> dummy``):
  the test reports how the load was spread.
"""

import os

from tests.harness import cpu_dp_collectives
from vllm_ascend_routing._post_import import when_imported

when_imported(cpu_dp_collectives.COMMUNICATOR_MODULE, cpu_dp_collectives.install)
if os.environ.get("ROUTING_TEST_DP_EVENTS"):
    when_imported("vllm.v1.engine.core", cpu_dp_collectives.count_engine_events)
