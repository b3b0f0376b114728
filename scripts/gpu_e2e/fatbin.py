#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Keep one GPU architecture's code in a CUDA extension's embedded fatbins (``make gpu-e2e-prep``).

    python scripts/gpu_e2e/fatbin.py --arch 90 SRC DST [SRC DST ...]

A CUDA extension (``.so``) embeds its GPU code in the ELF section ``.nv_fatbin``: a run of fatbins, each a
header and entries (kind 1 = PTX, kind 2 = a cubin for one ``sm_XY``). Every cubin for another architecture, and
the PTX wherever the fatbin holds a cubin for ``--arch``, is overwritten with zeros; where a fatbin has no such
cubin its PTX up to ``--arch`` is kept (the driver JIT-compiles it on first use). The file keeps its size and every
offset, so it still loads; the zeros compress to almost nothing, which is the point: vLLM 0.26.0's wheel goes from
about 290 MiB to about 40 MiB zipped. If the GPU then reports "no kernel image is available for execution on the
device", this step is what to suspect (the GPU is not ``sm_<arch>``, or a kernel was only present for another one).

The ELF section table is read here (no ``readelf``): a 64-bit little-endian ELF, as every x86-64 and AArch64
extension is.
"""

from __future__ import annotations

import argparse
import struct
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

FATBIN_MAGIC = 0xBA55ED50
PTX, CUBIN = 1, 2
HEADER = struct.Struct("<IHHQ")  # magic, version, header size, size of the entries that follow
ENTRY = struct.Struct("<HHIQIIHHI")  # kind, flags, header size, payload size, ..., arch


class FatbinError(ValueError):
    """The file is not what this tool understands: nothing is written."""


@dataclass(frozen=True)
class Entry:
    kind: int  # PTX or CUBIN
    arch: int  # 90 for sm_90 / compute_90
    start: int  # payload offset in the file
    size: int


def section(data: bytes, name: str = ".nv_fatbin") -> tuple[int, int]:
    """``(file offset, size)`` of the ELF section ``name``."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise FatbinError("not a 64-bit little-endian ELF file")
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_offset = headers[shstrndx][4]
    for header in headers:
        start = names_offset + header[0]
        if data[start : data.index(b"\0", start)].decode() == name:
            return int(header[4]), int(header[5])
    raise FatbinError(f"no {name} section")


def fatbins(data: bytes) -> list[list[Entry]]:
    """Every fatbin of the ``.nv_fatbin`` section, as its entries."""
    offset, size = section(data)
    found: list[list[Entry]] = []
    position, end = offset, offset + size
    while position + HEADER.size <= end:
        magic, _version, header_size, entries_size = HEADER.unpack_from(data, position)
        if magic != FATBIN_MAGIC:
            position += 8  # fatbins are 8-byte aligned, padding between them
            continue
        entry, stop = position + header_size, position + header_size + entries_size
        entries = []
        while entry < stop:
            kind, _flags, entry_header, payload, *_rest, arch = ENTRY.unpack_from(data, entry)
            entries.append(Entry(kind, arch, entry + entry_header, payload))
            entry += entry_header + payload
        found.append(entries)
        position = stop
    if not found:
        raise FatbinError("the .nv_fatbin section holds no fatbin")
    return found


def keep(entry: Entry, arch: int, has_cubin: bool) -> bool:
    """A cubin for ``arch``; PTX up to ``arch`` only where the fatbin has no such cubin."""
    if entry.kind == CUBIN:
        return entry.arch == arch
    return entry.kind == PTX and not has_cubin and entry.arch <= arch


def strip(source: Path, destination: Path, arch: int) -> dict[str, int]:
    """Write ``source`` to ``destination`` with every other architecture's code zeroed; byte counts per outcome."""
    data = source.read_bytes()
    out = bytearray(data)
    stats: Counter[str] = Counter()
    for entries in fatbins(data):
        has_cubin = any(e.kind == CUBIN and e.arch == arch for e in entries)
        stats["fatbins"] += 1
        stats["fatbins_without_own_cubin"] += not has_cubin
        for entry in entries:
            if keep(entry, arch, has_cubin):
                stats["kept_cubin" if entry.kind == CUBIN else "kept_ptx"] += entry.size
            else:
                out[entry.start : entry.start + entry.size] = bytes(entry.size)
                stats["zeroed"] += entry.size
    if not stats["kept_cubin"] and not stats["kept_ptx"]:
        raise FatbinError(f"{source.name}: no code for sm_{arch} at all: the stripped library could run nothing")
    destination.write_bytes(bytes(out))
    return dict(stats)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="the architecture kept (90: H100, H200)")
    parser.add_argument("paths", nargs="+", help="SRC DST pairs")
    args = parser.parse_args(argv)
    if len(args.paths) % 2:
        parser.error("give SRC DST pairs")
    for source, destination in zip(args.paths[::2], args.paths[1::2], strict=True):
        print(Path(source).name, strip(Path(source), Path(destination), args.arch))
    return 0


if __name__ == "__main__":
    sys.exit(main())
