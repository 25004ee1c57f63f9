"""The baseline decode step: the reference DecodeStep (compiler/reference.py) run as ordinary GPU
kernels, to be captured in ONE CUDA graph and timed against the megakernel (bench/decode_bench.py,
BENCHMARKS.md). Same math as the reference, same weights (the reference's own tensors: nothing is
copied or re-laid-out), same decode state layouts (spec 8); it differs only where a faster kernel
replaces a hot op, each checked against the op it replaces (tests/bench):

| reference op(s)                          | baseline                                                                 |
|------------------------------------------|--------------------------------------------------------------------------|
| linear                                   | unchanged: torch matmul = cuBLAS GEMV/GEMM                               |
| linear(fp32=True) (router logits)        | torch.mm(bf16, bf16, out_dtype=float32): cuBLAS, no fp32 copy of the gate |
| rmsnorm, silu_mul / situ_mul, attn_res   | one Triton kernel each (bench/baseline_kernels.py)                       |
| kda_conv                                 | one Triton kernel, conv state shifted in place                           |
| kda_gate + kda_recurrence                | flash-linear-attention's fused_recurrent_kda (fla-core 0.6.0): gate, q/k L2 norm and beta sigmoid in the kernel, our [B, H, V, K] fp32 state (fla's state_v_first layout) updated in place |
| gated_rmsnorm                            | fla's rms_norm_gated (sigmoid gate)                                      |
| mla_latent + mla_cache_write             | Triton rmsnorm, one row per request written into the cache in place (no full-cache rewrite) |
| mla_attention (naive: up-projects the cache) | weight-absorbed MLA (spec 4.3) in torch: cuBLAS batched GEMMs over the first `attention_window` cache rows, fp32 scores and softmax |
| router_topk                              | one Triton kernel                                                        |
| expert_linear x3 (index_select of expert weights) + act + moe_combine | Triton grouped expert GEMVs (each selected expert's rows read once per step, vLLM fused_moe style; MXFP4 dequantised in registers; w1 + w3 + activation in one kernel) and a Triton combine |
| embedding, add, sigmoid_gate, argmax     | unchanged (torch)                                                        |

The methods of the reference that only sequence ops (forward, the per-layer wiring, the attention-
residual mix, the activation) are the reference's OWN code, run with its `k3mk` op namespace bound to
FAST (below); the three mixers/FFN that need another structure (in-place state, fused KDA gate,
absorbed MLA, grouped experts) are written here. Batch <= 16 (the grouped expert kernel), bf16.
"""

from __future__ import annotations

import math
import types

import torch
from torch import Tensor

from k3mk.bench import baseline_kernels as K
from k3mk.compiler.config import ModelConfig, MLAConfig
from k3mk.compiler.ops import k3mk
from k3mk.compiler.reference import DecodeStep
from k3mk.ir.fused import _kv_b_heads


def _bmm_fp32(a: Tensor, b: Tensor) -> Tensor:
    """a @ b (batched) of bf16 operands with fp32 accumulation AND fp32 output (exact products); on the
    CPU (tests) through fp32 copies."""
    if a.is_cuda and a.dtype != torch.float32:
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a.float(), b.float())


def linear(x: Tensor, weight: Tensor, fp32: bool = False) -> Tensor:
    """semantics.linear; the fp32 form (router logits) without converting the bf16 weight each step."""
    if fp32 and x.is_cuda and x.dtype != torch.float32:
        return torch.mm(x, weight.T, out_dtype=torch.float32)
    return k3mk.linear(x, weight, fp32)


class _FastOps:
    """The reference's op namespace (torch.ops.k3mk) with the baseline's kernels for the generic ops the
    reused reference methods call; every other op is the reference's own."""

    linear = staticmethod(linear)
    rmsnorm = staticmethod(K.rmsnorm)
    attn_res = staticmethod(K.attn_res)

    @staticmethod
    def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
        return K.act_mul(gate, up, "silu")

    @staticmethod
    def situ_mul(gate: Tensor, up: Tensor, beta: float, linear_beta: float | None) -> Tensor:
        return K.act_mul(gate, up, "situ", beta, linear_beta)

    def __getattr__(self, name: str):
        return getattr(k3mk, name)


FAST = _FastOps()


def _with_fast_ops(method):
    """A DecodeStep method whose global `k3mk` is FAST: the reference's own code, other kernels."""
    fn = types.FunctionType(method.__code__, {**method.__globals__, "k3mk": FAST}, method.__name__, method.__defaults__, method.__closure__)
    fn.__kwdefaults__, fn.__qualname__ = method.__kwdefaults__, method.__qualname__
    return fn


# --- the replaced hot ops ----------------------------------------------------------------------------


