# SPDX-License-Identifier: Apache-2.0
"""The next step doctor prints for each kind of failure, in one place (``preflight.startup`` for the start-up
kinds, ``preflight.doctor`` for the others). Paths are the checkout's (``docs/...``)."""

from __future__ import annotations

COMPATIBILITY = "docs/compatibility.md"
PAIRS = "vLLM's wheel brings the torch it was built for; on Ascend, torch_npu and vllm-ascend match CANN and vLLM"

ENGINE_FLAGS = (
    "fix the engine flags after `--`: vLLM's own parser refused them and printed why on stderr (they are "
    "`vllm serve`'s engine flags, read by the installed vLLM)"
)
PLUGIN_REFUSED = (
    "the plugin refused this release or layout before returning wrong rows; its message says what to change "
    "(what is refused and why: docs/usage.md#refused-at-start-up)"
)
NUMA_BINDING = (
    "vLLM's CPU build binds each local rank's threads to a NUMA node of its own and this machine has fewer: give "
    "each rank its cores, VLLM_CPU_OMP_THREADS_BIND='0-15|16-31' (one core list per rank, '|' between), or lower "
    "--tensor-parallel-size / --data-parallel-size (doctor sets one list per rank itself where the variable is unset)"
)
OUT_OF_MEMORY = (
    "the weights, KV cache and activations do not fit: lower --max-model-len or --max-num-seqs, raise "
    "--tensor-parallel-size, set --gpu-memory-utilization (GPU, NPU) or --kv-cache-memory-bytes (CPU), and check "
    "that no other process holds the device (nvidia-smi, npu-smi info)"
)
COLLECTIVE_INIT = (
    "the ranks could not set up their communicator (NCCL, HCCL or gloo): every node must reach the others on the "
    "interface NCCL_SOCKET_IFNAME / HCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME names (VLLM_HOST_IP: the address vLLM "
    "announces), the port must be free, the devices visible (CUDA_VISIBLE_DEVICES, ASCEND_RT_VISIBLE_DEVICES); "
    "rerun with NCCL_DEBUG=INFO or ASCEND_GLOBAL_LOG_LEVEL=1 for the cause"
)
MODEL = (
    "vLLM could not load the model: --model must be a local directory with config.json and the weights, or a hub "
    "name this host may download (not with HF_HUB_OFFLINE=1), of an architecture the installed vLLM implements "
    "(--trust-remote-code runs a model's own code)"
)
UNKNOWN = (
    "not a failure doctor knows: the traceback is above (stderr); attach `doctor --json`'s document and the log to "
    "a bug report (.github/ISSUE_TEMPLATE/bug_report.md)"
)
SETTING = "fix the plugin's variable named (docs/usage.md#configuration), then rerun doctor"
PLATFORM = "pass --platform (cuda, cpu, npu) to check a release this machine cannot run (with --surface)"
NOT_COVERED = (
    f"this release lacks what the plugin relies on: use a release of {COMPATIBILITY}, and report it (the line "
    "names the symbol)"
)
ROUTING = (
    "the rows are wrong here: what each fault means and what to send: docs/preflight.md (the verdict table); "
    "attach `doctor --json`'s document to a bug report"
)
