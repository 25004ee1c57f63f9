"""The reference decode step (compiler/reference.py) against independent float64 formulations of the spec.

Everything below named `*_full` is written from docs/kimi_k3_decode_spec.md alone and works on WHOLE
sequences [B, T, ...] at once: the short conv is a window over the left-padded sequence, KDA is the "attention"
form of the delta rule built from the per-step transition matrices A_t = Diag(alpha_t)(I - beta_t k_t k_t^T)
(plus a dense-matrix form of the state), MLA is causal softmax attention over all T tokens with keys and
values up-projected from the latent, MoE runs every expert on every token and combines with a dense
routing matrix, and block attention residuals are addressed by group index (b_n = sum of the layers in
[(n-1)S, nS)) instead of the step's prefix-reset bookkeeping. None of it calls k3mk.ir.semantics.

DecodeStep is then run token by token in float32 (state threaded through, latent cache rows written one
at a time, junk in the unwritten cache rows to prove the position mask) and compared per logit.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from k3mk.compiler.config import ModelConfig, load_config
from k3mk.compiler.ops import k3mk
from k3mk.compiler.reference import DecodeStep
from k3mk.compiler.weights import weight_specs

F64 = torch.float64
LATENT_NORM_EPS = 1e-6  # spec 4.2 / 9: q_a_layernorm and kv_a_layernorm (reference class default)
L2_EPS = 1e-6  # spec 3.2: inside the sqrt of the q/k L2 norm

try:  # the shared initializer (another helper's); fall back to a local one until it exists
    from k3mk.compiler.random_weights import random_weights as _shared_random_weights
except ImportError:  # pragma: no cover - depends on the tree's state
    _shared_random_weights = None


# ---------------------------------------------------------------------------------------------------
# configs and weights


def k3_tiny() -> ModelConfig:
    return load_config("k3-tiny")


def _local_random_weights(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """normal/sqrt(fan_in) matrices, gains near 1, MXFP4 codes uniform with scales giving ~1/sqrt(fan_in)
    rms, KDA gate parameters that keep the per-step decay moderate (memory over several tokens)."""
    gen = torch.Generator().manual_seed(seed)
    randn = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float32)  # noqa: E731
    out: dict[str, torch.Tensor] = {}
    for spec in weight_specs(config):
        name, shape = spec.name, spec.shape
        leaf = name.rsplit(".", 1)[-1]
        if spec.dtype == "uint8":
            if leaf == "weight_packed":
                out[name] = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
            else:  # UE8M0 scale: E2M1 codes have rms ~2.93, aim for rms 1/sqrt(fan_in) (fan_in = 32 * groups)
                fan_in = shape[-1] * config.moe.mxfp4_group_size
                e = round(math.log2(1.0 / (2.93 * math.sqrt(fan_in))))
                out[name] = (127 + e + torch.randint(-1, 2, shape, generator=gen)).to(torch.uint8)
        elif name == "model.embed_tokens.weight":
            out[name] = randn(*shape)
        elif leaf == "A_log":
            out[name] = torch.empty(shape).uniform_(math.log(0.5), math.log(2.0), generator=gen)
        elif leaf == "dt_bias":
            out[name] = -3.0 + 0.5 * randn(*shape)
        elif leaf == "e_score_correction_bias":
            out[name] = 0.1 * randn(*shape)
        elif "conv1d" in name:
            out[name] = 0.5 * randn(*shape)
        elif len(shape) == 1:  # RMSNorm / AttnRes gains
            out[name] = 1.0 + 0.1 * randn(*shape)
        elif name.endswith("_res_proj.weight"):
            out[name] = 2.0 * randn(*shape) / math.sqrt(shape[-1])
        else:
            out[name] = randn(*shape) / math.sqrt(shape[-1])
    return out


SEED = 1234
_WEIGHTS_CACHE: dict[tuple, dict[str, torch.Tensor]] = {}


def make_weights(config: ModelConfig, source: str = "shared") -> dict[str, torch.Tensor]:
    """Random weights, generated once per (weight table, source) and shared by the tests (read only).

    "shared": compiler/random_weights.py (bf16-exact values, routing with wide margins by construction,
    small correction bias); "continuous": the local initializer (continuous router scores and a 0.1-std
    correction bias, so the bias changes many selections and margins are data-dependent)."""
    if source == "shared" and _shared_random_weights is None:
        source = "continuous"
    key = (source, tuple((s.name, s.shape, s.dtype) for s in weight_specs(config)))
    if key not in _WEIGHTS_CACHE:
        if source == "shared":
            _WEIGHTS_CACHE[key] = _shared_random_weights(config, SEED, torch.float32, "cpu")
        else:
            _WEIGHTS_CACHE[key] = _local_random_weights(config, SEED)
    return _WEIGHTS_CACHE[key]


def make_step(config: ModelConfig, weights: dict[str, torch.Tensor]) -> DecodeStep:
    step = DecodeStep(config, torch.float32)
    step.load_state_dict(weights)
    return step


def dequant_mxfp4_full(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E2M1 decoded from its bit fields (sign | 2-bit exponent, bias 1 | 1-bit mantissa; exponent 0 is
    subnormal 0.5*m), low nibble = even input index, UE8M0 scale 2^(s-127) per 32 inputs (spec 5.5)."""
    c = torch.arange(16)
    sign = 1.0 - 2.0 * (c // 8).to(F64)
    e, m = ((c // 2) % 4).to(F64), (c % 2).to(F64)
    value = sign * torch.where(e == 0, 0.5 * m, torch.pow(2.0, e - 1) * (1.0 + 0.5 * m))  # per 4-bit code
    p = packed.long()
    vals = value[torch.stack([p % 16, p // 16], dim=-1)].reshape(*p.shape[:-1], -1, 32)  # [..., groups, 32]
    return (vals * torch.pow(2.0, scale.to(F64) - 127.0)[..., None]).flatten(-2)


_F64_CACHE: dict[int, dict[str, torch.Tensor]] = {}


def weights_f64(config: ModelConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """float64 copies, MXFP4 experts dequantized to `<base>.weight` [E, out, in] (cached per weights dict)."""
    if id(weights) not in _F64_CACHE or _F64_CACHE[id(weights)]["__source__"] is not weights:
        _F64_CACHE[id(weights)] = {"__source__": weights, **_weights_f64(weights)}
    return _F64_CACHE[id(weights)]


def _weights_f64(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {n: t.to(F64) for n, t in weights.items() if t.dtype != torch.uint8}
    for n, t in weights.items():
        if n.endswith(".weight_packed"):
            base = n[: -len(".weight_packed")]
            out[f"{base}.weight"] = dequant_mxfp4_full(t, weights[f"{base}.weight_scale"])
    return out


# ---------------------------------------------------------------------------------------------------
# independent float64 full-sequence model (spec sections 2-7)


def rms_full(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


def kda_full(W, p: str, config: ModelConfig, x: torch.Tensor, with_state: bool = False):
    """KDA over a whole sequence x [B, T, d] (the normalized layer input). Returns out [B, T, d] and, when
    asked, (final recurrent state [B, H, V, K], final conv inputs [B, W-1, 3P])."""
    k = config.kda
    H, D, Wc = k.num_heads, k.head_dim, k.conv_size
    B, T, _ = x.shape

    def conv(z, w):  # causal depthwise conv over time: out[t] = sum_j w[:, 0, j] * z[t - (W-1) + j]
        windows = F.pad(z, (0, 0, Wc - 1, 0)).unfold(1, Wc, 1)  # [B, T, P, W], zero history before t=0
        return F.silu((windows * w[:, 0, :]).sum(-1))

    raw = {n: x @ W[f"{p}.{n}_proj.weight"].T for n in "qkv"}
    q, kk, v = (conv(raw[n], W[f"{p}.{n}_conv1d.weight"]).reshape(B, T, H, D) for n in "qkv")
    f = (x @ W[f"{p}.f_a_proj.weight"].T) @ W[f"{p}.f_b_proj.weight"].T + W[f"{p}.dt_bias"]
    f = f.reshape(B, T, H, D)
    a = W[f"{p}.A_log"].exp().reshape(H, 1)  # one A per head (spec 13 q3: the majority reading)
    if k.gate_lower_bound is not None:
        g = k.gate_lower_bound * torch.sigmoid(a * f)
    else:
        g = -a * F.softplus(f)
    alpha = g.exp()  # [B, T, H, K]
    beta = torch.sigmoid(x @ W[f"{p}.b_proj.weight"].T)  # [B, T, H]
    qn = q / torch.sqrt(q.pow(2).sum(-1, keepdim=True) + L2_EPS) * D**-0.5
    kn = kk / torch.sqrt(kk.pow(2).sum(-1, keepdim=True) + L2_EPS)

    # o_t = S_t q_t with S_t = sum_s beta_s v_s k_s^T A_{s+1} ... A_t: walk the query backwards through
    # the transition matrices, never forming a state.
    o = torch.zeros(B, T, H, D, dtype=F64)
    for t in range(T):
        w = qn[:, t]
        for s in range(t, -1, -1):
            c = (kn[:, s] * w).sum(-1)  # k_s . (A_{s+1}..A_t q_t)   [B, H]
            o[:, t] += (beta[:, s] * c)[..., None] * v[:, s]
            w = alpha[:, s] * (w - (beta[:, s] * c)[..., None] * kn[:, s])  # A_s w
    if k.full_rank_output_gate:
        gate = x @ W[f"{p}.g_proj.weight"].T
    else:
        gate = (x @ W[f"{p}.g_a_proj.weight"].T) @ W[f"{p}.g_b_proj.weight"].T
    on = rms_full(o, W[f"{p}.o_norm.weight"], config.rms_norm_eps) * torch.sigmoid(gate.reshape(B, T, H, D))
    out = on.reshape(B, T, H * D) @ W[f"{p}.o_proj.weight"].T
    if not with_state:
        return out
    # the final state as a product of dense K x K transition matrices: S <- S A_t + beta_t v_t k_t^T
    eye = torch.eye(D, dtype=F64)
    S = torch.zeros(B, H, D, D, dtype=F64)
    for t in range(T):
        A = alpha[:, t, :, :, None] * (eye - beta[:, t, :, None, None] * kn[:, t, :, :, None] * kn[:, t, :, None, :])
        S = S @ A + beta[:, t, :, None, None] * v[:, t, :, :, None] * kn[:, t, :, None, :]
    conv_in = torch.cat([raw["q"], raw["k"], raw["v"]], -1)
    conv_in = F.pad(conv_in.transpose(1, 2), (Wc - 1, 0)).transpose(1, 2)[:, -(Wc - 1) :]
    return out, (S, conv_in)


def mla_full(W, p: str, config: ModelConfig, x: torch.Tensor) -> torch.Tensor:
    """Causal NoPE MLA over a whole sequence, keys/values up-projected from the latent (spec 4.2)."""
    m = config.mla
    B, T, _ = x.shape
    H, nope, rope, vd, R = m.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
    if m.q_lora_rank:
        q = rms_full(x @ W[f"{p}.q_a_proj.weight"].T, W[f"{p}.q_a_layernorm.weight"], LATENT_NORM_EPS)
        q = q @ W[f"{p}.q_b_proj.weight"].T
    else:
        q = x @ W[f"{p}.q_proj.weight"].T
    q = q.reshape(B, T, H, nope + rope)
    c = x @ W[f"{p}.kv_a_proj_with_mqa.weight"].T
    c_kv = rms_full(c[..., :R], W[f"{p}.kv_a_layernorm.weight"], LATENT_NORM_EPS)
    k_pe = c[..., R:]  # one shared, never rotated, never normalized "rope" head
    kv = (c_kv @ W[f"{p}.kv_b_proj.weight"].T).reshape(B, T, H, nope + vd)
    key = torch.cat([kv[..., :nope], k_pe[:, :, None, :].expand(B, T, H, rope)], -1)
    scores = torch.einsum("bthd,bshd->bhts", q, key) * (nope + rope) ** -0.5
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    prob = torch.softmax(scores.masked_fill(future, -math.inf), -1)
    o = torch.einsum("bhts,bshd->bthd", prob, kv[..., nope:]).reshape(B, T, H * vd)
    if m.output_gate:
        o = o * torch.sigmoid(x @ W[f"{p}.g_proj.weight"].T)
    return o @ W[f"{p}.o_proj.weight"].T


def act_full(config: ModelConfig, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    if config.activation == "situ":  # spec 5.1, beta 4, linear beta 25
        a = config.situ_beta * torch.tanh(g / config.situ_beta) * torch.sigmoid(g)
        if config.situ_linear_beta is not None:
            u = config.situ_linear_beta * torch.tanh(u / config.situ_linear_beta)
        return a * u
    return F.silu(g) * u


def mlp_full(W, p: str, config: ModelConfig, x: torch.Tensor) -> torch.Tensor:
    h = act_full(config, x @ W[f"{p}.gate_proj.weight"].T, x @ W[f"{p}.up_proj.weight"].T)
    return h @ W[f"{p}.down_proj.weight"].T


class RoutingLog:
    """Per routing decision: the float64 margin between the k-th and (k+1)-th biased score (flips between
    float32 and float64 need margins ~1e-6), and whether the bias changed the chosen set."""

    def __init__(self):
        self.margins: list[torch.Tensor] = []
        self.bias_changed = 0
        self.decisions = 0


def moe_full(W, p: str, config: ModelConfig, x: torch.Tensor, log: RoutingLog | None = None) -> torch.Tensor:
    moe = config.moe
    s = torch.sigmoid(x @ W[f"{p}.gate.weight"].T)  # [B, T, E]
    sel = s + W[f"{p}.gate.e_score_correction_bias"]
    chosen = torch.zeros_like(s).scatter(-1, sel.topk(moe.top_k, -1).indices, 1.0)
    weight = s * chosen
    if moe.renormalize:
        weight = weight / (weight.sum(-1, keepdim=True) + 1e-20)
    weight = weight * moe.routed_scaling_factor
    if log is not None:
        top = sel.sort(-1, descending=True).values
        log.margins.append((top[..., moe.top_k - 1] - top[..., moe.top_k]).flatten())
        unbiased = torch.zeros_like(s).scatter(-1, s.topk(moe.top_k, -1).indices, 1.0)
        log.bias_changed += int((unbiased != chosen).any(-1).sum())
        log.decisions += s.shape[0] * s.shape[1]
    z = x @ W[f"{p}.routed_expert_down_proj.weight"].T if moe.latent_size else x
    # every expert on every token, then a dense combine with the (mostly zero) routing matrix
    h = act_full(
        config,
        torch.einsum("bti,eoi->bteo", z, W[f"{p}.experts.w1.weight"]),
        torch.einsum("bti,eoi->bteo", z, W[f"{p}.experts.w3.weight"]),
    )
    y = torch.einsum("bte,bteo->bto", weight, torch.einsum("btei,eoi->bteo", h, W[f"{p}.experts.w2.weight"]))
    if moe.latent_size:
        if moe.latent_norm:
            y = rms_full(y, W[f"{p}.routed_expert_norm.weight"], config.rms_norm_eps)
        y = y @ W[f"{p}.routed_expert_up_proj.weight"].T
    if moe.num_shared_experts:
        y = y + mlp_full(W, f"{p}.shared_experts", config, x)
    return y


def attn_res_full(sources: list[torch.Tensor], norm_w: torch.Tensor, proj_w: torch.Tensor, eps: float) -> torch.Tensor:
    V = torch.stack(sources, -2)  # [B, T, n, d]
    logits = (rms_full(V, None, eps) * norm_w * proj_w.reshape(-1)).sum(-1)
    return (torch.softmax(logits, -1)[..., None] * V).sum(-2)


def block_sources(x0: torch.Tensor, contributions: list[tuple[int, torch.Tensor]], block: int) -> list[torch.Tensor]:
    """Spec 2 addressed by group: b_0 = x0, b_n = sum of the outputs (attention and FFN) of layers
    [(n-1)*block, n*block) computed so far; the last group may be partial."""
    groups: dict[int, torch.Tensor] = {}
    for layer, out in contributions:
        n = layer // block + 1
        groups[n] = groups[n] + out if n in groups else out
    return [x0] + [groups[n] for n in sorted(groups)]


def model_full(W, config: ModelConfig, ids: torch.Tensor, log: RoutingLog | None = None, trace: list | None = None):
    """Logits [B, T, vocab] of the whole model over token ids [B, T]. `trace` (optional) receives the
    number of sources of every attention-residual mix, in order."""
    eps = config.rms_norm_eps
    x0 = W["model.embed_tokens.weight"][ids]

    def mixer(i, h):
        x = rms_full(h, W[f"model.layers.{i}.input_layernorm.weight"], eps)
        p = f"model.layers.{i}.self_attn"
        return kda_full(W, p, config, x) if config.layer_kinds[i] == "kda" else mla_full(W, p, config, x)

    def ffn(i, h):
        x = rms_full(h, W[f"model.layers.{i}.post_attention_layernorm.weight"], eps)
        if config.is_moe_layer(i):
            return moe_full(W, f"model.layers.{i}.block_sparse_moe", config, x, log)
        return mlp_full(W, f"model.layers.{i}.mlp", config, x)

    if config.attn_res_block_size is None:
        h = x0
        for i in range(config.num_layers):
            h = h + mixer(i, h)
            h = h + ffn(i, h)
    else:
        S, contrib = config.attn_res_block_size, []

        def mix(name, count=True):
            src = block_sources(x0, contrib, S)
            if trace is not None and count:
                trace.append(len(src))
            return attn_res_full(src, W[f"{name}_res_norm.weight"], W[f"{name}_res_proj.weight"], eps)

        for i in range(config.num_layers):
            # a mix over the lone embedding is the identity; the step skips it (no sources to count)
            contrib.append((i, mixer(i, mix(f"model.layers.{i}.self_attention", count=i > 0))))
            contrib.append((i, ffn(i, mix(f"model.layers.{i}.mlp"))))
        h = mix("model.output_attn")
    return rms_full(h, W["model.norm.weight"], eps) @ W["lm_head.weight"].T


# ---------------------------------------------------------------------------------------------------
# driving DecodeStep token by token


def junk_state(step: DecodeStep, batch: int, max_context: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Empty requests: zero KDA state, but random junk in every latent-cache row (rows at or past a
    request's position must never be read before they are written)."""
    state = step.new_state(batch, max_context)
    for name, t in state.items():
        if name.endswith("kv_cache"):
            t.copy_(torch.randn(t.shape, generator=gen) * 3.0)
    return state


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.to(F64) - b.to(F64)).norm() / b.to(F64).norm())


def decode_ragged(step: DecodeStep, ids0: torch.Tensor, ids1: torch.Tensor, max_context: int, seed: int):
    """Request 1 has `lead = len(ids1) - len(ids0)` more prompt tokens: it runs alone for those, then both
    run together at different positions. Returns the per-token logits of each request."""
    gen = torch.Generator().manual_seed(seed)
    lead = len(ids1) - len(ids0)
    logits0, logits1 = [], []
    st1 = junk_state(step, 1, max_context, gen)
    for t in range(lead):
        lg, st1 = step(ids1[t : t + 1], torch.tensor([t]), st1)
        logits1.append(lg[0])
    st0 = junk_state(step, 1, max_context, gen)
    state = {n: torch.cat([st0[n], st1[n]], 0) for n in st0}
    for t in range(len(ids0)):
        lg, state = step(torch.stack([ids0[t], ids1[t + lead]]), torch.tensor([t, t + lead]), state)
        logits0.append(lg[0])
        logits1.append(lg[1])
    return torch.stack(logits0), torch.stack(logits1)


def check_whole_model(config: ModelConfig, source: str, seed: int, t0: int, lead: int):
    weights = make_weights(config, source)
    step = make_step(config, weights)
    W = weights_f64(config, weights)
    gen = torch.Generator().manual_seed(seed + 1)
    ids0 = torch.randint(0, config.vocab_size, (t0,), generator=gen)
    ids1 = torch.randint(0, config.vocab_size, (t0 + lead,), generator=gen)
    with torch.no_grad():
        got0, got1 = decode_ragged(step, ids0, ids1, max_context=t0 + lead + 3, seed=seed + 2)
    log = RoutingLog()
    ref0 = model_full(W, config, ids0[None], log)[0]
    ref1 = model_full(W, config, ids1[None], log)[0]
    margins = torch.cat(log.margins)
    return {
        "rel0": rel(got0, ref0),
        "rel1": rel(got1, ref1),
        "worst_token": max(rel(g, r) for g, r in zip(list(got0) + list(got1), list(ref0) + list(ref1))),
        "min_margin": float(margins.min()),
        "bias_changed": log.bias_changed,
        "decisions": log.decisions,
        "argmax_agree": bool((got0.argmax(-1) == ref0.argmax(-1)).all() and (got1.argmax(-1) == ref1.argmax(-1)).all()),
    }


# ---------------------------------------------------------------------------------------------------
# whole model


@pytest.mark.parametrize("source", ["shared", "continuous"])
@pytest.mark.parametrize("make_config", [k3_tiny, lambda: load_config("kimi-linear-tiny")], ids=["k3-tiny", "kimi-linear-small"])
def test_whole_model_decode_matches_full_sequence_float64(make_config, source):
    """DecodeStep (float32, step by step, batch 2, different prompts AND positions) equals the float64
    full-sequence model. k3-tiny: 8 layers, KDA/MLA, block 3 (blocks close at layers 0, 3, 6 and the final
    mix sees 4 sources), MXFP4 experts; Kimi-Linear-shaped: classic residual, SwiGLU, scaled MoE.
    The "continuous" weights make the correction bias decide many selections."""
    config = make_config()
    # request 1: 11 tokens (3 alone, then 8 beside request 0); the continuous variant 7 (2 + 5)
    r = check_whole_model(config, source, seed=SEED, t0=8 if source == "shared" else 5, lead=3 if source == "shared" else 2)
    # routing must be decided by float64-robust margins, otherwise float32 may legitimately flip an expert
    assert r["min_margin"] > 3e-6, f"router near-tie in the test weights: {r}"
    if source == "continuous":
        assert r["bias_changed"] > 0, f"the correction bias never changed a selection, the test is blind to it: {r}"
    assert r["rel0"] < 1e-4 and r["rel1"] < 1e-4 and r["worst_token"] < 1e-4, r
    assert r["argmax_agree"], r


def test_whole_model_bfloat16_runs_close():
    """Dtype plumbing: the bf16 step runs end to end (every op accepts the activation dtype, the KDA state
    stays fp32) and stays near the float64 model. Every expert is active (top_k = num_experts) so that no
    discrete routing decision can flip; measured 0.8 % relative error on the bf16-exact shared weights."""
    if _shared_random_weights is None:
        pytest.skip("needs compiler/random_weights.py (bf16-exact weights)")
    c = k3_tiny()
    config = c.replace(moe=dataclasses.replace(c.moe, top_k=c.moe.num_experts))
    weights = make_weights(config)
    step = DecodeStep(config, torch.bfloat16)
    step.load_state_dict(weights)  # load_state_dict casts into the registered buffer dtypes
    W = weights_f64(config, weights)
    ids = torch.randint(0, config.vocab_size, (2, 3), generator=torch.Generator().manual_seed(5))
    state = step.new_state(2, 6)
    got = []
    with torch.no_grad():
        for t in range(ids.shape[1]):
            lg, state = step(ids[:, t], torch.full((2,), t), state)
            assert lg.dtype == torch.bfloat16
            got.append(lg)
    got = torch.stack(got, 1)
    for name, spec_t in state.items():
        if name.endswith("recurrent_state"):
            assert spec_t.dtype == torch.float32, name  # the KDA state stays fp32 (spec 8, 9)
    ref = model_full(W, config, ids)
    assert torch.isfinite(got).all()
    assert rel(got, ref) < 0.05, rel(got, ref)
    assert F.cosine_similarity(got.to(F64), ref, dim=-1).min() > 0.99


# ---------------------------------------------------------------------------------------------------
# single layers, fed random normalized inputs directly


def _run_layer(step: DecodeStep, config: ModelConfig, layer: int, x: torch.Tensor, max_context: int, seed: int):
    """Drive one mixer of the step token by token: x [B, T, d]. Returns (outputs [B, T, d], final state)."""
    B, T, _ = x.shape
    state = junk_state(step, B, max_context, torch.Generator().manual_seed(seed))
    outs = []
    with torch.no_grad():
        for t in range(T):
            new: dict[str, torch.Tensor] = {}
            xt = x[:, t].to(torch.float32).contiguous()
            if config.layer_kinds[layer] == "kda":
                out = step._kda(layer, xt, state, new)
            else:
                out = step._mla(layer, xt, torch.full((B,), t), state, new)
            state = {**state, **new}
            outs.append(out)
    return torch.stack(outs, 1), state


@pytest.mark.parametrize("make_config", [k3_tiny, lambda: load_config("kimi-linear-tiny")], ids=["k3-tiny", "kimi-linear-small"])
def test_kda_layer_steps_equal_full_sequence(make_config):
    """KDA (spec 3.2): T=11 steps of the layer (conv state, fp32 [B,H,V,K] state, per-key-channel decay,
    delta rule, gated o_norm) equal the whole-sequence causal conv + transition-matrix formulation; the final
    recurrent state and conv state match too."""
    config = make_config()
    layer = config.layer_kinds.index("kda")
    weights = make_weights(config)
    step = make_step(config, weights)
    W = weights_f64(config, weights)
    B, T = 2, 11
    x = torch.randn(B, T, config.hidden_size, generator=torch.Generator().manual_seed(12), dtype=F64)
    x = rms_full(x, None, 0.0)  # the layer sees normalized inputs
    got, state = _run_layer(step, config, layer, x, 4, 13)
    ref, (S, conv_in) = kda_full(W, f"model.layers.{layer}.self_attn", config, x, with_state=True)
    assert rel(got, ref) < 1e-5, rel(got, ref)
    assert rel(state[f"layers.{layer}.recurrent_state"], S) < 1e-5  # [B, H, V, K], V-major
    assert rel(state[f"layers.{layer}.conv_state"], conv_in) < 1e-6  # last W-1 raw inputs, oldest first
    # the state must carry real memory: the last output with the first token's contribution removed differs
    x2 = x.clone()
    x2[:, 0] = rms_full(torch.randn(B, config.hidden_size, dtype=F64, generator=torch.Generator().manual_seed(3)), None, 0.0)
    ref2 = kda_full(W, f"model.layers.{layer}.self_attn", config, x2)
    assert rel(ref2[:, -1], ref[:, -1]) > 1e-3


def test_kda_full_sequence_forms_agree():
    """Self-check of the test's own KDA: the attention form (backward walk of A_t) and the dense
    state-matrix form give the same outputs o_t = S_t q_t, and the windowed conv equals F.conv1d."""
    config = k3_tiny()
    weights = weights_f64(config, make_weights(config))
    x = rms_full(torch.randn(1, 6, config.hidden_size, dtype=F64, generator=torch.Generator().manual_seed(2)), None, 0.0)
    p = "model.layers.0.self_attn"
    out_attention = kda_full(weights, p, config, x)
    # rebuild outputs from per-prefix states of the dense form
    outs = []
    for t in range(1, 7):
        _, (S, _) = kda_full(weights, p, config, x[:, :t], with_state=True)
        k = config.kda
        q = x[:, :t] @ weights[f"{p}.q_proj.weight"].T
        qc = F.silu(F.conv1d(F.pad(q.transpose(1, 2), (k.conv_size - 1, 0)), weights[f"{p}.q_conv1d.weight"], groups=q.shape[-1]))
        qt = qc[:, :, -1].reshape(1, k.num_heads, k.head_dim)
        qt = qt / torch.sqrt(qt.pow(2).sum(-1, keepdim=True) + L2_EPS) * k.head_dim**-0.5
        o = (S @ qt[..., None])[..., 0]  # [1, H, V]
        gate = x[:, t - 1] @ weights[f"{p}.g_proj.weight"].T
        on = rms_full(o, weights[f"{p}.o_norm.weight"], config.rms_norm_eps) * torch.sigmoid(gate.reshape(1, k.num_heads, -1))
        outs.append(on.reshape(1, -1) @ weights[f"{p}.o_proj.weight"].T)
    assert rel(torch.stack(outs, 1), out_attention) < 1e-12


@pytest.mark.parametrize("make_config", [k3_tiny, lambda: load_config("kimi-linear-tiny")], ids=["k3-tiny", "kimi-linear-small"])
@pytest.mark.parametrize("scale", [1.0, 3e-3], ids=["unit", "tiny"])
def test_mla_layer_steps_equal_full_sequence(make_config, scale):
    """MLA (spec 4.2): T=9 decode steps (latent row written at its position, junk beyond it, masked by
    position) equal full causal attention with non-absorbed keys/values. The tiny input scale puts the
    latent norms' mean square near 1e-5, so it pins their eps at 1e-6 (spec 4.2 / open question 1)."""
    config = make_config()
    layer = config.layer_kinds.index("mla")
    weights = make_weights(config)
    step = make_step(config, weights)
    W = weights_f64(config, weights)
    B, T = 2, 9
    x = rms_full(torch.randn(B, T, config.hidden_size, generator=torch.Generator().manual_seed(32), dtype=F64), None, 0.0) * scale
    got, state = _run_layer(step, config, layer, x, T + 4, 33)
    ref = mla_full(W, f"model.layers.{layer}.self_attn", config, x)
    assert rel(got, ref) < 1e-5, rel(got, ref)
    # the cache rows 0..T-1 hold RMSNorm(c_kv) || k_pe; the rows after them are untouched junk
    m = config.mla
    c = x @ W[f"model.layers.{layer}.self_attn.kv_a_proj_with_mqa.weight"].T
    rows = torch.cat([rms_full(c[..., : m.kv_lora_rank], W[f"model.layers.{layer}.self_attn.kv_a_layernorm.weight"], LATENT_NORM_EPS), c[..., m.kv_lora_rank :]], -1)
    assert rel(state[f"layers.{layer}.kv_cache"][:, :T], rows) < 1e-6
    if scale < 1:  # with eps 1e-5 the normalized latent would differ by far more than the tolerance
        wrong = rms_full(c[..., : m.kv_lora_rank], W[f"model.layers.{layer}.self_attn.kv_a_layernorm.weight"], 1e-5)
        assert rel(wrong, rows[..., : m.kv_lora_rank]) > 1e-2


def test_mla_absorbed_form_agrees():
    """Spec 4.3: the weight-absorbed decode (q_nope @ W_UK against the 576-wide latent, W_UV after) equals
    the non-absorbed full-sequence form the step is checked against, so either is a valid GPU target."""
    config = k3_tiny()
    layer = config.layer_kinds.index("mla")
    W = weights_f64(config, make_weights(config))
    m, p = config.mla, f"model.layers.{layer}.self_attn"
    B, T = 2, 7
    x = rms_full(torch.randn(B, T, config.hidden_size, generator=torch.Generator().manual_seed(42), dtype=F64), None, 0.0)
    H, nope, rope, vd, R = m.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
    q = rms_full(x @ W[f"{p}.q_a_proj.weight"].T, W[f"{p}.q_a_layernorm.weight"], LATENT_NORM_EPS) @ W[f"{p}.q_b_proj.weight"].T
    q = q.reshape(B, T, H, nope + rope)
    c = x @ W[f"{p}.kv_a_proj_with_mqa.weight"].T
    latent = torch.cat([rms_full(c[..., :R], W[f"{p}.kv_a_layernorm.weight"], LATENT_NORM_EPS), c[..., R:]], -1)
    Wkv = W[f"{p}.kv_b_proj.weight"].reshape(H, nope + vd, R)
    q_lat = torch.einsum("bthd,hdc->bthc", q[..., :nope], Wkv[:, :nope])
    Q = torch.cat([q_lat, q[..., nope:]], -1)  # [B, T, H, R + rope]
    s = torch.einsum("bthc,bsc->bhts", Q, latent) * (nope + rope) ** -0.5
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
    o_lat = torch.einsum("bhts,bsc->bthc", torch.softmax(s, -1), latent[..., :R])
    o = torch.einsum("bthc,hdc->bthd", o_lat, Wkv[:, nope:]).reshape(B, T, H * vd)
    o = (o * torch.sigmoid(x @ W[f"{p}.g_proj.weight"].T)) @ W[f"{p}.o_proj.weight"].T
    assert rel(o, mla_full(W, p, config, x)) < 1e-12


# ---------------------------------------------------------------------------------------------------
# block attention residual bookkeeping


class RecordingStep(DecodeStep):
    """Records every attention-residual mix (its sources) and every sub-layer output, in order."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.mixes: list[tuple[str, list[torch.Tensor]]] = []
        self.outputs: list[tuple[int, torch.Tensor]] = []

    def _mix(self, prefix, sources):
        self.mixes.append((prefix, [s.clone() for s in sources]))
        return super()._mix(prefix, sources)

    def _layer_parts(self, i, positions, state, new):
        mixer, ffn = super()._layer_parts(i, positions, state, new)

        def rec(fn):
            def run(h):
                out = fn(h)
                self.outputs.append((i, out.clone()))
                return out

            return run

        return rec(mixer), rec(ffn)


def expected_mix_plan(num_layers: int, block: int) -> list[tuple[str, int]]:
    """(mix name, number of sources) in call order, from spec 2: blocks close at i % block == 0 (after the
    pre-attention mix), so sources = closed blocks + the running prefix."""
    plan, closed = [], 0
    for i in range(num_layers):
        if closed:
            plan.append((f"model.layers.{i}.self_attention", closed + 1))
        if i % block == 0:
            closed += 1
        plan.append((f"model.layers.{i}.mlp", closed + 1))
    plan.append(("model.output_attn", closed + 1))
    return plan


_RECORDING_STEPS: dict[str, RecordingStep] = {}


def recording_step(config: ModelConfig) -> RecordingStep:
    """One loaded k3-tiny RecordingStep, re-pointed at `config` (same weight table, other block size)."""
    if "k3-tiny" not in _RECORDING_STEPS:
        step = RecordingStep(config, torch.float32)
        step.load_state_dict(make_weights(config))
        _RECORDING_STEPS["k3-tiny"] = step
    step = _RECORDING_STEPS["k3-tiny"]
    step.config, step.mixes, step.outputs = config, [], []
    return step


@pytest.mark.parametrize("block", [1, 2, 3, 5, 8, 20])
def test_attn_res_bookkeeping(block):
    """Spec 2 / 6: which sources every mix sees. For each mix of one step, the count matches the spec
    plan and each source IS the right tensor: x0, then per closed group the sum of its layers' attention
    and FFN outputs, then the partial group (snapshotted pre-mix at a boundary, prefix reset after)."""
    config = k3_tiny().replace(attn_res_block_size=block)
    weights = make_weights(config)
    step = recording_step(config)
    ids = torch.tensor([7, 1000])
    with torch.no_grad():
        step(ids, torch.zeros(2, dtype=torch.long), step.new_state(2, 2))
    plan = expected_mix_plan(config.num_layers, block)
    assert [(n, len(s)) for n, s in step.mixes] == plan
    x0 = weights["model.embed_tokens.weight"][ids]
    done = 0
    for name, sources in step.mixes:
        # the sub-layer outputs available at this mix: all before it in program order
        layer = int(name.split(".")[2]) if name.startswith("model.layers") else config.num_layers
        kind = name.rsplit(".", 1)[-1]
        done = 2 * layer + (1 if kind == "mlp" else 0)
        expected = block_sources(x0.to(F64), [(i, o.to(F64)) for i, o in step.outputs[:done]], block)
        assert len(expected) == len(sources)
        for e, s in zip(expected, sources):
            assert rel(s, e) < 1e-6, name
    if block == 3:  # k3-tiny: the final mix sees x0, layers 0-2, layers 3-5 and the partial 6-7
        assert plan[-1] == ("model.output_attn", 4)


def test_attn_res_first_layer_skips_the_mix():
    """At layer 0 there are no closed blocks: the mixer input is x0 itself (no self_attention mix call),
    the block of x0 closes, and the FFN mix sees [x0, a_0]."""
    step = recording_step(k3_tiny())
    with torch.no_grad():
        step(torch.tensor([3]), torch.zeros(1, dtype=torch.long), step.new_state(1, 1))
    first = step.mixes[0]
    assert first[0] == "model.layers.0.mlp"
    x0 = step.w("model.embed_tokens.weight")[3:4]
    assert torch.equal(first[1][0], x0)
    assert torch.equal(first[1][1], step.outputs[0][1])


# ---------------------------------------------------------------------------------------------------
# router (spec 5.2)


def _router(logits, bias, k, renorm=True, scaling=1.0):
    return k3mk.router_topk(torch.as_tensor(logits, dtype=torch.float32), torch.as_tensor(bias, dtype=torch.float32), k, renorm, scaling)


def test_router_bias_selects_weights_from_unbiased_scores():
    s = torch.tensor([[0.90, 0.80, 0.70, 0.20, 0.10, 0.05]], dtype=F64)
    logits = torch.log(s / (1 - s))
    bias = [0.0, 0.0, 0.0, 0.75, 0.0, 0.0]  # lifts expert 3 (0.20 -> 0.95) above everyone
    ids, w = _router(logits, bias, 2)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    got = dict(zip(ids[0].tolist(), w[0].tolist()))
    assert set(got) == {0, 3}  # without the bias it would be {0, 1}
    assert got[3] == pytest.approx(0.20 / 1.10, rel=1e-6)  # weights from the pre-bias sigmoid
    assert got[0] == pytest.approx(0.90 / 1.10, rel=1e-6)
    ids_nb, _ = _router(logits, [0.0] * 6, 2)
    assert set(ids_nb[0].tolist()) == {0, 1}


def test_router_renormalize_and_scaling():
    gen = torch.Generator().manual_seed(71)
    logits = torch.randn(3, 16, generator=gen)
    bias = 0.1 * torch.randn(16, generator=gen)
    ids, w = _router(logits, bias, 4, True, 2.446)
    torch.testing.assert_close(w.sum(-1), torch.full((3,), 2.446), rtol=1e-6, atol=0)
    s = torch.sigmoid(logits.to(F64))
    expect = s.gather(1, ids.long()) / s.gather(1, ids.long()).sum(-1, keepdim=True) * 2.446
    torch.testing.assert_close(w.to(F64), expect, rtol=1e-6, atol=0)
    # selection = top-k of s + bias
    top = (s + bias.to(F64)).topk(4, -1).indices.sort(-1).values
    assert torch.equal(ids.long().sort(-1).values, top)
    # no renormalization: raw sigmoid scores, still scaled
    ids2, w2 = _router(logits, bias, 4, False, 2.446)
    torch.testing.assert_close(w2.to(F64), s.gather(1, ids2.long()) * 2.446, rtol=1e-6, atol=0)
    # all chosen scores exactly 0 (sigmoid underflow): the 1e-20 keeps the weights finite (zero)
    _, w3 = _router(torch.full((1, 8), -1000.0), torch.zeros(8), 2)
    assert torch.equal(w3, torch.zeros(1, 2))


def test_router_ties_go_to_lowest_index():
    """Our documented rule for spec open question 6: among equal biased scores, lower expert ids win."""
    logits = [[0.3, 1.0, 0.3, 1.0, 1.0, 0.3, 1.0]]
    ids, _ = _router(logits, [0.0] * 7, 3)
    assert sorted(ids[0].tolist()) == [1, 3, 4]
    ids, _ = _router(logits, [0.0] * 7, 5)
    assert sorted(ids[0].tolist()) == [0, 1, 3, 4, 6]
    # a tie made by the bias: experts 2 and 5 both reach exactly 1.5
    ids, _ = _router([[0.0] * 6], [0.0, 0.0, 1.0, 0.0, 0.0, 1.0], 1)
    assert ids[0].tolist() == [2]