def kda_recurrence_(q: Tensor, k: Tensor, v: Tensor, f: Tensor, beta_logits: Tensor, a_log: Tensor, dt_bias: Tensor, state: Tensor,
                    lower_bound: float | None) -> Tensor:  # fmt: skip
    """semantics.kda_gate + kda_recurrence as fla's fused recurrent KDA kernel: raw decay input f [B, P]
    (+ dt_bias, the gate form chosen by lower_bound, spec 3.2), raw beta logits [B, H]; the state
    [B, H, V, K] fp32 (V-major: fla's state_v_first) is updated IN PLACE. Returns o [B, P].

    Through fla's forward function, not its public fused_recurrent_kda, which always allocates and
    writes a new final state: serving engines update the state in place, as here."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    batch, heads, _, head_dim = state.shape
    tokens = (batch, 1, heads, head_dim)  # fla's [B, T, H, D] with T = 1
    o, _ = fused_recurrent_kda_fwd(
        q.view(tokens), k.view(tokens), v.view(tokens), f.view(tokens), beta_logits.view(batch, 1, heads), A_log=a_log, dt_bias=dt_bias,
        initial_state=state, inplace_final_state=True, state_v_first=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, lower_bound=lower_bound,
    )  # fmt: skip
    return o.view(batch, heads * head_dim)


def gated_rmsnorm(x: Tensor, gate: Tensor, weight: Tensor, head_dim: int, eps: float) -> Tensor:
    """semantics.gated_rmsnorm as fla's fused norm-gate kernel (fp32 inside, one rounding)."""
    from fla.modules.norm.fused_norm_gate import rms_norm_gated

    y = rms_norm_gated(x.view(-1, head_dim), gate.view(-1, head_dim), weight, None, activation="sigmoid", eps=eps)
    return y.view(x.shape)


def mla_cache_write_(cache: Tensor, c: Tensor, norm_weight: Tensor, positions: Tensor, m: MLAConfig) -> None:
    """semantics.mla_latent + mla_cache_write, writing only each request's new row (in place)."""
    row = torch.cat([K.rmsnorm(c[:, : m.kv_lora_rank], norm_weight, m.latent_norm_eps), c[:, m.kv_lora_rank :]], dim=-1)
    requests = torch.arange(c.shape[0], device=c.device)
    cache.index_put_((requests, positions.long()), row.to(cache.dtype))


def mla_attention_absorbed(q: Tensor, cache: Tensor, positions: Tensor, kv_b: Tensor, m: MLAConfig, window: int | None = None) -> Tensor:
    """semantics.mla_attention in the weight-absorbed form (spec 4.3) over cache rows [0, window) (all
    rows when None), request b attending to rows <= positions[b] < window: q_nope W_UK per head
    (rounded to bf16, as fused.mla_q_absorb), fp32 scores and softmax over the 576-wide latent rows,
    p (bf16) times the first kv_lora_rank columns, then W_UV per head. Returns o [B, H * v]. Rows past a
    request's position get p = 0, so they must hold finite values (a zeroed or random cache does)."""
    batch, heads = q.shape[0], m.num_heads
    rows = cache.shape[1] if window is None else window
    qh = q.view(batch, heads, m.qk_head_dim)
    w_uk, w_uv = _kv_b_heads(kv_b, heads, m.qk_nope_head_dim, m.v_head_dim)  # views of kv_b: [H, nope, rank], [H, v, rank]
    q_latent = torch.bmm(qh[..., : m.qk_nope_head_dim].transpose(0, 1), w_uk)  # [H, B, rank]
    query = torch.cat([q_latent.transpose(0, 1), qh[..., m.qk_nope_head_dim :]], dim=-1)  # [B, H, rank + rope]
    kv = cache[:, :rows]  # [B, T, rank + rope]: ONE shared latent head, its first `rank` columns the value
    scores = _bmm_fp32(query, kv.transpose(1, 2)) * m.qk_head_dim**-0.5  # [B, H, T]
    valid = torch.arange(rows, device=cache.device).view(1, 1, rows) <= positions.view(batch, 1, 1)
    p = torch.softmax(scores.masked_fill(~valid, -math.inf), dim=-1).to(q.dtype)
    o_latent = torch.bmm(p, kv[..., : m.kv_lora_rank])  # [B, H, rank]
    o = torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2))  # [H, B, v]
    return o.transpose(0, 1).reshape(batch, heads * m.v_head_dim)


# --- the step ----------------------------------------------------------------------------------------


