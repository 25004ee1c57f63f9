"""Residual adds into the GEMV that produces one of their operands (an epilogue):
    add(r, linear(x, W))                 -> linear_residual([r], x, W)
    add(r2, linear_residual([r1], x, W)) -> linear_residual([r1, r2], x, W)
This folds Kimi Linear's residual stream adds (h + o_proj(...), h + down_proj(...)), K3's block prefix
adds (spec 2) and the MoE "+ shared" add, where the shared expert's down_proj adds the routed output
(spec 5.3); chains fold into one GEMV epilogue.

The GEMV taken is the producer of add's second operand if it can be, else of the first: addition
commutes exactly and both operands have the same dtype (checked), so either way the result is the add's.
Only plain GEMVs take the epilogue (the norm-prologue GEMVs of `fuse_norm` are not candidates), which
puts the MoE add on the shared down_proj, not on the latent up-projection. An add whose operand comes
from an all-reduce (tensor parallelism) stays: the residual must be added once, after the reduction.

Guarantees: exact (one rounding per add, in the unfused order).
"""

from __future__ import annotations

from k3mk.ir.fused import LinearResidual
from k3mk.ir.graph import Graph
from k3mk.ir.ops import Add, Linear
from k3mk.passes.fuse_rewrite import Rewriter, record


def fuse_residual(graph: Graph) -> Graph:
    rw = Rewriter(graph, "fuse_residual")
    count = 0
    for add in graph.nodes:
        if not isinstance(add.op, Add):
            continue
        a, b = add.inputs
        if a == b or rw.tensor(a).dtype != rw.tensor(b).dtype:
            continue
        for residual, operand in ((a, b), (b, a)):
            gemv = rw.produced_for(operand, add, (Linear, LinearResidual))
            if gemv is None or (isinstance(gemv.op, Linear) and gemv.op.fp32):
                continue
            earlier = gemv.inputs[:-2]  # a linear's inputs are (x, W); a linear_residual's (*residuals, x, W)
            inputs = (*earlier, residual, *gemv.inputs[-2:])
            rw.replace([gemv, add], [rw.node(gemv.name, LinearResidual(), inputs, add.outputs, f"{gemv.name}+{add.name}")])
            count += 1
            break
    out = rw.finish()
    record(out, "add->linear_residual", count)
    return out
