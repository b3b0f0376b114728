#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""make gpu-e2e-prep: build, here, the payload one GPU run carries (docs/development.md, "The GPU end-to-end run").

    python scripts/gpu_e2e/prep.py [--dest .gpu-e2e] [--force]

The GPU machine has Python 3.12 and torch 2.11.0+cu130 but no network, and a run carries at most 64 MiB of files
(the working tree included). vLLM 0.26.0 is the newest release whose torch pin is 2.11.0; its CUDA wheel is about
290 MiB. This script, on a machine that reaches the package index (through pip and its configured index):

1. downloads that wheel (``pip download``, Python 3.12, manylinux x86-64), unpacks it and drops what an offline
   engine on Hopper with Triton attention never loads (FlashAttention 2/3, FlashMLA, DeepGEMM, the SM100 FMHA,
   qutlass, the Rust tool parser, the file-IO and the serving UI's static files), leaving an import stub where
   vLLM imports FlashAttention's module unconditionally;
2. cuts vLLM's own kernels (``_C``, ``_moe_C``) to sm_90 code (``fatbin.py``: other architectures zeroed, offsets
   kept), and zips the tree: ``vllm-0.26.0-sm90.zip``;
3. downloads the wheels ``requirements.txt`` names (what the image lacks) into ``deps/``;
4. writes ``manifest.json`` (recipe hash, files, sizes, SHA-256) and checks that the payload with the working tree
   stays under the 64 MiB one run carries; prints the sizes.

Reused as it is when its manifest's recipe (the release, what is dropped and cut, the pins, ``fatbin.py``) is
unchanged and every file is there with its size (``--force`` rebuilds). The destination must be ignored by git
(``.gitignore`` has ``/.gpu-e2e/``): it travels only as the run's ``carry``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

import fatbin  # noqa: E402

VLLM_VERSION = "0.26.0"
ARCH = 90  # H100 and H200
ZIP_NAME = f"vllm-{VLLM_VERSION}-sm{ARCH}.zip"
MANIFEST = "manifest.json"
LIMIT_BYTES = 64 * 1024 * 1024  # what one device run carries, the working tree included
PYTHON_TAG = ("--python-version", "3.12", "--implementation", "cp")
# vLLM's wheel is manylinux_2_28; the small wheels name their own manylinux levels, which pip matches exactly.
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(5, 40)] + ["manylinux2014_x86_64", "manylinux1_x86_64"]
# Never loaded by an offline engine on an H100/H200 with Triton attention; about 250 MiB of the wheel.
DROPPED = (
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
    "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so",
    "vllm/vllm-rs",
    "vllm/third_party/deep_gemm",
    "vllm/third_party/fmha_sm100",
    "vllm/_flashmla_C.abi3.so",
    "vllm/_flashmla_extension_C.abi3.so",
    "vllm/_qutlass_C.abi3.so",
    "vllm/_rust_tool_parser.abi3.so",
    "vllm/fs_io_C.abi3.so",
    "vllm/entrypoints/serve/instrumentator/static",
)
# vLLM imports this FlashAttention module at start-up whatever the backend: an empty module stands in.
STUB = "vllm/vllm_flash_attn/_vllm_fa2_C.py"
STRIPPED = ("vllm/_C_stable_libtorch.abi3.so", "vllm/_moe_C_stable_libtorch.abi3.so")


class PrepError(RuntimeError):
    """The payload could not be built or does not fit: the message says why."""


def requirements() -> list[str]:
    """``requirements.txt``'s pins, comments left out."""
    lines = (line.split("#", 1)[0].strip() for line in (HERE / "requirements.txt").read_text().splitlines())
    return [line for line in lines if line]


def recipe_hash() -> str:
    """What decides the payload's bytes: the release, what is dropped and cut, the pins, the cutting code."""
    recipe = [VLLM_VERSION, ARCH, DROPPED, STUB, STRIPPED, PYTHON_TAG, PLATFORMS, requirements()]
    digest = hashlib.sha256(json.dumps(recipe).encode())
    digest.update((HERE / "fatbin.py").read_bytes())
    return digest.hexdigest()[:16]


def mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def pip_download(destination: Path, *requirements: str, platforms: list[str]) -> None:
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", *PYTHON_TAG]
    command += [arg for platform in platforms for arg in ("--platform", platform)]
    command += ["-d", str(destination), *requirements]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise PrepError(f"pip download {' '.join(requirements)} failed:\n{(done.stdout + done.stderr)[-3000:]}")


