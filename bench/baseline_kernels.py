"""Triton kernels of the baseline decode step (bench/baseline.py): the few reference ops whose plain
PyTorch form costs many small kernels or reads weights it need not read, each computing the function of
its `k3mk.ir.semantics` counterpart with the same bf16 roundings (only fp32 summation orders differ).

Triton, not CuTe DSL: this is the comparator, not the product (BENCHMARKS.md), and Triton is what the
serving engines' own MoE and KDA kernels are written in. The kernels also run in Triton's CPU
interpreter (TRITON_INTERPRET=1), which is how the CPU tests check them (tests/bench/kernel_checks.py).

- rmsnorm: KimiRMSNorm in one kernel (normalise in fp32, round, then the gain; spec 7);
- act_mul: SwiGLU / SiTU-GLU in one kernel (spec 5.1);
- attn_res: the block attention residual mix of up to 16 stacked sources (spec 6);
- kda_conv: the short causal conv + SiLU of q, k, v, shifting the SD conv state IN PLACE (spec 3.2, 8);
- router_topk: sigmoid + correction bias, top-k with the lowest index winning ties, renormalise, scale
  (spec 5.2);
- expert_gemv: routed experts grouped by expert, vLLM fused_moe style: the (token, slot) pairs are sorted
  by expert, one program per run of equal experts and output tile streams that expert's rows ONCE for
  every token that chose it; bf16 or MXFP4 weights (dequantised in registers, spec 5.5); optionally w1
  and w3 together with the activation fused (spec 5.3);
- moe_combine: the fp32 routing-weighted sum over slots (spec 5.3).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Triton 3.6's CPU interpreter multiplies bf16 dot operands as their uint16 bit patterns: there the MoE
# dot runs on fp32 copies of the (bf16-exact) operands instead, with the same exact products.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
MAX_TOKENS_PER_EXPERT = 16  # one run of equal experts is at most the batch; 16 is tl.dot's smallest M
ACT_SILU, ACT_SITU = 0, 1


def _pow2(n: int) -> int:
    return triton.next_power_of_2(n)


def _rows(x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"expected a 2-d tensor with contiguous rows, got shape {tuple(x.shape)} strides {x.stride()}")
    return x


# --- rmsnorm ---------------------------------------------------------------------------------------


@triton.jit
def _rmsnorm_kernel(x_ptr, x_stride, w_ptr, out_ptr, out_stride, eps, DIM: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < DIM
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / DIM + eps)
    dtype = out_ptr.dtype.element_ty
    y = (x * rstd).to(dtype)  # rounded BEFORE the gain, as KimiRMSNorm
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(dtype)
    tl.store(out_ptr + row * out_stride + cols, (w.to(tl.float32) * y.to(tl.float32)).to(dtype), mask=mask)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """semantics.rmsnorm of the rows of x [rows, dim] (rows may be strided)."""
    _rows(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block = _pow2(x.shape[1])
    _rmsnorm_kernel[(x.shape[0],)](x, x.stride(0), weight, out, out.stride(0), eps, DIM=x.shape[1], BLOCK=block,
                                   num_warps=8 if block >= 4096 else 4)  # fmt: skip
    return out


# --- activations -----------------------------------------------------------------------------------


@triton.jit
def _tanh(x):
    """tanh from exp (libdevice's is not in Triton's CPU interpreter); relative error ~1e-7 for |x| > 0.01,
    ~1e-5 below: far under the bf16 rounding that follows."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _act(gate, up, ACT: tl.constexpr, beta, linear_beta, HAS_LINEAR_BETA: tl.constexpr, dtype: tl.constexpr):
    """act(gate, up) of bf16 (or fp32) operands, rounded to `dtype` where the reference rounds."""
    g = gate.to(tl.float32)
    u = up.to(tl.float32)
    if ACT == 0:  # F.silu(gate) * up: silu rounded to the activation dtype, then the product
        a = (g * tl.sigmoid(g)).to(dtype).to(tl.float32)
    else:  # SiTU: all fp32, one rounding
        a = beta * _tanh(g / beta) * tl.sigmoid(g)
        if HAS_LINEAR_BETA:
            u = linear_beta * _tanh(u / linear_beta)
    return (a * u).to(dtype)


