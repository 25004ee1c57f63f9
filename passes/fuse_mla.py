"""MLA weight absorption (spec 4.3): each `mla_attention` (naive: keys and values up-projected from every
cache row) becomes
    mla_q_absorb  q_nope x W_UK per head, || q_pe               -> q_abs [B, H, rank+rope]
    mla_decode    MQA of q_abs over the latent cache, KV range split into chunks -> (o, lse) per chunk
    mla_v_up      log-sum-exp merge of the chunks, then o_lat x W_UV per head  -> [B, H*v]
W_UK and W_UV are row slices of the same kv_b_proj weight, addressed by the ops' head attributes.

Guarantees: the result equals `mla_attention` up to float summation order (~1e-6 relative in float32);
a decode reads the cache once per chunk instead of up-projecting T rows per head.
"""

from __future__ import annotations

import math

from k3mk.ir.fused import MLADecode, MLAQAbsorb, MLAVUp
from k3mk.ir.graph import Graph
from k3mk.ir.ops import MLAAttention
from k3mk.passes.fuse_rewrite import Rewriter, record

PARTIAL_BYTES = 4  # o and lse partials are fp32
MAX_KV_CHUNKS = 64  # mla_v_up merges the chunks with unrolled loops (codegen/ops_moe_mla.py checks <= 64)


def kv_split(attention: MLAAttention, cache_shape: tuple[int, ...], cache_itemsize: int, num_sms: int) -> tuple[int, int]:
    """(num_chunks, min_chunk_rows) of one MLA layer's KV split.

    A chunk writes H x rank fp32 partials per request: it is worth its partials only if it reads at least as
    many cache bytes, so a chunk holds at least min_chunk_rows = H*rank*4 / row bytes rows (K3 at TP1: 171
    rows of 1152 B; k3-tiny: 4). Up to that bound, spread every request's longest context over the SMs:
    num_chunks = min(ceil(num_sms / batch), ceil(T_max / min_chunk_rows), MAX_KV_CHUNKS) (Kimi Linear at
    4096: 57-row chunks would be 72, capped to 64). At run time shorter contexts use
    fewer, longer-than-minimum chunks (ir/fused.py `kv_chunk_bounds`); the rest are empty tasks."""
    batch, t_max, width = cache_shape
    min_rows = math.ceil(attention.num_heads * attention.kv_lora_rank * PARTIAL_BYTES / (width * cache_itemsize))
    return max(1, min(math.ceil(num_sms / batch), math.ceil(t_max / min_rows), MAX_KV_CHUNKS)), min_rows


def fuse_mla(graph: Graph, num_sms: int, split: tuple[int, int] | None = None) -> Graph:
    """Absorb every mla_attention; `split` = (num_chunks, min_chunk_rows) overrides `kv_split` (tests)."""
    rw = Rewriter(graph, "fuse_mla")
    count = 0
    for node in graph.nodes:
        if not isinstance(node.op, MLAAttention):
            continue
        a = node.op
        q, cache, positions, kv_b = node.inputs
        t = rw.tensor(cache)
        chunks, min_rows = split or kv_split(a, t.shape, t.dtype.itemsize, num_sms)
        heads = (a.num_heads, a.qk_nope, a.v_dim)
        q_abs, o, lse = f"{node.name}.q_abs", f"{node.name}.o_partial", f"{node.name}.lse_partial"
        scale = (a.qk_nope + a.qk_rope) ** -0.5  # the naive op's expression: the same float
        decode = MLADecode(a.kv_lora_rank, chunks, min_rows, scale)
        rw.replace(
            [node],
            [
                rw.node(f"{node.name}.q_absorb", MLAQAbsorb(*heads), (q, kv_b), (q_abs,), node.name),
                rw.node(f"{node.name}.decode", decode, (q_abs, cache, positions), (o, lse), node.name),
                rw.node(f"{node.name}.v_up", MLAVUp(*heads), (o, lse, kv_b), node.outputs, node.name),
            ],
        )
        count += 1
    out = rw.finish()
    record(out, "mla_attention->mla_q_absorb+mla_decode+mla_v_up", count)
    return out
