#!/usr/bin/env python3
"""Render every plot headless into a temporary folder and check each PNG.

  check_render.py DSSIM  -> exit 0 when pipeline_timeline, memory_breakdown, scaling, validation,
                            compare, plan_sweep and what_if exist, are valid PNGs (signature, IHDR, IEND) of a sane
                            size in pixels, and are not trivially small files.
"""
import os
import struct
import sys
import tempfile
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "plots"))
os.environ["MPLBACKEND"] = "Agg"

import render_all  # noqa: E402

EXPECTED = ["pipeline_timeline", "memory_breakdown", "scaling", "validation", "compare", "plan_sweep", "what_if"]
MIN_BYTES = 20_000     # a blank or axes-only figure of this size compresses to a few KB
MAX_BYTES = 2_000_000


def check_png(path: Path) -> list[str]:
    problems = []
    data = path.read_bytes()
    if not data.startswith(b"\x89PNG\r\n\x1a\n"):
        return [f"{path.name}: not a PNG (bad signature)"]
    length, ctype = struct.unpack(">I4s", data[8:16])
    if ctype != b"IHDR" or length != 13:
        return [f"{path.name}: first chunk is {ctype!r}, not IHDR"]
    ihdr = data[16:29]
    crc = struct.unpack(">I", data[29:33])[0]
    if zlib.crc32(b"IHDR" + ihdr) != crc:
        problems.append(f"{path.name}: IHDR CRC mismatch")
    w, h = struct.unpack(">II", ihdr[:8])
    if not (400 <= w <= 4000 and 300 <= h <= 4000):
        problems.append(f"{path.name}: odd size {w}x{h} px")
    if not data.rstrip(b"\x00").endswith(b"IEND\xaeB`\x82"):
        problems.append(f"{path.name}: truncated (no IEND chunk)")
    if not MIN_BYTES <= len(data) <= MAX_BYTES:
        problems.append(f"{path.name}: {len(data)} bytes, expected {MIN_BYTES}..{MAX_BYTES}")
    print(f"  {path.name}: {w}x{h} px, {len(data)} bytes")
    return problems


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="dssim-plots-") as tmp:
        out = Path(tmp)
        render_all.render_all(sys.argv[1], out)
        problems = []
        for name in EXPECTED:
            p = out / f"{name}.png"
            if not p.exists():
                problems.append(f"{name}.png was not written")
                continue
            problems += check_png(p)
        extra = sorted(set(f.stem for f in out.iterdir()) - set(EXPECTED))
        if extra:
            print(f"  (also rendered: {extra})")
    for pr in problems:
        print(f"FAIL {pr}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
