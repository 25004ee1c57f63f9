"""RMSNorm into the GEMVs that read it (a prologue): for y = rmsnorm(x, w),
    linear(y, W)                         -> rmsnorm_linear(x, w, W)
    <linear-family fused op>([y], ...)   -> the same op with norm_eps set, operands [x, w]
Each tile of the consumer recomputes the row's RMS from the x [B, d] it reads anyway, so the norm is no
longer a task the GEMVs wait for. The prologue normalises a copy of x in shared memory, so a norm is fused
only where that copy fits (B * d bf16 within ir/streaming.py X_SMEM_BUDGET: K3's 7168-wide hidden state at
up to 11 tokens a step); a wider input keeps its rmsnorm task, whose output the GEMVs read from the arena.
The rmsnorm node stays while any reader still needs y (e.g. Kimi Linear's routed experts, which read the
MoE input directly).

This also covers attn_res + rmsnorm (what vLLM fuses, spec 2): K3's mixed tensor h feeds only norms, so
after this pass the GEMV tiles read attn_res's output directly and no separate norm remains to fuse.

Guarantees: exact (the prologue is the rmsnorm semantics).
"""

from __future__ import annotations

from collections import Counter

from k3mk.ir.fused import NormPrologue, RMSNormLinear
from k3mk.ir.graph import Graph, Node, Role
from k3mk.ir.ops import Linear, RMSNorm
from k3mk.ir.streaming import X_SMEM_BUDGET
from k3mk.passes.fuse_rewrite import Rewriter, record


def _with_prologue(rw: Rewriter, norm: Node, user: Node) -> Node | None:
    """`user` rewritten to normalize norm's input itself, or None if it cannot take a prologue."""
    y = norm.outputs[0]
    x, weight = norm.inputs
    if user.inputs[0] != y or y in user.inputs[1:] or rw.tensor(x).numel * 2 > X_SMEM_BUDGET:  # the bf16 copy
        return None
    detail = f"{norm.name}+{user.name}"
    if isinstance(user.op, Linear):
        return rw.node(user.name, RMSNormLinear(norm.op.eps, user.op.fp32), (x, weight, *user.inputs[1:]), user.outputs, detail)
    if isinstance(user.op, NormPrologue) and user.op.norm_eps is None:
        return rw.node(user.name, user.op.with_norm(norm.op.eps), (x, weight, *user.inputs[1:]), user.outputs, detail)
    return None


def fuse_norm(graph: Graph) -> Graph:
    rw = Rewriter(graph, "fuse_norm")
    counts: Counter[str] = Counter()
    for norm in graph.nodes:
        if not isinstance(norm.op, RMSNorm):
            continue
        for user in rw.consumers(norm.outputs[0]):
            fused = _with_prologue(rw, norm, user)
            if fused is not None:
                rw.replace([user], [fused])
                counts[f"rmsnorm->{user.op.name}"] += 1
        if not rw.consumers(norm.outputs[0]) and rw.tensor(norm.outputs[0]).role == Role.ACTIVATION:
            rw.replace([norm], [])
    out = rw.finish()
    for pattern, count in sorted(counts.items()):
        record(out, pattern, count)
    return out