def build_vllm_zip(work: Path, destination: Path) -> dict[str, Any]:
    """vLLM's CUDA wheel, unpacked, trimmed and cut to sm_90, zipped to ``destination``."""
    wheels = work / "wheel"
    pip_download(wheels, f"vllm=={VLLM_VERSION}", platforms=["manylinux_2_28_x86_64"])
    (wheel,) = wheels.glob(f"vllm-{VLLM_VERSION}-*.whl")
    tree = work / "tree"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(tree)
    dropped = []
    for relative in DROPPED:
        path = tree / relative
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        else:
            continue
        dropped.append(relative)
    (tree / STUB).write_text('"""Import stub: FlashAttention is not carried; use attention_backend="TRITON_ATTN"."""\n')
    stripped = {}
    for relative in STRIPPED:
        library = tree / relative
        if not library.exists():
            raise PrepError(f"{wheel.name} has no {relative}: the sm_{ARCH} cut does not know this wheel")
        stripped[relative] = fatbin.strip(library, library, ARCH)
    with zipfile.ZipFile(destination, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=6) as archive:
        for path in sorted(tree.rglob("*")):
            if path.is_file():
                archive.write(path, path.relative_to(tree).as_posix())
    return {"wheel": wheel.name, "wheel_bytes": wheel.stat().st_size, "dropped": dropped, "stripped": stripped}


def files_of(dest: Path) -> dict[str, dict[str, Any]]:
    out = {}
    for path in sorted(dest.rglob("*")):
        if path.is_file() and path.name != MANIFEST:
            data = path.read_bytes()
            out[path.relative_to(dest).as_posix()] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    return out


def up_to_date(dest: Path) -> dict[str, Any] | None:
    """The manifest, if ``dest`` holds this recipe's payload with every file at its recorded size."""
    try:
        manifest = json.loads((dest / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if manifest.get("recipe") != recipe_hash():
        return None
    for name, info in manifest["files"].items():
        path = dest / name
        if not path.is_file() or path.stat().st_size != info["bytes"]:
            return None
    return dict(manifest)


def working_tree_bytes() -> int:
    """What a device run sends besides the carried payload: tracked and untracked-not-ignored files."""
    done = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        return 0  # not a git checkout (an sdist): nothing to add
    paths = [ROOT / name.decode() for name in done.stdout.split(b"\0") if name]
    return sum(path.stat().st_size for path in paths if path.is_file())


def ignored_by_git(path: Path) -> bool:
    done = subprocess.run(["git", "check-ignore", "-q", str(path)], cwd=ROOT, capture_output=True, check=False)
    return done.returncode == 0 or done.returncode == 128  # 128: not a git checkout


def build(dest: Path) -> dict[str, Any]:
    started = time.monotonic()
    if dest.exists():
        shutil.rmtree(dest)
    (dest / "deps").mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="gpu_e2e_prep_") as work:
        vllm = build_vllm_zip(Path(work), dest / ZIP_NAME)
    pip_download(dest / "deps", "-r", str(HERE / "requirements.txt"), platforms=PLATFORMS)
    manifest = {
        "recipe": recipe_hash(),
        "vllm": VLLM_VERSION,
        "arch": f"sm_{ARCH}",
        "python": "3.12",
        "built": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "build_seconds": round(time.monotonic() - started),
        "vllm_wheel": vllm,
        "files": files_of(dest),
    }
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def check_size(dest: Path) -> str:
    payload = sum(path.stat().st_size for path in dest.rglob("*") if path.is_file())
    tree = working_tree_bytes()
    zipped = (dest / ZIP_NAME).stat().st_size
    deps = sum(path.stat().st_size for path in (dest / "deps").glob("*.whl"))
    line = (
        f"payload {dest.name}: {mib(payload)} ({payload} bytes: {ZIP_NAME} {mib(zipped)}, "
        f"{len(list((dest / 'deps').glob('*.whl')))} wheels {mib(deps)}); with the working tree ({mib(tree)}) "
        f"{mib(payload + tree)} of the {mib(LIMIT_BYTES)} one device run carries"
    )
    if payload + tree > LIMIT_BYTES:
        raise PrepError(f"{line}: too large for one run")
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--dest", type=Path, default=ROOT / ".gpu-e2e", help="the payload folder (git-ignored)")
    parser.add_argument("--force", action="store_true", help="rebuild even if the payload is up to date")
    args = parser.parse_args(argv)
    dest = args.dest if args.dest.is_absolute() else ROOT / args.dest
    try:
        dest.mkdir(parents=True, exist_ok=True)  # git tells an ignored folder only once it exists
        if dest.resolve().is_relative_to(ROOT.resolve()) and not ignored_by_git(dest):
            raise PrepError(f"{dest} is not ignored by git: it would travel as part of the working tree, twice")
        manifest = None if args.force else up_to_date(dest)
        if manifest is None:
            print(f"gpu-e2e-prep: building the payload in {dest} (vLLM {VLLM_VERSION}, sm_{ARCH})", flush=True)
            manifest = build(dest)
            how = f"built in {manifest['build_seconds']} s"
        else:
            how = f"up to date (recipe {manifest['recipe']}, built {manifest['built']})"
        print(f"gpu-e2e-prep: {check_size(dest)}; {how}", flush=True)
    except (PrepError, fatbin.FatbinError) as error:
        print(f"gpu-e2e-prep: FAILED: {error}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
