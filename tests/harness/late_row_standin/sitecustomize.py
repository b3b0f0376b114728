# SPDX-License-Identifier: Apache-2.0
"""TEST-ONLY: put on ``PYTHONPATH`` of a process (``doctor --model``), with
``VLLM_ASCEND_ROUTING_TEST_PLANT_LATE_ROW=N``, to plant one misfiled row in vLLM's front end: the N-th request to
reach its first decode row gets the previous token's routing there, in every layer
(``tests/harness/engine_plants.py``). Never used by the plugin."""

from tests.harness.engine_plants import OUTPUT_PROCESSOR, install_from_env
from vllm_ascend_routing._post_import import when_imported

when_imported(OUTPUT_PROCESSOR, lambda module: install_from_env())
