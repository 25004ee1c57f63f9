"""Elementwise consumers of a GEMV into its epilogue:
    kda_gate(linear(x, W_fb), A_log, dt_bias)           -> linear_kda_gate        (KDA decay gate, spec 3.2)
    sigmoid_gate(o, linear(x, W_g))                      -> linear_sigmoid_gate    (MLA output gate, spec 4.2)
    gated_rmsnorm(o, linear(x, W_g), w)                  -> linear_gated_rmsnorm   (KDA o_norm, spec 3.2)
    router_topk(linear(x, W_gate, fp32=True), bias)      -> router                 (spec 5.2, one task)

The router fusion makes ONE task stream the whole [E, d] gate matrix, on the critical path of every
MoE layer, so it is applied only while that matrix is small (ROUTER_FUSE_MAX_BYTES: ~7 us at one SM's
share of an H200's bandwidth). Larger routers (Kimi Linear 1.2 MB, K3 12.8 MB) keep a row-tiled fp32
GEMV spread over all SMs and a router_topk, which emit_task_table folds into the GEMV's tiles (the last
tile to arrive selects).

Guarantees: exact; the GEMV's result is consumed in registers. The fused ops are written without a norm
prologue (`norm_eps=None`); `fuse_norm` adds it where the GEMV's input is an rmsnorm.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable

from k3mk.ir.fused import LinearGatedRMSNorm, LinearKDAGate, LinearSigmoidGate, NormPrologue, Router
from k3mk.ir.graph import Graph
from k3mk.ir.ops import GatedRMSNorm, KDAGate, Linear, Op, RouterTopK, SigmoidGate
from k3mk.passes.fuse_rewrite import Rewriter, record


@dataclass(frozen=True)
class Epilogue:
    gemv_operand: int  # which operand of the consumer the GEMV produces
    fp32: bool  # the GEMV's fp32 flag that the fusion expects
    fused: Callable[[Op], NormPrologue]  # the fused op, from the consumer's op
    extras: Callable[[tuple[str, ...]], tuple[str, ...]]  # the fused op's operands after ([x], weight)


EPILOGUES: dict[type[Op], Epilogue] = {
    KDAGate: Epilogue(0, False, lambda c: LinearKDAGate(None, c.num_heads, c.lower_bound), lambda ins: ins[1:]),
    SigmoidGate: Epilogue(1, False, lambda c: LinearSigmoidGate(None), lambda ins: ins[:1]),
    GatedRMSNorm: Epilogue(1, False, lambda c: LinearGatedRMSNorm(None, c.head_dim, c.eps), lambda ins: (ins[0], ins[2])),
    RouterTopK: Epilogue(0, True, lambda c: Router(None, c.top_k, c.renormalize, c.scaling), lambda ins: ins[1:]),
}


ROUTER_FUSE_MAX_BYTES = 256 * 1024


def fuse_epilogue(graph: Graph) -> Graph:
    rw = Rewriter(graph, "fuse_epilogue")
    counts: Counter[str] = Counter()
    for consumer in graph.nodes:
        rule = EPILOGUES.get(type(consumer.op))
        if rule is None:
            continue
        gemv = rw.produced_for(consumer.inputs[rule.gemv_operand], consumer, (Linear,))
        extras = rule.extras(consumer.inputs)
        if gemv is None or gemv.op.fp32 != rule.fp32 or gemv.outputs[0] in extras:
            continue
        if isinstance(consumer.op, RouterTopK) and graph.tensors[gemv.inputs[1]].nbytes > ROUTER_FUSE_MAX_BYTES:
            continue
        op = rule.fused(consumer.op)
        rw.replace([gemv, consumer], [rw.node(gemv.name, op, (*gemv.inputs, *extras), consumer.outputs, f"{gemv.name}+{consumer.name}")])
        counts[f"linear+{consumer.op.name}->{op.name}"] += 1
    out = rw.finish()
    for pattern, count in counts.items():
        record(out, pattern, count)
    return out
