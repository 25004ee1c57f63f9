"""Reference semantics of every IR op, as plain torch functions (CPU or CUDA, float32 or bfloat16).

This is the numerics contract of the whole compiler (spec section 9, "fp32 islands"): the reference
decode step calls these through `torch.ops.k3mk.*`, the CPU interpreter calls them per IR node, and
GPU op templates are tested against them. Each function is functional: state updates are returned,
never written in place. Spec sections are named per function (docs/kimi_k3_decode_spec.md).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

F32 = torch.float32


def embedding(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows of the embedding table; no scaling (spec 7)."""
    return table[ids]


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """KimiRMSNorm: normalize in fp32, round to the activation dtype, THEN apply the gain (spec 7)."""
    xf = x.to(F32)
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight.to(x.dtype) * y


def linear(x: torch.Tensor, weight: torch.Tensor, fp32: bool = False) -> torch.Tensor:
    """y = x @ W.T with W [out, in]. `fp32` computes and returns fp32 (the MoE router, spec 5.2)."""
    if fp32:
        return x.to(F32) @ weight.to(F32).T
    return x @ weight.to(x.dtype).T


def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise sum in the activation dtype (residual and prefix adds round to bf16, spec 6)."""
    return a + b.to(a.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU (Kimi Linear, spec 5.1)."""
    return F.silu(gate) * up


def situ_mul(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """SiTU-GLU in fp32 (spec 5.1): beta*tanh(g/beta)*sigmoid(g) times the soft-clamped up."""
    g, u = gate.to(F32), up.to(F32)
    a = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    if linear_beta is not None:
        u = linear_beta * torch.tanh(u / linear_beta)
    return (a * u).to(gate.dtype)


def kda_conv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: torch.Tensor,
    weight_q: torch.Tensor,
    weight_k: torch.Tensor,
    weight_v: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step of the causal depthwise short conv + SiLU on q, k and v (spec 3.2).

    q, k, v [B, P]; state [B, W-1, 3P] holds the last W-1 inputs of q|k|v, oldest first (vLLM's fused
    "SD" layout, spec 8); weights [P, 1, W], weight[:, 0, -1] multiplying the new token. Math in fp32;
    returns (silu(conv) of q, k, v in their dtype, the shifted state)."""
    x = torch.cat([q, k, v], dim=-1)
    weight = torch.cat([weight_q, weight_k, weight_v], dim=0)
    window = torch.cat([state, x.unsqueeze(1).to(state.dtype)], dim=1)  # [B, W, 3P]
    y = F.silu((window.to(F32) * weight.to(F32)[:, 0, :].T.unsqueeze(0)).sum(1)).to(q.dtype)
    p = q.shape[-1]
    # clone, not .contiguous(): at B == 1 the slices already are contiguous views of y / window, and a
    # custom op's outputs must not alias each other or an input
    own = lambda t: t.clone(memory_format=torch.contiguous_format)  # noqa: E731
    return own(y[:, :p]), own(y[:, p : 2 * p]), own(y[:, 2 * p :]), own(window[:, 1:, :])


def kda_gate(
    f: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, num_heads: int, lower_bound: float | None
) -> torch.Tensor:
    """Per-key-channel log decay g [B, H, D] in fp32 (spec 3.2).

    lower_bound set (K3):   g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias))
    lower_bound None (KL):  g = -exp(A_log) * softplus(f + dt_bias)"""
    b = f.shape[0]
    z = (f.to(F32) + dt_bias.to(F32)).view(b, num_heads, -1)
    a = a_log.to(F32).view(num_heads, 1).exp()
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(a * z)
    return -a * F.softplus(z)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def kda_recurrence(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta_logits: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One delta-rule step per head (spec 3.2), fp32 throughout.

    q, k, v [B, H*D] (post-conv), g [B, H, D] log decay, beta_logits [B, H], state [B, H, V, K] fp32
    (V-major, "state_v_first"). Returns (o [B, H*D] in q's dtype, new state)."""
    bsz, h = beta_logits.shape
    qf = _l2norm(q.to(F32).view(bsz, h, -1)) * (q.shape[-1] // h) ** -0.5
    kf = _l2norm(k.to(F32).view(bsz, h, -1))
    vf = v.to(F32).view(bsz, h, -1)
    beta = torch.sigmoid(beta_logits.to(F32))
    s = state.to(F32) * g.exp().unsqueeze(2)  # decay per KEY channel
    u = beta.unsqueeze(-1) * (vf - (s * kf.unsqueeze(2)).sum(-1))
    s = s + u.unsqueeze(-1) * kf.unsqueeze(2)
    o = (s * qf.unsqueeze(2)).sum(-1)
    return o.reshape(bsz, -1).to(q.dtype), s


def gated_rmsnorm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, head_dim: int, eps: float) -> torch.Tensor:
    """KDA o_norm per head, all fp32: normalize, times weight, times sigmoid(gate) (spec 3.2)."""
    shape = x.shape
    xf = x.to(F32).view(*shape[:-1], -1, head_dim)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(F32)
    y = y * torch.sigmoid(gate.to(F32).view_as(y))
    return y.reshape(shape).to(x.dtype)


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """MLA output gate, in the activation dtype: o * sigmoid(g) (spec 4.2)."""
    return x * torch.sigmoid(gate.to(x.dtype))


