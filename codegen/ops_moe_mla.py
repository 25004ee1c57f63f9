"""Codegen entries of the MoE and MLA op kinds (spec 4.3, 5.2, 5.3, 5.5): their templates, shared-memory
needs and codegen-time checks. Registered into `k3mk.codegen.ops.OP_CODEGEN` at its import.

The smem layouts computed here (`*_layout`) are the ones the templates use: the templates recompute
the same offsets from the params with the same formulas (keep the two in step).
"""

from __future__ import annotations

from k3mk.codegen.ops import (
    MAX_SELECT_EXPERTS,
    MAX_TOP_K,
    VECTOR_ELEMENTS,
    X_SMEM_BUDGET,
    CodegenError,
    OpCodegen,
    _check_batch,
    _check_select,
    _require,
)
from k3mk.ir.streaming import ACCUMULATOR_BUDGET, COMBINE_BATCH_ROWS, KV_FILL_ROWS, mxfp4_padded
from k3mk.ir.task_table import (
    COMBINE_RESIDUAL_OPERANDS,
    ExpertCombineParams,
    ExpertGatedParams,
    MlaDecodeParams,
    MlaLatentParams,
    MlaQAbsorbParams,
    MlaVUpParams,
    RouterParams,
    RouterTopkParams,
)

THREADS = 256  # the templates' mapping assumes KernelConfig().threads (checked at emit time by the templates' asserts)
MXFP4_GROUP = 32  # inputs per UE8M0 scale = one 16-byte load of packed codes
WEIGHT_FORMATS = ("bfloat16", "mxfp4")
MLA_BLOCK_ROWS = 2 * KV_FILL_ROWS  # KV rows of an mla_decode block: two ring fills, the two n-tiles of its score MMAs
MAX_GROUP_HEADS = 16  # heads of one mla_decode task: the M = 16 rows of its score MMAs
MMA_K = 16  # k per bf16 mma.sync (m16n8k16)


def _a16(n: int) -> int:
    return (n + 15) // 16 * 16


# ---- router ---------------------------------------------------------------------------------


def router_smem_layout(p: RouterParams) -> dict:
    """x (normalised, bf16 [B, dim]) | logits fp32 [B, E] (the selection scores live in registers)."""
    logits = _a16(p.batch * p.dim * 2)
    return {"logits": logits, "total": logits + _a16(p.batch * p.num_experts * 4)}


def _check_router(p: RouterParams) -> None:
    _check_batch(p.batch)
    _check_select("router", p.num_experts, p.top_k)
    _require(p.dim % VECTOR_ELEMENTS == 0, f"router dim {p.dim} not a multiple of {VECTOR_ELEMENTS}")
    _require(router_smem_layout(p)["total"] <= X_SMEM_BUDGET,
             f"router smem {router_smem_layout(p)['total']} B > {X_SMEM_BUDGET} B: split the logits GEMV from the top-k")  # fmt: skip


def _check_router_topk(p: RouterTopkParams) -> None:
    _check_batch(p.batch)
    _check_select("router_topk", p.num_experts, p.top_k)


# ---- routed experts -------------------------------------------------------------------------


def _check_weight_format(op: str, fmt: str, in_features: int) -> None:
    _require(fmt in WEIGHT_FORMATS, f"{op} weight_format {fmt!r}; known: {WEIGHT_FORMATS}")
    unit = MXFP4_GROUP if fmt == "mxfp4" else VECTOR_ELEMENTS
    _require(in_features % unit == 0, f"{op} in_features {in_features} not a multiple of {unit} ({fmt})")


def _check_expert_gated(p: ExpertGatedParams) -> None:
    _check_batch(p.batch)
    _check_weight_format("expert_gated", p.weight_format, p.in_features)
    _require(1 <= p.top_k <= p.num_experts, f"expert_gated top_k {p.top_k} outside [1, {p.num_experts}]")
    _require(p.activation in ("silu", "situ"), f"expert_gated activation {p.activation!r}")
    if p.activation == "situ":
        _require(p.beta > 0 and (p.linear_beta is None or p.linear_beta > 0), "situ needs beta, linear_beta > 0")
    _require(_expert_gated_smem(p) <= X_SMEM_BUDGET, f"expert_gated input batch*in*2 = {_expert_gated_smem(p)} B > {X_SMEM_BUDGET} B")


