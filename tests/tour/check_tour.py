#!/usr/bin/env python3
"""Runs every command and Python cell of docs/tour.md and checks that its output keeps the shape
the tour shows (CTest "tour: docs/tour.md"), so the tour cannot rot.

Blocks:
  ```console          lines "$ CMD" are run with bash in the repository root (`build/` is the
                      build directory given); the lines after a command, up to the next "$ ", are
                      its expected output.
  ```console torch    the same, skipped (and said so) when the build has no torch driver.
  ```python           a notebook cell: run in one namespace shared by all cells, `import dssim`
                      from --python-path; an ```text block right after it is its expected output.
                      Cells hold the tour's claims as asserts.
Shape: the expected lines must appear in the output in order (other lines may come between);
numbers match any number, runs of spaces any run, "..." lines are skipped and a line ending in
" ..." leaves the rest of that line free. Wording, columns and
the order of rows must stay.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path

NUMBER = r"[-+]?(?:\d[\d,]*)?\.?\d+(?:[eE][-+]?\d+)?"
TOKEN = re.compile(NUMBER)


def shape(line: str) -> re.Pattern:
    line = line.strip()  # (an escaped trailing blank would leave a lone backslash at the end)
    out, pos = [], 0
    for m in TOKEN.finditer(line):
        out.append(re.escape(line[pos:m.start()]))
        out.append(NUMBER)
        pos = m.end()
    out.append(re.escape(line[pos:]))
    pattern = "".join(out).strip()
    pattern = re.sub(r"(\\ )+", r"\\s+", pattern)
    return re.compile(pattern)


def check_shape(expected: list[str], actual: str) -> str | None:
    """None when every expected line (in order) matches some later actual line, else why not."""
    lines = actual.splitlines()
    i = 0
    for e in expected:
        if not e.strip() or e.strip() == "...":
            continue
        pat = shape(e.rstrip()[:-3] if e.rstrip().endswith(" ...") else e)  # "label ...": the rest is free
        while i < len(lines) and not pat.search(lines[i]):
            i += 1
        if i == len(lines):
            return f"no output line has the shape of: {e.strip()!r}"
        i += 1
    return None


def blocks(text: str):
    """(kind, info, lines, line_number) for each fenced block."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\S*)\s*(.*)$", lines[i])
        if m:
            start = i + 1
            j = start
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            yield m.group(1), m.group(2).strip(), lines[start:j], start
            i = j + 1
        else:
            i += 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tour", help="docs/tour.md")
    ap.add_argument("--build", required=True, help="the build directory (has dssim and python/)")
    ap.add_argument("--list", action="store_true", help="list the commands and cells, run nothing")
    a = ap.parse_args()
    root = Path(a.tour).resolve().parent.parent
    build = Path(a.build).resolve()
    has_torch = (build / "dssim_torch_run").exists()
    env = dict(os.environ, PYTHONPATH=str(build / "python") + os.pathsep + os.environ.get("PYTHONPATH", ""),
               MPLBACKEND="Agg")
    sys.path.insert(0, str(build / "python"))
    os.chdir(root)
    ns: dict = {"__name__": "__tour__"}
    failures, ran, skipped = [], 0, 0
    items = list(blocks(Path(a.tour).read_text(encoding="utf-8")))
    for n, (kind, info, body, line) in enumerate(items):
        if kind == "console":
            cmds: list[tuple[str, list[str]]] = []
            for l in body:
                if l.startswith("$ "):
                    cmds.append((l[2:], []))
                elif cmds:
                    cmds[-1][1].append(l)
            for cmd, expected in cmds:
                where = f"docs/tour.md:{line}: $ {cmd}"
                if a.list:
                    print(where)
                    continue
                if info == "torch" and not has_torch:
                    print(f"SKIP (no torch driver in this build) {where}")
                    skipped += 1
                    continue
                run = re.sub(r"(^|[\s;|&(])build/", lambda m: m.group(1) + str(build) + "/", cmd)
                t0 = time.monotonic()
                p = subprocess.run(["bash", "-o", "pipefail", "-c", run], capture_output=True, text=True, env=env)
                ran += 1
                print(f"{time.monotonic() - t0:6.1f} s  {where}", flush=True)
                if p.returncode != 0:
                    failures.append(f"{where}\n  exit {p.returncode}\n{p.stderr[-2000:]}")
                    continue
                why = check_shape(expected, p.stdout + p.stderr)
                if why:
                    failures.append(f"{where}\n  {why}\n  output was:\n{p.stdout[-3000:]}")
        elif kind == "python":
            where = f"docs/tour.md:{line}: python cell"
            expected = []
            if n + 1 < len(items) and items[n + 1][0] == "text" and items[n + 1][3] <= line + len(body) + 4:
                expected = items[n + 1][2]
            if a.list:
                print(where)
                continue
            buf = io.StringIO()
            t0 = time.monotonic()
            try:
                with contextlib.redirect_stdout(buf):
                    exec(compile("\n".join(body), where, "exec"), ns)
            except Exception:
                failures.append(f"{where}\n{traceback.format_exc()[-3000:]}\n  output so far:\n{buf.getvalue()[-2000:]}")
                continue
            finally:
                ran += 1
                print(f"{time.monotonic() - t0:6.1f} s  {where}", flush=True)
            why = check_shape(expected, buf.getvalue())
            if why:
                failures.append(f"{where}\n  {why}\n  output was:\n{buf.getvalue()[-3000:]}")
    if a.list:
        return 0
    print(f"\ntour: {ran} commands and cells run, {skipped} skipped, {len(failures)} failed")
    for f in failures:
        print(f"\nFAIL {f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