@triton.jit
def _act_mul_kernel(g_ptr, u_ptr, out_ptr, n, beta, linear_beta, ACT: tl.constexpr, HAS_LINEAR_BETA: tl.constexpr,
                    BLOCK: tl.constexpr):  # fmt: skip
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, _act(g, u, ACT, beta, linear_beta, HAS_LINEAR_BETA, out_ptr.dtype.element_ty), mask=mask)


def act_mul(gate: torch.Tensor, up: torch.Tensor, activation: str, beta: float = 1.0, linear_beta: float | None = None) -> torch.Tensor:
    """semantics.silu_mul (activation "silu") or semantics.situ_mul ("situ") of contiguous gate, up."""
    if not (gate.is_contiguous() and up.is_contiguous() and gate.shape == up.shape):
        raise ValueError("act_mul needs contiguous gate and up of one shape")
    out = torch.empty_like(gate)
    n, block = gate.numel(), 1024
    _act_mul_kernel[(triton.cdiv(n, block),)](gate, up, out, n, beta, linear_beta or 1.0, ACT=_act_code(activation),
                                              HAS_LINEAR_BETA=linear_beta is not None, BLOCK=block)  # fmt: skip
    return out


def _act_code(activation: str) -> int:
    codes = {"silu": ACT_SILU, "situ": ACT_SITU}
    if activation not in codes:
        raise ValueError(f"unknown activation {activation!r} (known: {', '.join(codes)})")
    return codes[activation]


# --- block attention residuals ---------------------------------------------------------------------


