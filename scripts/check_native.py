#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""After a native build: the _C module loads and registers its kernels for the op's dispatch keys (the CPU
kernel in every build, plus the device kernel of a cuda or npu build), and the eager capture takes the CPU
kernel's direct entry; it says whether the CPU kernel splits large batches over torch's threads.

    python scripts/check_native.py cpu|cuda|npu

Exits non-zero with the reason when it does not. Runs from outside the checkout so the installed package
(with its built ``_C``) is the one imported.
"""

from __future__ import annotations

import sys

KEYS = {"cpu": ("CPU",), "cuda": ("CPU", "CUDA"), "npu": ("CPU", "PrivateUse1")}


def main() -> int:
    backend = sys.argv[1]
    import torch

    from vllm_ascend_routing import ops

    active = ops.kernel_backend()
    if not active.startswith(f"native-{backend}"):
        print(f"FAIL: kernel backend is {active!r}, expected native-{backend}")
        return 1
    from vllm_ascend_routing.ops import _library

    if _library.HOST_KERNEL or _library.NATIVE_RECORD_ROWS is None:
        print("FAIL: the CPU kernel's direct entry is not what the eager capture calls")
        return 1
    dump = torch._C._dispatch_dump("vllm_ascend_routing::record_topk_ids")
    registered = []
    for key in KEYS[backend]:
        lines = [line for line in dump.splitlines() if line.startswith(f"{key}:") and "csrc" in line]
        if not lines:
            print(f"FAIL: no native {key} kernel registered for vllm_ascend_routing::record_topk_ids")
            return 1
        registered.append(lines[0])
    from vllm_ascend_routing import _C  # type: ignore[attr-defined]

    split = "large batches split over torch's threads" if _C.CPU_PARALLEL else "serial (built without OpenMP)"
    print(f"OK: {active}; " + "; ".join(registered) + f"; CPU kernel: {split}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
