"""Build one artifact per megakernel test case (needs CuTe DSL; no GPU):

    python tests/runtime/build_megakernel_cases.py [--out DIR] [--arch sm_90a] [--config K=V --suffix S] [CASE ...]

--out defaults to <repo>/artifacts_dev (ignored by git; carried to the GPU machine)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from megakernel_cases import all_cases, artifacts_dir  # noqa: E402

from k3mk.codegen.build import build  # noqa: E402
from k3mk.codegen.ops import KernelConfig  # noqa: E402


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=artifacts_dir())
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--config", action="append", default=[], help="KernelConfig field=value (tuning sweeps)")
    ap.add_argument("--suffix", default="", help="artifact directory suffix: <case>@<suffix>")
    ap.add_argument("cases", nargs="*")
    args = ap.parse_args(argv)
    knobs = {}
    for item in args.config:
        key, value = item.split("=")
        knobs[key] = value.lower() == "true" if value.lower() in ("true", "false") else int(value)
    cases = all_cases()
    unknown = [name for name in args.cases if name not in cases]
    if unknown:
        ap.error(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(cases)}")
    for name in args.cases or cases:
        case = cases[name]
        t0 = time.perf_counter()
        config = KernelConfig(**{"debug": case.debug, **knobs})
        target = args.out / (f"{name}@{args.suffix}" if args.suffix else name)
        out = build(case.builder.table(), target, arch=args.arch, config=config, check=case.check)
        print(f"{name:32s} {time.perf_counter() - t0:6.2f} s -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
