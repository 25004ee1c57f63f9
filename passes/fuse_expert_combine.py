"""The MoE routing combine into the expert down projection (spec 5.3):
    moe_combine(expert_linear(a, w2, ids), weights)        -> expert_linear_combine(a, w2, ids, weights)
    (and the MXFP4 form)                                   -> expert_linear_mxfp4_combine

Guarantees: exact; the fused op keeps the combine's numerics (each slot's product rounded to the activation
dtype, an fp32 weighted sum over the slots, ONE final rounding) because a task covers all slots of its
output rows, so the [B, k, out] per-slot products are never written out.
"""

from __future__ import annotations

from collections import Counter

from k3mk.ir.fused import ExpertLinearCombine, ExpertLinearMXFP4Combine
from k3mk.ir.graph import Graph
from k3mk.ir.ops import ExpertLinear, ExpertLinearMXFP4, MoECombine
from k3mk.passes.fuse_rewrite import Rewriter, record

FUSED = {ExpertLinear: ExpertLinearCombine, ExpertLinearMXFP4: ExpertLinearMXFP4Combine}


def fuse_expert_combine(graph: Graph) -> Graph:
    rw = Rewriter(graph, "fuse_expert_combine")
    counts: Counter[str] = Counter()
    for combine in graph.nodes:
        if not isinstance(combine.op, MoECombine):
            continue
        products, weights = combine.inputs
        down = rw.produced_for(products, combine, tuple(FUSED))
        if down is None:
            continue
        op = FUSED[type(down.op)]()
        rw.replace([down, combine], [rw.node(down.name, op, (*down.inputs, weights), combine.outputs, f"{down.name}+{combine.name}")])
        counts[f"{down.op.name} w2+moe_combine->{op.name}"] += 1
    out = rw.finish()
    for pattern, count in counts.items():
        record(out, pattern, count)
    return out
