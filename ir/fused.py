"""The fused op kinds that `passes/fuse.py` makes of the captured graph (docs/ir.md, "Fusion").

Every kind here is a composition of ops of ir/ops.py, and its semantics CALLS the unfused semantics
(k3mk.ir.semantics) in the same order on the same values: a fused graph computes exactly, bit for bit
on the CPU, what the unfused graph computed, and a GPU op template is tested against the composition
(including its intermediate roundings: a gated linear rounds gate and up to the activation dtype before
the activation, as the unfused graph does). The one exception is the weight-absorbed MLA decode
(spec 4.3): new math, equal to `mla_attention` up to summation order.

Each kind must be computable by one SM-sized task or by independent tiles of it; the docstrings say how
it may be tiled ("Tiles:"). Linear-family kinds (a GEMV plus prologue/epilogue) tile by output rows:
every tile reads the whole input row x [B, in] and its rows of the weight(s).

Norm prologue: the linear-family kinds with a `norm_eps` attribute take their leading operands as one
group, `[x]` or (with `norm_eps` set) `[x, norm_weight]`, and then compute on rmsnorm(x, norm_weight):
each tile recomputes the row's RMS from the x it reads anyway instead of waiting for a normalized copy.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import torch
from torch import Tensor

from k3mk.ir import semantics
from k3mk.ir.ops import Op, SiluMul, SituMul, op

F32 = torch.float32

Activation = SiluMul | SituMul  # the gated activations (spec 5.1), kept as ops so the fused semantics run theirs


# --- norm prologue ------------------------------------------------------------------------------------


def _normalized(xs: list[Tensor], norm_eps: float | None) -> Tensor:
    """[x] -> x; [x, norm_weight] -> rmsnorm(x, norm_weight, norm_eps) (spec 7, KimiRMSNorm)."""
    x, *norm = xs
    return semantics.rmsnorm(x, norm[0], norm_eps) if norm else x


@dataclasses.dataclass(frozen=True)
class NormPrologue(Op):
    """Base of the linear-family kinds that may normalize their input themselves (module docstring)."""

    norm_eps: float | None
    variadic: ClassVar[bool] = True

    def num_list_inputs(self, total: int) -> int:
        return 1 if self.norm_eps is None else 2

    def with_norm(self, eps: float) -> "NormPrologue":
        return dataclasses.replace(self, norm_eps=eps)


# --- linear family ------------------------------------------------------------------------------------


def rmsnorm_linear(x: Tensor, norm_weight: Tensor, weight: Tensor, eps: float, fp32: bool) -> Tensor:
    return semantics.linear(semantics.rmsnorm(x, norm_weight, eps), weight, fp32)


@op("rmsnorm_linear", semantics_fn=rmsnorm_linear)
class RMSNormLinear(Op):
    """(x [B, in], norm_weight [in], weight [out, in]) -> linear(rmsnorm(x)) [B, out].
    Tiles: output rows, any size."""

    eps: float
    fp32: bool


def gated_linear(xs: list[Tensor], weight_gate: Tensor, weight_up: Tensor, norm_eps: float | None, activation: Activation) -> Tensor:
    x = _normalized(xs, norm_eps)
    return activation.evaluate(semantics.linear(x, weight_gate), semantics.linear(x, weight_up))[0]


@op("gated_linear", semantics_fn=gated_linear)
class GatedLinear(NormPrologue):
    """([x [B, in], norm_weight], weight_gate [n, in], weight_up [n, in]) -> activation(x Wg^T, x Wu^T) [B, n]:
    the gate and up projections of a dense or shared-expert FFN with SiLU/SiTU-GLU in the epilogue (spec 5.1).
    Tiles: output rows, any size; a tile streams the SAME rows of both weights."""

    activation: Activation


def linear_residual(residuals: list[Tensor], x: Tensor, weight: Tensor) -> Tensor:
    y = semantics.linear(x, weight)
    for r in residuals:
        y = semantics.add(r, y)
    return y


@op("linear_residual", semantics_fn=linear_residual)
class LinearResidual(Op):
    """(*residuals [B, out], x [B, in], weight [out, in]) -> r_n + (... + (r_1 + x W^T)), one rounding per add
    as in the unfused graph: residual stream adds (spec 2), K3 prefix adds, MoE "+ shared" (spec 5.3).
    Tiles: output rows, any size; a tile reads its columns of every residual."""

    variadic: ClassVar[bool] = True

    def num_list_inputs(self, total: int) -> int:
        return total - 2


def linear_sigmoid_gate(xs: list[Tensor], weight: Tensor, o: Tensor, norm_eps: float | None) -> Tensor:
    return semantics.sigmoid_gate(o, semantics.linear(_normalized(xs, norm_eps), weight))


@op("linear_sigmoid_gate", semantics_fn=linear_sigmoid_gate)
class LinearSigmoidGate(NormPrologue):
    """([x, norm_weight], weight [n, in], o [B, n]) -> o * sigmoid(x W^T): the MLA output gate (spec 4.2)
    in the g_proj epilogue. Tiles: output rows, any size; a tile reads its columns of o."""


def linear_kda_gate(
    xs: list[Tensor], weight: Tensor, a_log: Tensor, dt_bias: Tensor, norm_eps: float | None, num_heads: int, lower_bound: float | None
) -> Tensor:
    return semantics.kda_gate(semantics.linear(_normalized(xs, norm_eps), weight), a_log, dt_bias, num_heads, lower_bound)


@op("linear_kda_gate", semantics_fn=linear_kda_gate)
class LinearKDAGate(NormPrologue):
    """([x, norm_weight], weight [H*D, in], A_log [H], dt_bias [H*D]) -> g [B, H, D] fp32: the KDA decay gate
    (spec 3.2) in the f_b_proj epilogue. Elementwise per row, but the result is [B, H, D]: a tile's rows
    lie within one head or cover whole heads (so its output is a box)."""

    num_heads: int
    lower_bound: float | None


def linear_gated_rmsnorm(
    xs: list[Tensor], weight: Tensor, o: Tensor, o_norm_weight: Tensor, norm_eps: float | None, head_dim: int, eps: float
) -> Tensor:
    gate = semantics.linear(_normalized(xs, norm_eps), weight)
    return semantics.gated_rmsnorm(o, gate, o_norm_weight, head_dim, eps)


@op("linear_gated_rmsnorm", semantics_fn=linear_gated_rmsnorm)
class LinearGatedRMSNorm(NormPrologue):
    """([x, norm_weight], weight [H*D, in], o [B, H*D], o_norm_weight [D]) -> gated_rmsnorm(o, x W^T): the KDA
    o_norm (spec 3.2) in the epilogue of the output-gate projection (K3 g_proj, Kimi Linear g_b_proj).
    Tiles: output rows in whole heads (multiples of head_dim, head-aligned): the RMS is per head of o."""

    head_dim: int
    eps: float


def router(
    xs: list[Tensor], weight: Tensor, bias: Tensor, norm_eps: float | None, top_k: int, renormalize: bool, scaling: float
) -> tuple[Tensor, Tensor]:
    logits = semantics.linear(_normalized(xs, norm_eps), weight, fp32=True)
    return semantics.router_topk(logits, bias, top_k, renormalize, scaling)


@op("router", num_outputs=2, semantics_fn=router)
class Router(NormPrologue):
    """([x, norm_weight], gate weight [E, in], correction bias [E]) -> (ids [B, k] i32, weights [B, k] fp32):
    fp32 router logits + sigmoid + biased top-k + renormalize (spec 5.2). Tiles: none, ONE task (the top-k
    needs every logit of a row; the E x d matrix is small)."""

    top_k: int
    renormalize: bool
    scaling: float


# --- routed experts -----------------------------------------------------------------------------------


def expert_gated_linear(x: Tensor, weight_gate: Tensor, weight_up: Tensor, ids: Tensor, activation: Activation) -> Tensor:
    return activation.evaluate(semantics.expert_linear(x, weight_gate, ids), semantics.expert_linear(x, weight_up, ids))[0]


@op("expert_gated_linear", semantics_fn=expert_gated_linear)
class ExpertGatedLinear(Op):
    """(x [B, in], w1 [E, n, in], w3 [E, n, in], ids [B, k]) -> activation(w1 x, w3 x) per slot [B, k, n]
    (spec 5.3). Tiles: (slot, output rows); a tile reads its expert id at run time and streams the same
    rows of w1 and w3 of that expert."""

    weight_index_input: ClassVar[int | None] = -1  # ids

    activation: Activation


def expert_gated_linear_mxfp4(
    x: Tensor, gate_packed: Tensor, gate_scale: Tensor, up_packed: Tensor, up_scale: Tensor, ids: Tensor, activation: Activation
) -> Tensor:
    gate = semantics.expert_linear_mxfp4(x, gate_packed, gate_scale, ids)
    return activation.evaluate(gate, semantics.expert_linear_mxfp4(x, up_packed, up_scale, ids))[0]


@op("expert_gated_linear_mxfp4", semantics_fn=expert_gated_linear_mxfp4)
class ExpertGatedLinearMXFP4(Op):
    """`expert_gated_linear` with MXFP4 w1/w3 (packed [E, n, in/2] u8, scale [E, n, in/32] u8, spec 5.5)."""

    weight_index_input: ClassVar[int | None] = -1  # ids

    activation: Activation


def _add_residuals(y: Tensor, residuals: list[Tensor]) -> Tensor:
    for r in residuals:
        y = semantics.add(r, y)
    return y


def expert_linear_combine(residuals: list[Tensor], x: Tensor, weight: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
    return _add_residuals(semantics.moe_combine(semantics.expert_linear(x, weight, ids), weights), residuals)


class _CombineResiduals(Op):
    """The combines' leading residuals: r_n + (... + (r_1 + combine)), one rounding per add as in the
    unfused graph (passes/fuse_residual.py: the MoE "+ shared" and the residual stream add, so the shared
    expert's down projection leaves the critical path)."""

    variadic: ClassVar[bool] = True
    core_inputs: ClassVar[int] = 4

    def num_list_inputs(self, total: int) -> int:
        return total - self.core_inputs


@op("expert_linear_combine", semantics_fn=expert_linear_combine)
class ExpertLinearCombine(_CombineResiduals):
    """(*residuals [B, out], a [B, k, in], w2 [E, out, in], ids [B, k], weights [B, k]) -> the residuals
    added to sum_j weights_j * (w2[ids_j] a_j) [B, out]: the down projection with the routing combine in
    its epilogue (spec 5.3). Each slot's product is rounded to the activation dtype, the weighted sum runs
    in fp32 and is rounded ONCE, as in `moe_combine`; then each residual add rounds once.
    Tiles: output rows; a tile covers ALL slots of its rows (the fp32 sum over slots stays in one task)."""

    weight_index_input: ClassVar[int | None] = -2  # ids


def expert_linear_mxfp4_combine(residuals: list[Tensor], x: Tensor, packed: Tensor, scale: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
    return _add_residuals(semantics.moe_combine(semantics.expert_linear_mxfp4(x, packed, scale, ids), weights), residuals)


@op("expert_linear_mxfp4_combine", semantics_fn=expert_linear_mxfp4_combine)
class ExpertLinearMXFP4Combine(_CombineResiduals):
    """`expert_linear_combine` with an MXFP4 w2 (packed [E, out, in/2] u8, scale [E, out, in/32] u8)."""

    weight_index_input: ClassVar[int | None] = -2  # ids
    core_inputs: ClassVar[int] = 5


# --- weight-absorbed MLA decode (spec 4.3) ------------------------------------------------------------
#
# kv_b_proj [H*(nope+v), rank] holds per head h the rows [h*(nope+v), h*(nope+v)+nope) = W_UK[h] and the
# next v rows = W_UV[h]. q_absorb and v_up read those slices of the one weight (no copies): together
# they stream kv_b exactly once.


def _kv_b_heads(kv_b: Tensor, num_heads: int, qk_nope: int, v_dim: int) -> tuple[Tensor, Tensor]:
    """(W_UK [H, nope, rank], W_UV [H, v, rank]) as views of kv_b."""
    w = kv_b.view(num_heads, qk_nope + v_dim, kv_b.shape[-1])
    return w[:, :qk_nope, :], w[:, qk_nope:, :]


def mla_q_absorb(q: Tensor, kv_b: Tensor, num_heads: int, qk_nope: int, v_dim: int) -> Tensor:
    bsz = q.shape[0]
    qh = q.view(bsz, num_heads, -1)
    w_uk, _ = _kv_b_heads(kv_b, num_heads, qk_nope, v_dim)
    q_lat = torch.einsum("bhd,hdc->bhc", qh[..., :qk_nope].to(F32), w_uk.to(F32)).to(q.dtype)
    return torch.cat([q_lat, qh[..., qk_nope:]], dim=-1)


@op("mla_q_absorb", semantics_fn=mla_q_absorb)
class MLAQAbsorb(Op):
    """(q [B, H*(nope+rope)], kv_b [H*(nope+v), rank]) -> [B, H, rank+rope]: per head q_nope W_UK[h] (fp32
    accumulation, one rounding to q's dtype) concatenated with the unchanged q_pe: the MQA query over the
    latent cache. Tiles: heads (a tile streams W_UK of its heads)."""

    num_heads: int
    qk_nope: int
    v_dim: int


def kv_chunk_bounds(positions: Tensor, num_chunks: int, min_chunk_rows: int) -> tuple[Tensor, Tensor]:
    """Run-time KV split (DESIGN.md, "Attention splits the KV range into a fixed number of chunks"): request b
    attends to cache rows [0, n) with n = positions[b] + 1; chunk c covers [c*L, (c+1)*L) clipped to n, with
    L = max(ceil(n / num_chunks), min_chunk_rows). Chunks past the end are empty. Returns (start, end)
    [B, num_chunks] int64."""
    n = positions.long().view(-1, 1) + 1
    length = torch.clamp((n + num_chunks - 1) // num_chunks, min=min_chunk_rows)
    c = torch.arange(num_chunks, device=positions.device).view(1, -1)
    return torch.minimum(c * length, n), torch.minimum((c + 1) * length, n)


def mla_decode(
    q: Tensor, cache: Tensor, positions: Tensor, kv_lora_rank: int, num_chunks: int, min_chunk_rows: int, scale: float
) -> tuple[Tensor, Tensor]:
    bsz, t_max, _ = cache.shape
    start, end = kv_chunk_bounds(positions, num_chunks, min_chunk_rows)
    t = torch.arange(t_max, device=cache.device).view(1, 1, t_max)
    in_chunk = (t >= start.unsqueeze(-1)) & (t < end.unsqueeze(-1))  # [B, K, T]
    kv = cache.to(F32)
    scores = torch.einsum("bhc,btc->bht", q.to(F32), kv) * scale
    scores = scores.unsqueeze(1).masked_fill(~in_chunk.unsqueeze(2), -math.inf)  # [B, K, H, T]
    lse = torch.logsumexp(scores, dim=-1)  # [B, K, H]; -inf for an empty chunk
    p = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0).unsqueeze(-1))
    return torch.einsum("bkht,btc->bkhc", p, kv[..., :kv_lora_rank]), lse


@op("mla_decode", num_outputs=2, semantics_fn=mla_decode)
class MLADecode(Op):
    """(q_abs [B, H, rank+rope], cache [B, T, rank+rope], positions [B]) -> (o [B, K, H, rank] fp32,
    lse [B, K, H] fp32): MQA over the latent cache with ONE shared 576-wide KV head whose value is the
    first `rank` columns of each row (spec 4.3), fp32 softmax scaled by `scale` = (nope+rope)^-0.5, split
    into K = `num_chunks` chunks of the valid rows (`kv_chunk_bounds`). Per chunk: the chunk-normalized
    output and its log-sum-exp; an empty chunk gives o = 0, lse = -inf. Tiles: (request, chunk), all
    heads in one tile (they share the KV rows), or head groups of it."""

    kv_lora_rank: int
    num_chunks: int
    min_chunk_rows: int
    scale: float


def mla_v_up(o: Tensor, lse: Tensor, kv_b: Tensor, num_heads: int, qk_nope: int, v_dim: int) -> Tensor:
    weight = torch.exp(lse - lse.amax(dim=1, keepdim=True))  # [B, K, H]; chunk 0 is never empty
    o_lat = (weight.unsqueeze(-1) * o).sum(1) / weight.sum(1).unsqueeze(-1)  # [B, H, rank]
    _, w_uv = _kv_b_heads(kv_b, num_heads, qk_nope, v_dim)
    out = torch.einsum("bhc,hdc->bhd", o_lat, w_uv.to(F32))
    return out.reshape(o.shape[0], num_heads * v_dim).to(kv_b.dtype)


@op("mla_v_up", semantics_fn=mla_v_up)
class MLAVUp(Op):
    """(o [B, K, H, rank] fp32, lse [B, K, H] fp32, kv_b [H*(nope+v), rank]) -> [B, H*v]: the combine task of
    the KV split (log-sum-exp merge of the K chunks, fp32) followed by the per-head up-projection
    o_lat W_UV[h]^T (spec 4.3), rounded once to kv_b's dtype (a "compute" weight: the activation dtype).
    Tiles: heads (a tile reads every chunk's partials of its heads and streams W_UV of its heads)."""

    num_heads: int
    qk_nope: int
    v_dim: int
