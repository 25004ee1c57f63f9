"""Residual adds into the GEMV or routed-expert combine that produces one of their operands (an epilogue):
    add(r, linear(x, W))                 -> linear_residual([r], x, W)
    add(r2, linear_residual([r1], x, W)) -> linear_residual([r1, r2], x, W)
    add(r, expert_linear_combine(...))   -> expert_linear_combine([r], ...)   (and the MXFP4 form)
This folds Kimi Linear's residual stream adds (h + o_proj(...), h + down_proj(...)), K3's block prefix
adds (spec 2) and the MoE "+ shared" add (spec 5.3); chains fold into one epilogue.

A routed-expert combine takes the add first: the MoE output is routed + shared, and the routed path
(router, experts, combine) is the layer's critical path, so the combine adds the shared expert's output
and the residual stream, and the shared expert's down_proj runs beside the routed experts instead of as
one more dependent stage after the combine. Otherwise the GEMV taken is the producer of add's second
operand if it can be, else of the first: addition commutes exactly and both operands have the same dtype
(checked), so either way the result is the add's. Only plain GEMVs take the epilogue (the norm-prologue
GEMVs of `fuse_norm` are not candidates), which puts K3's MoE add on the shared down_proj, not on the
latent up-projection. An add whose operand comes from an all-reduce (tensor parallelism) stays: the
residual must be added once, after the reduction.

Guarantees: exact (one rounding per add, in the unfused order).
"""

from __future__ import annotations

from collections import Counter

from k3mk.ir.fused import ExpertLinearCombine, ExpertLinearMXFP4Combine, LinearResidual
from k3mk.ir.graph import Graph
from k3mk.ir.ops import Add, Linear
from k3mk.passes.fuse_rewrite import Rewriter, record

COMBINES = (ExpertLinearCombine, ExpertLinearMXFP4Combine)


def fuse_residual(graph: Graph) -> Graph:
    rw = Rewriter(graph, "fuse_residual")
    counts: Counter[str] = Counter()
    for add in graph.nodes:
        if not isinstance(add.op, Add):
            continue
        a, b = add.inputs
        if a == b or rw.tensor(a).dtype != rw.tensor(b).dtype:
            continue
        candidates = [(r, o, COMBINES) for r, o in ((a, b), (b, a))] + [(r, o, (Linear, LinearResidual)) for r, o in ((a, b), (b, a))]
        for residual, operand, kinds in candidates:
            node = rw.produced_for(operand, add, kinds)
            if node is None or (isinstance(node.op, Linear) and node.op.fp32):
                continue
            # the core inputs follow the residuals: a linear's (x, W), a combine's (a, w2[, scale], ids, weights)
            core = node.op.core_inputs if isinstance(node.op, COMBINES) else 2
            inputs = (*node.inputs[:-core], residual, *node.inputs[-core:])
            op = type(node.op)() if isinstance(node.op, COMBINES) else LinearResidual()
            rw.replace([node, add], [rw.node(node.name, op, inputs, add.outputs, f"{node.name}+{add.name}")])
            counts[f"add->{op.name}"] += 1
            break
    out = rw.finish()
    for pattern, count in counts.items():
        record(out, pattern, count)
    return out
