# SPDX-License-Identifier: Apache-2.0
"""Several cases of ``npu_runner_step`` from one process (run by ``test_npu_runner.py``):

    python -m tests.ascend.npu_runner_cases "v1" "v1 --async --hybrid" ...

Each case must see the runner module's first import, after the plugin registers: each runs in a child of its
own, forked once this process has made the imports every case makes before that (torch, vLLM, vllm-ascend's
stubbed source: about 9 of a case's 25 s here). Prints ``CASE <arguments>`` before a case's own lines (its
``RESULT``) and ``CASE_STATUS <status>`` after them.
"""

from __future__ import annotations

import functools
import os
import shlex
import sys
import traceback
from collections.abc import Callable


def preload() -> None:
    """What ``npu_runner_step.main`` imports before the plugin registers and the runner module is imported."""
    from tests.ascend import (  # noqa: F401 (vllm-ascend's source on sys.path, torch_npu stubbed)
        conftest,
        moe_methods,
        npu_runner_step,
        real_moe,
    )

    os.environ["VLLM_ASCEND_ROUTING"] = "1"
    from vllm.platforms import current_platform  # noqa: F401

    import vllm_ascend_routing  # noqa: F401
    from vllm_ascend_routing import peers  # noqa: F401


def run_forked(case: Callable[[], object]) -> int:
    """``case`` in a child process: its exit status (0 once it returned, 1 if it raised, a SystemExit's code)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: the case, then out without running this process's exit handlers twice
        status = 0
        try:
            case()
        except SystemExit as stopped:
            status = stopped.code if isinstance(stopped.code, int) else 1
        except BaseException:
            traceback.print_exc()
            status = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    _, wait_status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(wait_status)


def run_step(argv: list[str]) -> None:
    from tests.ascend import npu_runner_step

    npu_runner_step.main(argv)


def main(cases: list[str]) -> int:
    preload()
    failed = 0
    for case in cases:
        print(f"CASE {case}", flush=True)
        status = run_forked(functools.partial(run_step, shlex.split(case)))
        print(f"CASE_STATUS {status}", flush=True)
        failed += status != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