class BaselineStep(DecodeStep):
    """forward(token_ids, positions, state) like DecodeStep, but the state is updated IN PLACE (the
    returned dict holds the same tensors) and the MLA attends over the first `attention_window` cache
    rows only (None: all; positions must stay below it). `routed_ids[layer]` holds each MoE layer's
    latest router ids (graph-owned tensors after capture: re-filled by every replay)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu"):
        super().__init__(config, dtype, device)
        self.attention_window: int | None = None
        self.routed_ids: dict[int, Tensor] = {}

    forward = _with_fast_ops(DecodeStep.forward)
    _layer_parts = _with_fast_ops(DecodeStep._layer_parts)
    _mix = _with_fast_ops(DecodeStep._mix)
    _act_mul = _with_fast_ops(DecodeStep._act_mul)

    def _kda(self, i: int, x: Tensor, state: dict[str, Tensor], new: dict[str, Tensor]) -> Tensor:
        c, p = self.config.kda, f"model.layers.{i}.self_attn"
        w = lambda n: self.w(f"{p}.{n}")  # noqa: E731
        q, k, v = (linear(x, w(f"{n}_proj.weight")) for n in ("q", "k", "v"))
        conv, recurrent = state[f"layers.{i}.conv_state"], state[f"layers.{i}.recurrent_state"]
        q, k, v = K.kda_conv_(q, k, v, conv, w("q_conv1d.weight"), w("k_conv1d.weight"), w("v_conv1d.weight"))
        f = linear(linear(x, w("f_a_proj.weight")), w("f_b_proj.weight"))
        beta = linear(x, w("b_proj.weight"))
        o = kda_recurrence_(q, k, v, f, beta, w("A_log"), w("dt_bias"), recurrent, c.gate_lower_bound)
        new[f"layers.{i}.conv_state"], new[f"layers.{i}.recurrent_state"] = conv, recurrent
        if c.full_rank_output_gate:
            gate = linear(x, w("g_proj.weight"))
        else:
            gate = linear(linear(x, w("g_a_proj.weight")), w("g_b_proj.weight"))
        return linear(gated_rmsnorm(o, gate, w("o_norm.weight"), c.head_dim, self.config.rms_norm_eps), w("o_proj.weight"))

    def _mla(self, i: int, x: Tensor, positions: Tensor, state: dict[str, Tensor], new: dict[str, Tensor]) -> Tensor:
        m, p = self.config.mla, f"model.layers.{i}.self_attn"
        w = lambda n: self.w(f"{p}.{n}")  # noqa: E731
        if m.q_lora_rank:
            q = linear(K.rmsnorm(linear(x, w("q_a_proj.weight")), w("q_a_layernorm.weight"), m.latent_norm_eps), w("q_b_proj.weight"))
        else:
            q = linear(x, w("q_proj.weight"))
        cache = state[f"layers.{i}.kv_cache"]
        mla_cache_write_(cache, linear(x, w("kv_a_proj_with_mqa.weight")), w("kv_a_layernorm.weight"), positions, m)
        new[f"layers.{i}.kv_cache"] = cache
        o = mla_attention_absorbed(q, cache, positions, w("kv_b_proj.weight"), m, self.attention_window)
        if m.output_gate:
            o = k3mk.sigmoid_gate(o, linear(x, w("g_proj.weight")))
        return linear(o, w("o_proj.weight"))

    def _expert_weights(self, prefix: str, proj: str) -> tuple[Tensor, Tensor | None]:
        base = f"{prefix}.experts.{proj}"
        if self.config.moe.expert_format == "mxfp4":
            return self.w(f"{base}.weight_packed"), self.w(f"{base}.weight_scale")
        return self.w(f"{base}.weight"), None

    def _moe(self, i: int, x: Tensor) -> Tensor:
        c, moe, p = self.config, self.config.moe, f"model.layers.{i}.block_sparse_moe"
        logits = linear(x, self.w(f"{p}.gate.weight"), True)
        ids, weights = K.router_topk(logits, self.w(f"{p}.gate.e_score_correction_bias"), moe.top_k, moe.renormalize, moe.routed_scaling_factor)
        self.routed_ids[i] = ids
        z = linear(x, self.w(f"{p}.routed_expert_down_proj.weight")) if moe.latent_size else x
        groups = K.group_by_expert(ids)
        a = K.expert_gemv(z, groups, moe.top_k, *self._expert_weights(p, "w1"), *self._expert_weights(p, "w3"), c.activation,
                          c.situ_beta, c.situ_linear_beta)  # fmt: skip
        y = K.expert_gemv(a, groups, moe.top_k, *self._expert_weights(p, "w2"))
        y = K.moe_combine(y.view(x.shape[0], moe.top_k, -1), weights)
        if moe.latent_size:
            if moe.latent_norm:
                y = K.rmsnorm(y, self.w(f"{p}.routed_expert_norm.weight"), c.rms_norm_eps)
            y = linear(y, self.w(f"{p}.routed_expert_up_proj.weight"))
        if moe.num_shared_experts:
            y = k3mk.add(y, self._mlp(f"{p}.shared_experts", x))
        return y


def build_baseline_step(config: ModelConfig, weights: dict[str, Tensor], dtype: torch.dtype = torch.bfloat16) -> BaselineStep:
    """A BaselineStep holding `weights` themselves (on their device), without a copy (as
    compiler/generate.build_decode_step does for the reference)."""
    step = BaselineStep(config, dtype=dtype, device="meta")
    step.load_state_dict(weights, strict=True, assign=True)
    return step
