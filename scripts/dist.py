#!/usr/bin/env python3
"""``make dist``: the sdist and the pure-Python wheel (``py3-none-any``) of this checkout, into ``dist/``.

Built through setuptools' own PEP 517 hooks in this Python (setuptools>=77 and wheel installed, as pyproject's
build-system asks), so nothing is fetched: it works on an air-gapped host. ``VLLM_ASCEND_ROUTING_TARGET_DEVICE``
is dropped for the build: the native kernels stay opt-in source builds (``pip install`` of the sdist with the
variable set, see docs/kernels.md). Prints the two paths; fails unless the wheel's name carries the version and
the ``py3-none-any`` tag.

    python scripts/dist.py [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def package_version() -> str:
    text = (ROOT / "vllm_ascend_routing" / "__init__.py").read_text()
    match = re.search(r'^__version__ = "([^"]+)"', text, re.MULTILINE)
    if match is None:
        raise SystemExit("scripts/dist.py: no __version__ in vllm_ascend_routing/__init__.py")
    return match.group(1)


def build(out: Path) -> tuple[Path, Path]:
    """``(sdist, wheel)`` built into ``out``."""
    os.environ.pop("VLLM_ASCEND_ROUTING_TARGET_DEVICE", None)  # setup.py reads it: no kernel in the wheel
    out.mkdir(parents=True, exist_ok=True)
    os.chdir(ROOT)  # the hooks build the project in the current directory
    sys.path.insert(0, str(ROOT))
    from setuptools import build_meta  # type: ignore[import-untyped]

    sdist = out / build_meta.build_sdist(str(out))
    wheel = out / build_meta.build_wheel(str(out))
    version = package_version()
    expected = f"vllm_ascend_routing-{version}-py3-none-any.whl"
    if wheel.name != expected:
        raise SystemExit(f"scripts/dist.py: built {wheel.name}, expected {expected} (a native kernel got in?)")
    if not sdist.name.startswith(f"vllm_ascend_routing-{version}."):
        raise SystemExit(f"scripts/dist.py: sdist {sdist.name} does not carry version {version}")
    return sdist, wheel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "dist")
    args = parser.parse_args()
    for path in build(args.out.resolve()):
        print(path)


if __name__ == "__main__":
    main()