def _staged_features(fmt: str, in_features: int) -> int:
    """Elements of an expert input staged in smem: MXFP4 pads them to whole MMA spans."""
    return mxfp4_padded(in_features) if fmt == "mxfp4" else in_features


def _expert_gated_smem(p: ExpertGatedParams) -> int:
    # every request's input, then (batch > 1) the task's experts: per expert its requests' count and (request, slot)
    # words, then their count (expert_gated.py.j2)
    return p.batch * _staged_features(p.weight_format, p.in_features) * 2 + (p.batch * (p.batch + 1) + 1) * 4


def _check_expert_combine(p: ExpertCombineParams) -> None:
    _check_batch(p.batch)
    _check_weight_format("expert_combine", p.weight_format, p.in_features)
    _require(1 <= p.top_k <= p.num_experts, f"expert_combine top_k {p.top_k} outside [1, {p.num_experts}]")
    _require(0 <= p.residuals <= len(COMBINE_RESIDUAL_OPERANDS), f"expert_combine residuals {p.residuals} outside [0, {len(COMBINE_RESIDUAL_OPERANDS)}]")
    _require(_expert_combine_smem(p) <= X_SMEM_BUDGET, f"expert_combine smem {_expert_combine_smem(p)} B > {X_SMEM_BUDGET} B")


