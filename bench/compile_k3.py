"""Compile-time benchmark: full Kimi K3 through the pass pipeline (as far as it is written) at TP8 and
TP16 on the CPU, with per-stage times and sizes; target: under 120 s per degree, capture included.

Also prints the routed-expert bytes per rank of the two MoE splits that passes/tp_shard.py chooses
between (docs/ir.md, "Tensor parallelism"): split by intermediate size (TP) versus by expert (EP).

    python bench/compile_k3.py [--tp 8 16] [--arch sm_100a] [--max-tokens 1] [--max-context 4096] [--until PASS]
"""

from __future__ import annotations

import argparse
import sys
import time
from fractions import Fraction
from math import comb

import torch

from k3mk.compiler.config import ModelConfig, load_config
from k3mk.compiler.pipeline import compile_graph, summary
from k3mk.compiler.weights import expert_shapes

BUDGET_S = 120.0


def expected_busiest_rank_experts(num_experts: int, top_k: int, ranks: int) -> float:
    """E[max over ranks of the selected experts a rank holds] when `top_k` distinct experts out of
    `num_experts` are chosen uniformly and each rank holds num_experts / ranks of them (EP), exactly:
    P(max <= m) counts the k-subsets with at most m experts per rank (coefficient of x^k in
    (sum_{j<=m} C(E/N, j) x^j)^N)."""
    per_rank, total = num_experts // ranks, comb(num_experts, top_k)

    def subsets_with_at_most(m: int) -> int:
        poly = [1]
        for _ in range(ranks):
            new = [0] * (top_k + 1)
            for i, a in enumerate(poly):
                for j in range(min(m, per_rank, top_k - i) + 1):
                    new[i + j] += a * comb(per_rank, j)
            poly = new
        return poly[top_k]

    return float(sum(1 - Fraction(subsets_with_at_most(m), total) for m in range(top_k)))


def expert_bytes(config: ModelConfig) -> float:
    moe = config.moe
    per_param = 0.5 + 1 / moe.mxfp4_group_size if moe.expert_format == "mxfp4" else 2.0  # packed E2M1 + UE8M0 scales
    return sum(o * i for o, i in expert_shapes(config).values()) * per_param


def moe_split_report(config: ModelConfig, tps: list[int]) -> str:
    moe = config.moe
    size = expert_bytes(config)
    layers = sum(config.is_moe_layer(i) for i in range(config.num_layers))
    lines = [f"routed experts of {config.name}: {size / 1e6:.2f} MB per expert, top-{moe.top_k} of {moe.num_experts}, {layers} MoE layers, batch 1"]
    for tp in tps:
        tp_bytes = moe.top_k * size / tp
        busiest = expected_busiest_rank_experts(moe.num_experts, moe.top_k, tp)
        ep_bytes = busiest * size
        lines.append(
            f"  TP{tp}: split by intermediate {tp_bytes / 1e6:.1f} MB/rank/layer ({layers * tp_bytes / 1e9:.2f} GB/token); "
            f"by expert (EP): busiest rank E[max] {busiest:.2f} experts = {ep_bytes / 1e6:.1f} MB/layer "
            f"({layers * ep_bytes / 1e9:.2f} GB/token), {ep_bytes / tp_bytes:.2f}x"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--arch", default="sm_100a")
    parser.add_argument("--max-tokens", type=int, default=1)
    parser.add_argument("--max-context", type=int, default=4096)
    parser.add_argument("--until", help="stop after this pass (default: every pass written so far)")
    args = parser.parse_args()
    config = load_config("kimi-k3")
    print(moe_split_report(config, args.tp))
    status = 0
    for tp in args.tp:
        start = time.perf_counter()
        result = compile_graph(
            config,
            tp,
            args.max_tokens,
            args.max_context,
            torch.bfloat16,
            args.arch,
            progress=lambda line: print(f"  {line}", file=sys.stderr, flush=True),
            until=args.until,
        )
        total = time.perf_counter() - start
        print(summary(result), end="")
        verdict = "ok" if total <= BUDGET_S else "OVER BUDGET"
        print(f"total compile time TP{tp}: {total:.1f} s (budget {BUDGET_S:.0f} s: {verdict})\n")
        status |= total > BUDGET_S
    return status


if __name__ == "__main__":
    sys.exit(main())
