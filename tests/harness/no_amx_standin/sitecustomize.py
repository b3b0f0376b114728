# SPDX-License-Identifier: Apache-2.0
"""TEST-ONLY: put on ``PYTHONPATH`` of end-to-end engine processes (never by the plugin) where vLLM's own
CPU MoE refuses the float32 test models on this CPU.

vLLM 0.27's ``CPUFusedMOE.check_grouped_gemm`` raises on an AMX CPU unless the expert weights are
bfloat16, so no float32 MoE model starts there, plugin or not; the reference comparison needs float32.
This hides AMX from that choice only (``torch.cpu._is_amx_tile_supported``, read when a MoE layer is
built): vLLM then takes the packed AVX-512 kernel it uses on every CPU without AMX. Routing (vLLM's
``select_experts``, where the plugin captures) runs before and apart from the kernel choice.
"""

from tests.harness.cpu_moe_choice import CPU_MOE_MODULE, hide_amx
from vllm_ascend_routing._post_import import when_imported

when_imported(CPU_MOE_MODULE, hide_amx)