@triton.jit
def _attn_res_kernel(v_ptr, nw_ptr, pw_ptr, out_ptr, n_src, eps, SRC_BLOCK: tl.constexpr, DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    src = tl.arange(0, SRC_BLOCK)
    src_mask = src < n_src  # a run-time count: one compile serves every layer's mix
    base = v_ptr + b * n_src * DIM
    sumsq = tl.zeros([SRC_BLOCK], dtype=tl.float32)
    dots = tl.zeros([SRC_BLOCK], dtype=tl.float32)
    for d0 in range(0, DIM, BLOCK_D):  # pass 1: each source's RMS and its score against the folded gain
        d = d0 + tl.arange(0, BLOCK_D)
        d_mask = d < DIM
        v = tl.load(base + src[:, None] * DIM + d[None, :], mask=src_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
        w = tl.load(nw_ptr + d, mask=d_mask, other=0.0).to(tl.float32) * tl.load(pw_ptr + d, mask=d_mask, other=0.0).to(tl.float32)
        sumsq += tl.sum(v * v, axis=1)
        dots += tl.sum(v * w[None, :], axis=1)
    logits = tl.where(src_mask, dots * tl.rsqrt(sumsq / DIM + eps), float("-inf"))
    p = tl.exp(logits - tl.max(logits, axis=0))
    p = p / tl.sum(p, axis=0)
    for d0 in range(0, DIM, BLOCK_D):  # pass 2: mix the UN-normalised sources
        d = d0 + tl.arange(0, BLOCK_D)
        d_mask = d < DIM
        v = tl.load(base + src[:, None] * DIM + d[None, :], mask=src_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
        tl.store(out_ptr + b * DIM + d, tl.sum(p[:, None] * v, axis=0).to(out_ptr.dtype.element_ty), mask=d_mask)


MAX_ATTN_RES_SOURCES = 16


def attn_res(sources: list[torch.Tensor], norm_weight: torch.Tensor, proj_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """semantics.attn_res: sources [B, d] each (at most MAX_ATTN_RES_SOURCES)."""
    if len(sources) > MAX_ATTN_RES_SOURCES:
        raise ValueError(f"attn_res kernel takes at most {MAX_ATTN_RES_SOURCES} sources, got {len(sources)}")
    v = torch.stack(sources, dim=1)  # [B, n, d]; one copy of a few hundred KB
    batch, n, dim = v.shape
    out = torch.empty((batch, dim), dtype=v.dtype, device=v.device)
    _attn_res_kernel[(batch,)](v, norm_weight, proj_weight, out, n, eps, SRC_BLOCK=MAX_ATTN_RES_SOURCES, DIM=dim,
                               BLOCK_D=min(512, _pow2(dim)), num_warps=8)  # fmt: skip
    return out


# --- KDA short conv --------------------------------------------------------------------------------


@triton.jit
def _conv_tile(x_ptr, w_ptr, out_ptr, state_ptr, b, c, state_col0, P: tl.constexpr, W: tl.constexpr):
    """Channels c of one of q / k / v for request b: silu(conv) out, the state columns shifted in place."""
    row = state_ptr + b * (W - 1) * 3 * P + state_col0 + c  # state [B, W-1, 3P], oldest first
    x = tl.load(x_ptr + b * P + c).to(state_ptr.dtype.element_ty)
    acc = tl.zeros(c.shape, dtype=tl.float32)
    for j in tl.static_range(W - 1):  # oldest first; column j moves to j - 1 once read (same thread: in place is safe)
        s = tl.load(row + j * 3 * P)
        acc += s.to(tl.float32) * tl.load(w_ptr + c * W + j)
        if j > 0:
            tl.store(row + (j - 1) * 3 * P, s)
    acc += x.to(tl.float32) * tl.load(w_ptr + c * W + (W - 1))  # the new token last
    tl.store(out_ptr + b * P + c, (acc * tl.sigmoid(acc)).to(out_ptr.dtype.element_ty))
    tl.store(row + (W - 2) * 3 * P, x)


@triton.jit
def _kda_conv_kernel(q_ptr, k_ptr, v_ptr, wq_ptr, wk_ptr, wv_ptr, qo_ptr, ko_ptr, vo_ptr, state_ptr, P: tl.constexpr, W: tl.constexpr,
                     BLOCK: tl.constexpr):  # fmt: skip
    b = tl.program_id(0)
    tile = tl.program_id(1)
    tiles = P // BLOCK
    c = (tile % tiles) * BLOCK + tl.arange(0, BLOCK)
    which = tile // tiles
    if which == 0:
        _conv_tile(q_ptr, wq_ptr, qo_ptr, state_ptr, b, c, 0, P, W)
    elif which == 1:
        _conv_tile(k_ptr, wk_ptr, ko_ptr, state_ptr, b, c, P, P, W)
    else:
        _conv_tile(v_ptr, wv_ptr, vo_ptr, state_ptr, b, c, 2 * P, P, W)


def kda_conv_(q, k, v, state, weight_q, weight_k, weight_v) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """semantics.kda_conv with the state [B, W-1, 3P] shifted IN PLACE; returns silu(conv) of q, k, v."""
    batch, p = q.shape
    width = weight_q.shape[-1]
    if not all(t.is_contiguous() for t in (q, k, v, state, weight_q, weight_k, weight_v)):
        raise ValueError("kda_conv_ needs contiguous tensors")
    if tuple(state.shape) != (batch, width - 1, 3 * p):
        raise ValueError(f"conv state {tuple(state.shape)} is not [B, W-1, 3P] = {(batch, width - 1, 3 * p)}")
    block = min(256, p & -p)  # a power of two dividing P: a tile never straddles q / k / v
    outs = [torch.empty_like(t) for t in (q, k, v)]
    _kda_conv_kernel[(batch, 3 * (p // block))](q, k, v, weight_q, weight_k, weight_v, *outs, state, P=p, W=width, BLOCK=block)
    return tuple(outs)


# --- router ----------------------------------------------------------------------------------------


@triton.jit
def _router_topk_kernel(logits_ptr, bias_ptr, ids_ptr, weights_ptr, scaling, E: tl.constexpr, BLOCK_E: tl.constexpr,
                        TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr):  # fmt: skip
    b = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    mask = e < E
    s = tl.sigmoid(tl.load(logits_ptr + b * E + e, mask=mask, other=0.0))
    sel = tl.where(mask, s + tl.load(bias_ptr + e, mask=mask, other=0.0), float("-inf"))  # the bias picks, never weighs
    slot = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    w = tl.zeros([BLOCK_K], dtype=tl.float32)
    for j in tl.static_range(TOP_K):  # descending selection score, lowest index first among equals
        best = tl.max(sel, axis=0)
        idx = tl.min(tl.where(sel == best, e, BLOCK_E), axis=0)
        ids = tl.where(slot == j, idx, ids)
        w = tl.where(slot == j, tl.sum(tl.where(e == idx, s, 0.0), axis=0), w)
        sel = tl.where(e == idx, float("-inf"), sel)
    if RENORMALIZE:
        w = w / (tl.sum(w, axis=0) + 1e-20)
    tl.store(ids_ptr + b * TOP_K + slot, ids, mask=slot < TOP_K)
    tl.store(weights_ptr + b * TOP_K + slot, w * scaling, mask=slot < TOP_K)


def router_topk(logits: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """semantics.router_topk: logits [B, E] fp32 -> (ids [B, k] int32, weights [B, k] fp32)."""
    batch, experts = logits.shape
    if logits.dtype != torch.float32 or not logits.is_contiguous():
        raise ValueError("router_topk needs contiguous fp32 logits")
    ids = torch.empty((batch, top_k), dtype=torch.int32, device=logits.device)
    weights = torch.empty((batch, top_k), dtype=torch.float32, device=logits.device)
    _router_topk_kernel[(batch,)](logits, bias, ids, weights, scaling, E=experts, BLOCK_E=_pow2(experts), TOP_K=top_k,
                                  BLOCK_K=max(2, _pow2(top_k)), RENORMALIZE=renormalize)  # fmt: skip
    return ids, weights


# --- routed experts --------------------------------------------------------------------------------


@triton.jit
def _expert_tile(w_ptr, scale_ptr, expert, n, n_mask, k0, N: tl.constexpr, K: tl.constexpr, MXFP4: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, GROUP: tl.constexpr):  # fmt: skip
    """Rows n, columns k0 + [0, BLOCK_K) of expert `expert`'s weight as bf16 [BLOCK_N, BLOCK_K]: bf16
    [E, N, K], or MXFP4 codes [E, N, K/2] (low nibble = even column) with UE8M0 scales [E, N, K/GROUP]
    (spec 5.5). Columns past K read as 0."""
    rows = expert * N + n[:, None]
    if MXFP4:
        byte = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        packed = tl.load(w_ptr + rows * (K // 2) + byte[None, :], mask=n_mask[:, None] & (byte < K // 2)[None, :], other=0).to(tl.int32)
        codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BLOCK_N, BLOCK_K))  # even column = low nibble
        mag = codes & 7
        exp = mag >> 1
        normal = ((exp + 126) << 23) | ((mag & 1) << 22)  # E2M1 1.m x 2^(e-1) as fp32 bits
        value = tl.where(exp == 0, (mag & 1).to(tl.float32) * 0.5, normal.to(tl.float32, bitcast=True))
        value = tl.where(codes >= 8, -value, value)
        group = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        s = tl.load(scale_ptr + rows * (K // GROUP) + group[None, :], mask=n_mask[:, None] & (group < K // GROUP)[None, :], other=127)
        scale = (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # 2^(s-127); s = 0 reads as 0 (true value 2^-127)
        value = tl.reshape(value, (BLOCK_N, BLOCK_K // GROUP, GROUP)) * scale[:, :, None]
        tile = tl.reshape(value, (BLOCK_N, BLOCK_K)).to(tl.bfloat16)  # exact: E2M1 x 2^k fits bf16
    else:
        k = k0 + tl.arange(0, BLOCK_K)
        tile = tl.load(w_ptr + rows * K + k[None, :], mask=n_mask[:, None] & (k < K)[None, :], other=0.0).to(tl.bfloat16)
    return tile


@triton.jit
def _dot(x, w, acc, DOT_FP32: tl.constexpr):
    """acc + x w^T of bf16 x [T, BK] and w [BN, BK], fp32 accumulation (INTERPRETED above)."""
    if DOT_FP32:
        acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    else:
        acc = tl.dot(x, tl.trans(w), acc)
    return acc


@triton.jit
def _expert_gemv_kernel(x_ptr, x_stride, w1_ptr, s1_ptr, w3_ptr, s3_ptr, out_ptr, sorted_expert_ptr, sorted_pair_ptr, num_pairs,
                        beta, linear_beta, N: tl.constexpr, K: tl.constexpr, TOP_K: tl.constexpr, X_PER_TOKEN: tl.constexpr,
                        MXFP4: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr, HAS_LINEAR_BETA: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                        DOT_FP32: tl.constexpr):  # fmt: skip
    """Program (p, tile): if sorted position p starts a run of equal experts, the rows `tile` of that
    expert for every pair in the run (each pair = (token, slot)); other programs leave at once."""
    p = tl.program_id(0)
    expert = tl.load(sorted_expert_ptr + p).to(tl.int64)  # int64: expert * N * K passes 2^31 at K3's 896 experts
    previous = tl.load(sorted_expert_ptr + p - 1, mask=p > 0, other=-1).to(tl.int64)
    if previous != expert:
        t = tl.arange(0, BLOCK_T)
        in_range = p + t < num_pairs
        run = in_range & (tl.load(sorted_expert_ptr + p + t, mask=in_range, other=-1) == expert)
        pair = tl.load(sorted_pair_ptr + p + t, mask=run, other=0)
        x_row = pair // TOP_K if X_PER_TOKEN else pair
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = n < N
        acc1 = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        acc3 = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + x_row[:, None] * x_stride + k[None, :], mask=run[:, None] & (k < K)[None, :], other=0.0)
            x = x.to(tl.bfloat16)
            w1 = _expert_tile(w1_ptr, s1_ptr, expert, n, n_mask, k0, N, K, MXFP4, BLOCK_N, BLOCK_K, GROUP)
            acc1 = _dot(x, w1, acc1, DOT_FP32)
            if GATED:
                w3 = _expert_tile(w3_ptr, s3_ptr, expert, n, n_mask, k0, N, K, MXFP4, BLOCK_N, BLOCK_K, GROUP)
                acc3 = _dot(x, w3, acc3, DOT_FP32)
        dtype = out_ptr.dtype.element_ty
        if GATED:  # gate and up rounded like expert_linear's outputs, then the activation
            y = _act(acc1.to(dtype), acc3.to(dtype), ACT, beta, linear_beta, HAS_LINEAR_BETA, dtype)
        else:
            y = acc1.to(dtype)
        tl.store(out_ptr + pair[:, None] * N + n[None, :], y, mask=run[:, None] & n_mask[None, :])


def group_by_expert(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted experts, their (token * k + slot) pair indices) of ids [B, k]: stable, so a run lists the
    tokens in order."""
    experts, pairs = torch.sort(ids.flatten(), stable=True)
    return experts, pairs


def _block_n(n: int, pairs: int, sms: int) -> int:
    """Rows per program: the widest tile that still gives every SM about two programs when each pair
    has its own expert (few tokens: the expert count bounds the parallelism)."""
    for block in (64, 32):
        if pairs * triton.cdiv(n, block) >= 2 * sms:
            return block
    return 16


def expert_gemv(x: torch.Tensor, groups: tuple[torch.Tensor, torch.Tensor], top_k: int, w1: torch.Tensor, s1: torch.Tensor | None = None,
                w3: torch.Tensor | None = None, s3: torch.Tensor | None = None, activation: str | None = None, beta: float = 1.0,
                linear_beta: float | None = None) -> torch.Tensor:  # fmt: skip
    """Per (token, slot) pair, the chosen expert's matvec, each chosen expert's rows read ONCE.

    x [B, K] (every slot of a token reads its row; the gate/up projections) or [B * k, K] (one row per
    pair; the down projection). w1 bf16 [E, N, K], or MXFP4 codes [E, N, K/2] with scales s1. With w3
    (and s3) and `activation`: act(bf16(x w1[e]^T), bf16(x w3[e]^T)) (semantics.expert_linear twice, then
    silu_mul / situ_mul). Returns [B * k, N] in x's dtype, row = token * k + slot."""
    experts, pairs = groups
    num_pairs = experts.numel()
    _rows(x)
    if num_pairs % top_k or x.shape[0] not in (num_pairs // top_k, num_pairs):
        raise ValueError(f"x has {x.shape[0]} rows for {num_pairs} pairs of top-{top_k}")
    if num_pairs // top_k > MAX_TOKENS_PER_EXPERT:
        raise ValueError(f"expert_gemv runs at most {MAX_TOKENS_PER_EXPERT} tokens per step, got {num_pairs // top_k}")
    mxfp4 = w1.dtype == torch.uint8
    n, k = w1.shape[1], w1.shape[2] * (2 if mxfp4 else 1)
    group = k // s1.shape[2] if mxfp4 else 32
    if mxfp4 and (k % group or group != 32):
        raise ValueError(f"MXFP4 experts need groups of 32 inputs, got {group} for K {k}")
    gated = w3 is not None
    out = torch.empty((num_pairs, n), dtype=x.dtype, device=x.device)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    block_n = _block_n(n, num_pairs, sms)
    grid = (num_pairs, triton.cdiv(n, block_n))
    _expert_gemv_kernel[grid](
        x, x.stride(0), w1, s1 if mxfp4 else w1, w3 if gated else w1, s3 if (gated and mxfp4) else w1, out, experts, pairs, num_pairs,
        beta, linear_beta or 1.0, N=n, K=k, TOP_K=top_k, X_PER_TOKEN=x.shape[0] != num_pairs, MXFP4=mxfp4, GATED=gated,
        ACT=_act_code(activation) if gated else 0, HAS_LINEAR_BETA=linear_beta is not None, BLOCK_T=MAX_TOKENS_PER_EXPERT,
        BLOCK_N=block_n, BLOCK_K=min(128, max(32, _pow2(k))), GROUP=group, DOT_FP32=INTERPRETED, num_warps=4, num_stages=3,
    )  # fmt: skip
    return out


@triton.jit
def _moe_combine_kernel(y_ptr, w_ptr, out_ptr, TOP_K: tl.constexpr, N: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = n < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(TOP_K):  # slot order, as the reference sums
        acc += tl.load(y_ptr + (b * TOP_K + j) * N + n, mask=mask, other=0.0).to(tl.float32) * tl.load(w_ptr + b * TOP_K + j)
    tl.store(out_ptr + b * N + n, acc.to(out_ptr.dtype.element_ty), mask=mask)


def moe_combine(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """semantics.moe_combine: y [B, k, N] (contiguous), weights [B, k] fp32 -> [B, N]."""
    batch, top_k, n = y.shape
    if not (y.is_contiguous() and weights.is_contiguous()):
        raise ValueError("moe_combine needs contiguous y and weights")
    out = torch.empty((batch, n), dtype=y.dtype, device=y.device)
    block = min(1024, _pow2(n))
    _moe_combine_kernel[(batch, triton.cdiv(n, block))](y, weights, out, TOP_K=top_k, N=n, BLOCK_N=block)
    return out
