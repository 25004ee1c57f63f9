"""How much code each function of a megakernel compiles to: PTX instructions per function of its megakernel.py.

    CUTE_DSL_LINEINFO=1 K3MK_CACHE_DIR=$(mktemp -d) k3mk compile ... --out DIR     # line info, no cached kernel
    python bench/code_size.py DIR [--top N]

A task whose code is cold in the SM's instruction cache pays for fetching it before its first fill (BENCHMARKS.md
2026-12-07 midday and afternoon: kda_conv's three copies, the 64 chunks mla_v_up unrolled, the gemvs of one width that
each had their own copy). The op functions are inlined into the one kernel, so the PTX's `.loc` directives (which
`CUTE_DSL_LINEINFO=1` emits) are what attributes its instructions to the source: each instruction counts for the
function (`def ...`) whose line its last `.loc` names. Directives, labels and braces are not instructions. The compile
cache's key does not include the environment, hence the empty K3MK_CACHE_DIR.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path


def instructions_per_function(source: str, ptx: str) -> Counter:
    """PTX instructions per function of `source` (megakernel.py), from the `.loc` lines of `ptx` that name file 1."""
    function_of_line: list[str | None] = []
    current = None
    for line in source.splitlines():
        match = re.match(r"def (\w+)\(", line)
        if match:
            current = match.group(1)
        function_of_line.append(current)
    counts: Counter = Counter()
    line_no = None
    for raw in ptx.splitlines():
        text = raw.strip()
        if text.startswith(".loc"):
            file_no, line_no = (int(x) for x in text.split()[1:3])
            line_no = line_no if file_no == 1 and 0 < line_no <= len(function_of_line) else None
            continue
        if not text or text.startswith((".", "//", "{", "}", "$")) or text.endswith(":") or line_no is None:
            continue
        counts[function_of_line[line_no - 1] or "(module)"] += 1
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", type=Path, help="an artifact directory built with CUTE_DSL_LINEINFO=1")
    parser.add_argument("--top", type=int, default=30, help="functions to list, largest first (default 30)")
    args = parser.parse_args(argv)
    source, ptx = args.artifact / "megakernel.py", next(iter(sorted(args.artifact.glob("megakernel.*.ptx"))), None)
    if not source.exists() or ptx is None:
        print(f"code_size: {args.artifact} has no megakernel.py and megakernel.<arch>.ptx (is it an artifact directory?)", file=sys.stderr)
        return 2
    counts = instructions_per_function(source.read_text(), ptx.read_text())
    if not counts:
        print(f"code_size: {ptx} has no .loc lines: build it with CUTE_DSL_LINEINFO=1 and an empty K3MK_CACHE_DIR", file=sys.stderr)
        return 2
    print(f"{ptx.name}: {sum(counts.values())} PTX instructions")
    for name, n in counts.most_common(args.top):
        print(f"{n:8d}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
