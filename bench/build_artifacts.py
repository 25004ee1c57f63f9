"""Build the whole-model artifacts of a benchmark sweep on the CPU (no GPU): per model and batch ONE run of
the pass pipeline, then one kernel build per variant (the release build and any tuning or profile
variants), so a sweep of kernel configurations costs one capture and schedule per model and batch.

    python bench/build_artifacts.py OUT --models kimi-linear-48b-a3b k3-proxy-16l --batches 1 4 \\
        [--max-context 8192] [--arch sm_90a] [--variant NAME:KEY=VALUE,KEY=VALUE ...]

Writes OUT/<model>_b<batch>_t<context> (the release build: what bench/decode_bench.py reads) and
OUT/<model>_b<batch>_t<context>@<NAME> per --variant, whose KEY=VALUE pairs are
`k3mk compile --kernel-option` knobs, or profile=1 for a profile build (bench/timeline.py).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch


def parse_variant(text: str) -> tuple[str, dict[str, int], bool]:
    from k3mk.codegen.ops import KERNEL_TUNING

    name, _, spec = text.partition(":")
    items = [item.partition("=") for item in spec.split(",") if item]
    options = {key: int(value) for key, _, value in items if key != "profile"}
    unknown = set(options) - set(KERNEL_TUNING)
    if unknown:
        raise SystemExit(f"--variant {text!r}: unknown knobs {sorted(unknown)}; known: {', '.join(KERNEL_TUNING)} and profile=1")
    return name, options, ("profile", "=", "1") in items


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--models", nargs="+", required=True)
    ap.add_argument("--batches", nargs="+", type=int, default=[1])
    ap.add_argument("--max-context", type=int, default=8192)
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE,...")
    ap.add_argument("--no-release", action="store_true", help="only the variants")
    args = ap.parse_args()

    from k3mk.compiler.config import load_config
    from k3mk.compiler.pipeline import compile_artifact, compile_graph

    variants = ([] if args.no_release else [("", {}, False)]) + [parse_variant(v) for v in args.variant]
    say = lambda line: print(f"  {line}", file=sys.stderr, flush=True)  # noqa: E731
    for model in args.models:
        config = load_config(model)
        for batch in args.batches:
            t0 = time.perf_counter()
            result = compile_graph(config, 1, batch, args.max_context, torch.bfloat16, args.arch, None, say)
            base = f"{model}_b{batch}_t{args.max_context}"
            for name, options, profile in variants:
                out = args.out / (f"{base}@{name}" if name else base)
                compile_artifact(config, 1, batch, args.max_context, args.arch, out, result=result, profile=profile,
                                 kernel_options=options, progress=say)  # fmt: skip
                print(f"{out}: {time.perf_counter() - t0:.0f} s since the pipeline started", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