def mla_latent(c: torch.Tensor, weight: torch.Tensor, kv_lora_rank: int, eps: float) -> torch.Tensor:
    """The latent cache row: RMSNorm(c_kv) || k_pe, k_pe neither normalized nor rotated (spec 4.3)."""
    return torch.cat([rmsnorm(c[:, :kv_lora_rank], weight, eps), c[:, kv_lora_rank:]], dim=-1)


def mla_cache_write(cache: torch.Tensor, row: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Write each request's new latent row at its position. cache [B, T_max, C]; positions [B] int."""
    onehot = F.one_hot(positions.long(), cache.shape[1]).to(torch.bool).unsqueeze(-1)  # [B, T_max, 1]
    return torch.where(onehot, row.to(cache.dtype).unsqueeze(1), cache)


def mla_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    positions: torch.Tensor,
    kv_b: torch.Tensor,
    num_heads: int,
    qk_nope: int,
    qk_rope: int,
    v_dim: int,
    kv_lora_rank: int,
) -> torch.Tensor:
    """Naive (non-absorbed) NoPE MLA over the cache rows 0..positions[b] (spec 4.2).

    q [B, H*(nope+rope)]; cache [B, T_max, kv_lora+rope]; kv_b [H*(nope+v), kv_lora]. Keys and values are
    up-projected from the cache; the rope part of the key is one shared head. fp32 softmax, scale
    (nope+rope)^-0.5. Returns o [B, H*v] in q's dtype."""
    bsz, t_max, _ = cache.shape
    dt = q.dtype
    qh = q.view(bsz, num_heads, qk_nope + qk_rope)
    kv = (cache[..., :kv_lora_rank] @ kv_b.to(dt).T).view(bsz, t_max, num_heads, qk_nope + v_dim)
    k_nope, v = kv[..., :qk_nope], kv[..., qk_nope:]
    k_pe = cache[..., kv_lora_rank:]
    scores = torch.einsum("bhd,bthd->bht", qh[..., :qk_nope].to(F32), k_nope.to(F32))
    scores = scores + torch.einsum("bhd,btd->bht", qh[..., qk_nope:].to(F32), k_pe.to(F32))
    scores = scores * (qk_nope + qk_rope) ** -0.5
    valid = torch.arange(t_max, device=cache.device).view(1, t_max) <= positions.view(bsz, 1)  # [B, T_max]
    p = torch.softmax(scores.masked_fill(~valid.unsqueeze(1), -math.inf), dim=-1)
    # zero the unwritten rows' values too: 0 * NaN/inf junk (a cache from torch.empty) would poison o
    v = v.masked_fill(~valid.view(bsz, t_max, 1, 1), 0)
    o = torch.einsum("bht,bthd->bhd", p.to(dt), v)
    return o.reshape(bsz, num_heads * v_dim)