def _expert_combine_smem(p: ExpertCombineParams, prefetch: bool = False) -> int:
    # each warp's slot input (one slot per warp and round, not all top_k: the op smem is every op's), with `prefetch`
    # (codegen/ops.py combine_prefetches) each warp's next input as read (bf16) behind it, then bf16(dot) per slot of
    # one batch of row groups (at most max(BATCH_ROWS, a group's rows <= ACCUMULATOR_BUDGET)) in fp32
    # (batch > 1, grouped: the terms of every request's slots, a batch of COMBINE_BATCH_ROWS * 4 // batch rows, and
    # the pairs sorted by expert with each round's first fill, expert_combine.py.j2)
    x = THREADS // 32 * (_staged_features(p.weight_format, p.in_features) + (p.in_features if prefetch else 0)) * 2
    if p.batch == 1:
        return x + p.top_k * max(COMBINE_BATCH_ROWS, ACCUMULATOR_BUDGET) * 4
    pairs = p.batch * p.top_k
    return x + pairs * max(COMBINE_BATCH_ROWS * 4 // p.batch, ACCUMULATOR_BUDGET) * 4 + (pairs + -(-pairs // (THREADS // 32)) + 1) * 4


# ---- MLA ------------------------------------------------------------------------------------


def _check_mla_dims(op: str, rank: int, rope: int) -> None:
    _require(rank % VECTOR_ELEMENTS == 0 and rope % VECTOR_ELEMENTS == 0,
             f"{op}: kv_lora_rank {rank} and rope {rope} must be multiples of {VECTOR_ELEMENTS}")  # fmt: skip
    _require(rank // VECTOR_ELEMENTS <= THREADS, f"{op}: kv_lora_rank {rank} > {THREADS * VECTOR_ELEMENTS}")


def _check_mla_latent(p: MlaLatentParams) -> None:
    _check_batch(p.batch)
    _check_mla_dims("mla_latent", p.kv_lora_rank, p.rope_dim)


def q_absorb_layout(p: MlaQAbsorbParams) -> dict:
    """Thread t owns column vector t % RV of the task's CW columns of W_UK and the row slice t // RV (DS slices);
    requests in chunks of BC; every slice leaves its partial sums in smem, fp32 [DS, BC, CW]."""
    cw = p.columns or p.kv_lora_rank
    rv = cw // VECTOR_ELEMENTS
    ds = THREADS // rv
    bc = min(p.batch, 4)
    return {"CW": cw, "RV": rv, "DS": ds, "BC": bc, "total": ds * bc * cw * 4}


def _check_mla_q_absorb(p: MlaQAbsorbParams) -> None:
    _check_batch(p.batch)
    _check_mla_dims("mla_q_absorb", p.kv_lora_rank, VECTOR_ELEMENTS)
    _require(p.qk_nope >= 1 and p.qk_rope >= 0 and p.v_dim >= 1, "mla_q_absorb dims")
    _require(p.columns >= 0 and p.columns % VECTOR_ELEMENTS == 0 and p.kv_lora_rank % (p.columns or p.kv_lora_rank) == 0,
             f"mla_q_absorb columns {p.columns}: a multiple of {VECTOR_ELEMENTS} dividing kv_lora_rank {p.kv_lora_rank}")


def decode_layout(p: MlaDecodeParams) -> dict:
    """The scores' k-part partial sums, fp32 [k-parts, heads (8 or 16), rows + 8] | the task's ring fills (int32, the
    body's count for `_fills`). The KV rows are in the ring (ir/streaming.py `_kv_fill_plan`)."""
    c = p.kv_lora_rank + p.rope_dim
    head_rows = 8 if p.group_heads <= 8 else 16
    scores = (THREADS // 32 // 2) * head_rows * (MLA_BLOCK_ROWS + 8) * 4
    return {"C": c, "SK": c + 8, "S_OFF": 0, "COUNT_OFF": scores, "total": scores + 16, "NB": MLA_BLOCK_ROWS}


def _check_mla_decode(p: MlaDecodeParams) -> None:
    _check_batch(p.batch)
    _check_mla_dims("mla_decode", p.kv_lora_rank, p.rope_dim)
    c = p.kv_lora_rank + p.rope_dim
    _require(c % MMA_K == 0, f"mla_decode: kv_lora_rank + rope = {c} must be a multiple of {MMA_K} (the scores' MMA k-steps)")
    _require(1 <= p.group_heads <= MAX_GROUP_HEADS, f"mla_decode group_heads {p.group_heads} outside [1, {MAX_GROUP_HEADS}]")
    _require(p.num_chunks >= 1 and p.min_chunk_rows >= 1, "mla_decode needs num_chunks, min_chunk_rows >= 1")
    _require(decode_layout(p)["total"] <= X_SMEM_BUDGET, f"mla_decode smem {decode_layout(p)['total']} B > {X_SMEM_BUDGET} B")


def v_up_layout(p: MlaVUpParams) -> dict:
    """sO fp32 [B, rank] (the merged latent outputs of one head) | sW fp32 [B, chunks] (merge weights) | sL fp32
    [B, chunks] (the head's lse) | sN int32 [B] (chunks up to the last non-empty one)."""
    w_off = _a16(p.batch * p.kv_lora_rank * 4)
    l_off = w_off + _a16(p.batch * p.num_chunks * 4)
    n_off = l_off + _a16(p.batch * p.num_chunks * 4)
    return {"W_OFF": w_off, "L_OFF": l_off, "N_OFF": n_off, "total": n_off + _a16(p.batch * 4)}


def _check_mla_v_up(p: MlaVUpParams) -> None:
    _check_batch(p.batch)
    _check_mla_dims("mla_v_up", p.kv_lora_rank, VECTOR_ELEMENTS)
    _require(1 <= p.num_chunks <= 64, f"mla_v_up num_chunks {p.num_chunks} outside [1, 64]")
    _require(v_up_layout(p)["total"] <= X_SMEM_BUDGET, f"mla_v_up smem {v_up_layout(p)['total']} B > {X_SMEM_BUDGET} B")


def _none(p: object) -> int:
    return 0


MOE_MLA_CODEGEN: dict[str, OpCodegen] = {
    "router": OpCodegen("router.py.j2", lambda p: router_smem_layout(p)["total"], _check_router),
    "router_topk": OpCodegen("router_topk.py.j2", _none, _check_router_topk),
    "expert_gated": OpCodegen("expert_gated.py.j2", _expert_gated_smem, _check_expert_gated),
    "expert_combine": OpCodegen("expert_combine.py.j2", _expert_combine_smem, _check_expert_combine),
    "mla_latent": OpCodegen("mla_latent.py.j2", _none, _check_mla_latent),
    "mla_q_absorb": OpCodegen("mla_q_absorb.py.j2", lambda p: q_absorb_layout(p)["total"], _check_mla_q_absorb, produce=True),
    "mla_decode": OpCodegen("mla_decode.py.j2", lambda p: decode_layout(p)["total"], _check_mla_decode, produce=True),
    "mla_v_up": OpCodegen("mla_v_up.py.j2", lambda p: v_up_layout(p)["total"], _check_mla_v_up, produce=True),
}

__all__ = ["MOE_MLA_CODEGEN", "CodegenError", "router_smem_layout", "q_absorb_layout", "decode_layout", "v_up_layout"]
