"""Gated activations into the producing GEMVs (spec 5.1, 5.3):
    silu_mul / situ_mul(linear(x, Wg), linear(x, Wu))            -> gated_linear(x, Wg, Wu)
    act(expert_linear(z, w1, ids), expert_linear(z, w3, ids))     -> expert_gated_linear(z, w1, w3, ids)
    (and the MXFP4 expert form)                                   -> expert_gated_linear_mxfp4

Guarantees: exact (the fused semantics are the composition); a tile computes matching rows of gate and up,
so neither projection is written out.
"""

from __future__ import annotations

from k3mk.ir.fused import ExpertGatedLinear, ExpertGatedLinearMXFP4, GatedLinear
from k3mk.ir.graph import Graph, Node
from k3mk.ir.ops import ExpertLinear, ExpertLinearMXFP4, Linear, SiluMul, SituMul
from k3mk.passes.fuse_rewrite import Rewriter, record


def _pair(rw: Rewriter, act: Node, kind: type) -> tuple[Node, Node] | None:
    """The (gate, up) producers of `act` if both are `kind` ops over the same input (and the same routing
    ids for experts) read by `act` alone."""
    gate, up = (rw.produced_for(t, act, (kind,)) for t in act.inputs)
    if gate is None or up is None or gate is up:
        return None
    if gate.inputs[0] != up.inputs[0] or (kind is not Linear and gate.inputs[-1] != up.inputs[-1]):
        return None
    if kind is Linear and (gate.op.fp32 or up.op.fp32):
        return None
    return gate, up


def fuse_gated(graph: Graph) -> Graph:
    rw = Rewriter(graph, "fuse_gated")
    counts = {"dense": 0, "expert": 0, "expert_mxfp4": 0}
    for act in graph.nodes:
        if not isinstance(act.op, (SiluMul, SituMul)):
            continue
        for key, kind in (("dense", Linear), ("expert", ExpertLinear), ("expert_mxfp4", ExpertLinearMXFP4)):
            pair = _pair(rw, act, kind)
            if pair is None:
                continue
            gate, up = pair
            x, ids = gate.inputs[0], gate.inputs[-1]
            if kind is Linear:
                op, inputs = GatedLinear(None, act.op), (x, gate.inputs[1], up.inputs[1])
            elif kind is ExpertLinear:
                op, inputs = ExpertGatedLinear(act.op), (x, gate.inputs[1], up.inputs[1], ids)
            else:
                op, inputs = ExpertGatedLinearMXFP4(act.op), (x, *gate.inputs[1:3], *up.inputs[1:3], ids)
            detail = f"{gate.name}+{up.name}+{act.name}"
            rw.replace([gate, up, act], [rw.node(gate.name, op, inputs, act.outputs, detail)])
            counts[key] += 1
            break
    out = rw.finish()
    record(out, "linear+linear+act->gated_linear", counts["dense"])
    record(out, "expert_linear w1+w3+act->expert_gated_linear", counts["expert"])
    record(out, "expert_linear_mxfp4 w1+w3+act->expert_gated_linear_mxfp4", counts["expert_mxfp4"])
    return out
