#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""After a native build: the _C module loads and registers its kernel for the op's device dispatch key.

    python scripts/check_native.py cuda

Exits non-zero with the reason when it does not. Runs from outside the checkout so the installed package
(with its built ``_C``) is the one imported.
"""

from __future__ import annotations

import sys

KEYS = {"cuda": "CUDA", "npu": "PrivateUse1"}


def main() -> int:
    backend = sys.argv[1]
    import torch

    from vllm_ascend_routing import ops

    active = ops.kernel_backend()
    if not active.startswith(f"native-{backend}"):
        print(f"FAIL: kernel backend is {active!r}, expected native-{backend}")
        return 1
    dump = torch._C._dispatch_dump("vllm_ascend_routing::record_topk_ids")
    registered = [line for line in dump.splitlines() if line.startswith(f"{KEYS[backend]}:")]
    if not registered:
        print(f"FAIL: no {KEYS[backend]} kernel registered for vllm_ascend_routing::record_topk_ids")
        return 1
    print(f"OK: {active}; {registered[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