def router_topk(
    logits: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """noaux_tc sigmoid router (spec 5.2). logits [B, E] fp32. The correction bias picks the experts;
    the weights come from the un-biased scores. Ties go to the lowest expert index (documented choice,
    spec open question 6): a stable descending sort keeps index order among equal scores.
    Returns (ids [B, k] int32, weights [B, k] fp32)."""
    s = torch.sigmoid(logits.to(F32))
    sel = s + bias.to(F32)
    idx = torch.sort(sel, dim=-1, descending=True, stable=True).indices[:, :top_k]
    w = s.gather(1, idx)
    if renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return idx.to(torch.int32), w * scaling


E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 (compressed-tensors `mxfp4-pack-quantized`, spec 5.5) to `dtype`.

    packed [..., out, in/2] uint8: two E2M1 codes per byte, the low nibble is the even input index;
    scale [..., out, in/32] uint8 UE8M0: 2^(s - 127) per group of 32 inputs."""
    lut = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=F32, device=packed.device)
    p = packed.to(torch.int32)
    codes = torch.stack([p & 0xF, p >> 4], dim=-1).flatten(-2)  # [..., out, in]
    vals = lut[codes]
    s = torch.exp2(scale.to(F32) - 127.0)
    vals = vals.unflatten(-1, (scale.shape[-1], -1)) * s.unsqueeze(-1)
    return vals.flatten(-2).to(dtype)


def expert_linear(x: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Per routing slot, the chosen expert's matvec. x [B, in] (shared by all slots) or [B, k, in];
    weight [E, out, in]; ids [B, k]. Returns [B, k, out]. Only the chosen experts are read."""
    w = weight[ids.long()].to(x.dtype)  # [B, k, out, in]
    xs = x.unsqueeze(1).expand(-1, ids.shape[1], -1) if x.dim() == 2 else x
    return torch.einsum("bki,bkoi->bko", xs, w)


def expert_linear_mxfp4(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """`expert_linear` with MXFP4 weights, dequantized only for the chosen experts, one routing slot at a time: every
    slot's at once took 21 GiB of decode temporaries at K3's widths and 16 tokens (2026-12-06)."""
    xs = x.unsqueeze(1).expand(-1, ids.shape[1], -1) if x.dim() == 2 else x
    slots = []
    for j in range(ids.shape[1]):
        e = ids[:, j].long()
        slots.append(torch.einsum("bi,boi->bo", xs[:, j], dequant_mxfp4(packed[e], scale[e], x.dtype)))
    return torch.stack(slots, dim=1)


def moe_combine(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum over routing slots in fp32 (spec 5.3), rounded to the activation dtype."""
    return (y.to(F32) * weights.to(F32).unsqueeze(-1)).sum(1).to(y.dtype)


def attn_res(sources: list[torch.Tensor], norm_weight: torch.Tensor, proj_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Block attention residual mix (spec 6): softmax over sources of a gain-folded RMS-normalized score,
    mixing the UN-normalized sources, all fp32; returns the activation dtype."""
    v = torch.stack(sources, dim=1).to(F32)  # [B, n, d]
    r = torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    w = norm_weight.to(F32) * proj_weight.to(F32).reshape(-1)
    p = torch.softmax(((v * r) * w).sum(-1), dim=-1)
    return (p.unsqueeze(-1) * v).sum(1).to(sources[0].dtype)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Greedy next token, lowest index on ties. Returns int32 [B]."""
    return torch.argmax(logits.to(F32), dim=-1).to(torch.int32)
