"""The fusion pass: runs after tensor-parallel sharding and before tiling (DESIGN.md, "Data flow"), so
every op it leaves is something one SM-sized task, or independent tiles of one, computes
(ir/fused.py says how each fused kind tiles; docs/ir.md, "Fusion").

The rules, each in its own file, in this order (later rules see earlier rules' ops):
  fuse_mla              mla_attention -> q_absorb + decode (KV split into chunks) + v_up    (spec 4.3)
  fuse_gated            act(gate GEMV, up GEMV) -> one gated GEMV, dense and routed experts (spec 5.1)
  fuse_expert_combine   moe_combine into the expert down projection                        (spec 5.3)
  fuse_epilogue         kda_gate, MLA sigmoid gate, KDA gated o_norm, router top-k into their GEMV
  fuse_norm             rmsnorm into every GEMV-family reader whose staged input fits      (spec 7)
  fuse_residual         residual / prefix / "+ shared" adds into a GEMV or combine epilogue (spec 2)

Guarantees to `tile`: the graph verifies; it computes what its input computed, exactly except the
absorbed MLA (float summation order); every rule that fired is listed in graph.meta["fusions"] as
"<pattern> x <count>".
"""

from __future__ import annotations

from k3mk.ir.graph import Graph
from k3mk.passes.fuse_epilogue import fuse_epilogue
from k3mk.passes.fuse_expert_combine import fuse_expert_combine
from k3mk.passes.fuse_gated import fuse_gated
from k3mk.passes.fuse_mla import fuse_mla
from k3mk.passes.fuse_norm import fuse_norm
from k3mk.passes.fuse_residual import fuse_residual

RULES = (fuse_gated, fuse_expert_combine, fuse_epilogue, fuse_norm, fuse_residual)


def fuse(graph: Graph, target) -> Graph:
    """`target` gives the SM count that sizes the MLA KV split (passes/fuse_mla.py `kv_split`)."""
    graph = fuse_mla(graph, target.num_sms)
    for rule in RULES:
        graph = rule(graph)
    return graph
