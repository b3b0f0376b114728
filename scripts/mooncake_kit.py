#!/usr/bin/env python3
"""Provide Mooncake (client library and ``mooncake_master``) on a fresh machine, cached outside the clone.

    python scripts/mooncake_kit.py                          # for this interpreter's Python
    python scripts/mooncake_kit.py --python PY --print-env  # PYTHONPATH=, LD_LIBRARY_PATH=, MOONCAKE_MASTER= lines

Lives under ``$VLLM_ASCEND_ROUTING_CACHE/mooncake/<version>-<cp tag>/``:

- ``site/``: ``pip install --target`` of the Mooncake wheel (no deps: its ``aiohttp``/``requests`` would shadow a vLLM
  venv's own through ``PYTHONPATH``) and ``msgpack`` (vLLM's Mooncake connector wants it);
- ``libs/lib/``: the shared libraries ``mooncake.store`` links against and that a bare machine lacks (libibverbs,
  libnl), unpacked from Debian packages (``apt-get download`` + ``dpkg-deb -x``): no root install;
- ``complete.json``: written last; a folder without it is rebuilt.

Nothing is installed into any venv: a process gets Mooncake through ``Kit.env`` (``PYTHONPATH``, ``LD_LIBRARY_PATH``).
Two runs for one folder wait for each other (``<folder>.lock``).
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MOONCAKE_VERSION = "0.3.13.post1"
PACKAGE = "mooncake-transfer-engine-non-cuda"  # the CPU build; "-npu" on Ascend hosts, "-cuda13" on GPU hosts
EXTRA_PACKAGES = ["msgpack"]
DEBS = ["libibverbs1", "ibverbs-providers", "libnl-3-200", "libnl-route-3-200"]
# The sonames store.so needs beyond glibc/libstdc++ (checked after unpacking: a missing one fails the build).
NEEDED = ["libibverbs.so.1", "libnl-3.so.200", "libnl-route-3.so.200"]
RECIPE = "1"  # bump when the recipe changes: every cached kit is rebuilt


def cache_root() -> Path:
    """The environments' cache: scripts/venv.py's, loaded by path (``import venv`` here is the standard library's)."""
    spec = importlib.util.spec_from_file_location("_vllm_ascend_routing_venv_script", ROOT / "scripts" / "venv.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return Path(script.cache_root())


@dataclass(frozen=True)
class Kit:
    folder: Path
    site: Path
    lib_dir: Path
    master_binary: Path

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) with the kit first on PYTHONPATH and LD_LIBRARY_PATH."""
        env = dict(os.environ if base is None else base)
        for name, path in (("PYTHONPATH", self.site), ("LD_LIBRARY_PATH", self.lib_dir)):
            env[name] = os.pathsep.join([str(path), *([env[name]] if env.get(name) else [])])
        return env


def cp_tag(python: str) -> str:
    """``cp312`` for a CPython 3.12 interpreter (the wheel carries a compiled extension per Python)."""
    tag = subprocess.run(
        [python, "-c", "import sys; print(sys.implementation.cache_tag)"], check=True, capture_output=True, text=True
    ).stdout.strip()  # "cpython-312"
    if not tag.startswith("cpython-"):
        raise SystemExit(f"scripts/mooncake_kit.py: {python} is {tag}, not CPython: Mooncake ships CPython wheels only")
    return "cp" + tag.removeprefix("cpython-")


def _pip(python: str) -> list[str]:
    """The given interpreter's pip (it picks the wheel for its Python); else this one's acting for it."""
    if subprocess.run([python, "-m", "pip", "--version"], capture_output=True).returncode == 0:
        return [python, "-m", "pip"]
    return [sys.executable, "-m", "pip", "--python", python]


def _run(cmd: list[str], cwd: Path | None = None) -> None:
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, cwd=cwd, stdout=sys.stderr)


def _unpack_libs(libs: Path) -> Path:
    """Download and unpack the Debian packages; gather their top-level shared objects (libnl-3 unpacks under
    ``lib/``, the rest under ``usr/lib/``) in one folder, links kept, so one LD_LIBRARY_PATH entry serves."""
    debs, tree, flat = libs / "debs", libs / "root", libs / "lib"
    for path in (debs, tree, flat):
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
    _run(["apt-get", "download", *DEBS], cwd=debs)
    for deb in sorted(debs.glob("*.deb")):
        _run(["dpkg-deb", "-x", str(deb), str(tree)])
    for path in sorted(tree.rglob("lib*.so*")):
        if path.parent.name != "libibverbs" and not (flat / path.name).exists():  # providers: RDMA only
            shutil.copy2(path, flat / path.name, follow_symlinks=False)
    missing = [name for name in NEEDED if not (flat / name).exists()]
    if missing:
        raise SystemExit(f"scripts/mooncake_kit.py: {', '.join(missing)} not found in the packages {', '.join(DEBS)}")
    shutil.rmtree(debs)
    return flat


def _load(folder: Path) -> Kit | None:
    marker = folder / "complete.json"
    if not marker.exists():
        return None
    done = json.loads(marker.read_text())
    if done.get("recipe") != RECIPE:
        return None
    kit = Kit(folder, Path(done["site"]), Path(done["lib_dir"]), Path(done["master_binary"]))
    return kit if kit.master_binary.exists() and kit.lib_dir.is_dir() else None


def kit(python: str = sys.executable) -> Kit:
    """The Mooncake kit for ``python``'s CPython version, built on first call (minutes), then read from the cache."""
    base = cache_root() / "mooncake"
    base.mkdir(parents=True, exist_ok=True)
    folder = base / f"{MOONCAKE_VERSION}-{cp_tag(python)}"
    found = _load(folder)
    if found is not None:
        return found
    with open(base / f"{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = _load(folder)  # another run may have finished it while this one waited
        if found is not None:
            return found
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        # Into a scratch folder first, renamed when whole: an interrupted pip leaves no half-filled site/.
        scratch = Path(tempfile.mkdtemp(prefix="site.", dir=folder))
        _run([*_pip(python), "install", "--no-deps", "--target", str(scratch), f"{PACKAGE}=={MOONCAKE_VERSION}"])
        _run([*_pip(python), "install", "--target", str(scratch), *EXTRA_PACKAGES])
        site = folder / "site"
        scratch.rename(site)
        master = site / "mooncake" / "mooncake_master"  # the binary itself, not bin/'s Python wrapper
        if not master.exists():
            raise SystemExit(f"scripts/mooncake_kit.py: {PACKAGE}=={MOONCAKE_VERSION} has no {master.name} binary")
        master.chmod(master.stat().st_mode | 0o111)
        lib_dir = _unpack_libs(folder / "libs")
        done = {"recipe": RECIPE, "site": str(site), "lib_dir": str(lib_dir), "master_binary": str(master)}
        (folder / "complete.json").write_text(json.dumps(done, indent=1))
        result = _load(folder)
        assert result is not None
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", default=sys.executable, help="the interpreter the kit is for (default: this one)")
    parser.add_argument(
        "--print-env", action="store_true", help="print PYTHONPATH=, LD_LIBRARY_PATH=, MOONCAKE_MASTER="
    )
    args = parser.parse_args()
    found = kit(args.python)
    if args.print_env:
        env = found.env({})
        print(f"PYTHONPATH={env['PYTHONPATH']}")
        print(f"LD_LIBRARY_PATH={env['LD_LIBRARY_PATH']}")
        print(f"MOONCAKE_MASTER={found.master_binary}")
    else:
        print(found.folder)


if __name__ == "__main__":
    main()
