"""Checks of the baseline decode step's replacement ops (bench/baseline_kernels.py, bench/baseline.py)
against the reference (k3mk.ir.semantics, compiler/reference.py), on any device: the GPU tests
(test_baseline_gpu.py) call them at small and full width; the CPU test (test_baseline_cpu.py) runs
`small_cases("cpu")` under Triton's interpreter (TRITON_INTERPRET=1 must be set before Triton is
imported, hence a subprocess):

    TRITON_INTERPRET=1 python tests/bench/kernel_checks.py

Inputs are fresh random values (never zeros), drawn on the target device. Each check returns its
errors ||out - ref|| / ||ref|| (0 = equal) and asserts its tolerance. In float32 a kernel must equal the
reference up to summation order (the expert kernel's bf16 dot gets bf16-exact inputs, so its products
are exact too); in bfloat16 it rounds where the reference rounds, so only a rare fp32 summation-order
difference flips a bf16 rounding on the GPU (the interpreter truncates every rounding instead). The
layer checks run a whole baseline mixer / MoE against the reference's on tiny-config random weights.
"""

from __future__ import annotations

import json
import os

import torch

from k3mk.compiler.checkpoint import quantize_mxfp4
from k3mk.compiler.config import load_config
from k3mk.ir import semantics

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
F32_TOL = 1e-5
BF16_TOL = 3e-2 if INTERPRETED else 5e-3
LAYER_TOL = 3e-2  # a whole bf16 layer: roundings flipped early propagate (and the MLA is absorbed)


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        raise AssertionError("non-finite output")
    return float((out - ref).norm() / ref.norm())


def _tol(dtype: torch.dtype) -> float:
    return F32_TOL if dtype == torch.float32 else BF16_TOL


def _check(name: str, errors: dict[str, float], tol: float | dict[str, float]) -> dict[str, float]:
    for key, err in errors.items():
        limit = tol[key] if isinstance(tol, dict) else tol
        assert err <= limit, f"{name} {key}: error {err:.3g} > {limit:.3g}"
    return errors


def randn(gen: torch.Generator, *shape: int, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    """bf16-exact random values on gen's device (float32 and bfloat16 runs see the same numbers)."""
    return (torch.randn(shape, generator=gen, device=gen.device) * scale).to(torch.bfloat16).to(dtype)


# --- kernels -----------------------------------------------------------------------------------------


def check_rmsnorm(gen, dtype, rows=3, dim=520) -> dict[str, float]:
    from k3mk.bench import baseline_kernels as K

    x = randn(gen, rows, dim + 8, dtype=dtype, scale=3.0)[:, :dim]  # a strided view, like the MLA latent's c_kv
    w = randn(gen, dim, dtype=dtype) * 0.1 + 1
    return _check("rmsnorm", {"y": rel(K.rmsnorm(x, w, 1e-5), semantics.rmsnorm(x, w, 1e-5))}, _tol(dtype))


def check_act_mul(gen, dtype, shape=(3, 700)) -> dict[str, float]:
    from k3mk.bench import baseline_kernels as K

    g, u = (randn(gen, *shape, dtype=dtype, scale=8.0) for _ in range(2))  # past beta and linear_beta: tanh saturates
    errors = {
        "silu": rel(K.act_mul(g, u, "silu"), semantics.silu_mul(g, u)),
        "situ": rel(K.act_mul(g, u, "situ", 4.0, 5.0), semantics.situ_mul(g, u, 4.0, 5.0)),
        "situ_no_linear_beta": rel(K.act_mul(g, u, "situ", 4.0, None), semantics.situ_mul(g, u, 4.0, None)),
    }
    return _check("act_mul", errors, _tol(dtype))


def check_attn_res(gen, dtype, batch=2, sources=5, dim=600) -> dict[str, float]:
    from k3mk.bench import baseline_kernels as K

    srcs = [randn(gen, batch, dim, dtype=dtype, scale=1 + i) for i in range(sources)]
    nw = randn(gen, dim, dtype=dtype) * 0.1 + 1
    pw = randn(gen, 1, dim, dtype=dtype, scale=1.0 / dim**0.5)
    return _check("attn_res", {"y": rel(K.attn_res(srcs, nw, pw, 1e-5), semantics.attn_res(srcs, nw, pw, 1e-5))}, _tol(dtype))


def check_kda_conv(gen, dtype, batch=2, p=384, width=4) -> dict[str, float]:
    from k3mk.bench import baseline_kernels as K

    q, k, v = (randn(gen, batch, p, dtype=dtype) for _ in range(3))
    state = randn(gen, batch, width - 1, 3 * p, dtype=dtype)
    wq, wk, wv = (randn(gen, p, 1, width, scale=width**-0.5) for _ in range(3))
    ref = semantics.kda_conv(q, k, v, state, wq, wk, wv)
    got = K.kda_conv_(q, k, v, state, wq, wk, wv)  # shifts `state` in place
    errors = {n: rel(a, b) for n, a, b in zip("qkv", got, ref)} | {"state": rel(state, ref[3])}
    return _check("kda_conv", errors, {"q": _tol(dtype), "k": _tol(dtype), "v": _tol(dtype), "state": 0.0})


def check_router_topk(gen, batch=3, experts=40, top_k=6, renormalize=True, scaling=2.446) -> dict[str, float]:
    from k3mk.bench import baseline_kernels as K

    logits = randn(gen, batch, experts, scale=2.0)
    bias = randn(gen, experts, scale=0.1)
    logits[0, 7], bias[7] = logits[0, 3], bias[3]  # a tie: the lower index must win
    ids, weights = K.router_topk(logits, bias, top_k, renormalize, scaling)
    ref_ids, ref_weights = semantics.router_topk(logits, bias, top_k, renormalize, scaling)
    assert torch.equal(ids, ref_ids), f"router ids {ids.tolist()} != {ref_ids.tolist()}"
    return _check("router_topk", {"weights": rel(weights, ref_weights)}, F32_TOL)


def random_experts(gen, experts, out, inp, mxfp4: bool, dtype):
    """(kernel operands, the reference's dense weight) of random experts [E, out, inp]."""
    w = torch.randn(experts, out, inp, generator=gen, device=gen.device) / inp**0.5
    if mxfp4:
        packed, scale = quantize_mxfp4(w)
        return (packed, scale), semantics.dequant_mxfp4(packed, scale, dtype)
    w = w.to(torch.bfloat16).to(dtype)
    return (w, None), w


def _routing(gen, batch, experts, top_k) -> torch.Tensor:
    """ids [B, k], distinct per token; token 1 picks token 0's experts in another slot order (runs > 1)."""
    ids = torch.stack([torch.randperm(experts, generator=gen, device=gen.device)[:top_k] for _ in range(batch)])
    if batch > 1:
        ids[1] = ids[0].roll(1)
    return ids.to(torch.int32)


def check_experts(gen, dtype, batch=3, experts=6, top_k=3, inter=96, hidden=64, mxfp4=False, activation="situ") -> dict[str, float]:
    """expert_gemv gated (w1, w3 + activation), then plain (w2), then moe_combine, each stage fed the
    reference's previous output, against semantics.expert_linear(_mxfp4) + silu_mul / situ_mul + moe_combine."""
    from k3mk.bench import baseline_kernels as K

    x = randn(gen, batch, hidden, dtype=dtype)
    ids = _routing(gen, batch, experts, top_k)
    weights = torch.rand(batch, top_k, generator=gen, device=gen.device)
    (w1, s1), d1 = random_experts(gen, experts, inter, hidden, mxfp4, dtype)
    (w3, s3), d3 = random_experts(gen, experts, inter, hidden, mxfp4, dtype)
    (w2, s2), d2 = random_experts(gen, experts, hidden, inter, mxfp4, dtype)
    beta, linear_beta = (4.0, 25.0) if activation == "situ" else (1.0, None)
    act = (lambda g, u: semantics.situ_mul(g, u, beta, linear_beta)) if activation == "situ" else semantics.silu_mul
    a_ref = act(semantics.expert_linear(x, d1, ids), semantics.expert_linear(x, d3, ids))  # [B, k, I]
    a_in = a_ref.to(torch.bfloat16).to(dtype)  # the down projection's input, bf16-exact (module docstring)
    y_ref = semantics.expert_linear(a_in, d2, ids)
    groups = K.group_by_expert(ids)
    a = K.expert_gemv(x, groups, top_k, w1, s1, w3, s3, activation, beta, linear_beta)
    y = K.expert_gemv(a_in.reshape(batch * top_k, inter), groups, top_k, w2, s2)
    combined = K.moe_combine(y_ref.contiguous(), weights)
    errors = {
        "gated": rel(a.view(batch, top_k, inter), a_ref),
        "down": rel(y.view(batch, top_k, hidden), y_ref),
        "combine": rel(combined, semantics.moe_combine(y_ref, weights)),
    }
    return _check(f"experts {'mxfp4' if mxfp4 else 'bf16'} {activation}", errors, _tol(dtype))


def check_mla_absorbed(gen, dtype, batch=3, heads=3, nope=32, rope=16, v_dim=24, rank=64, rows=40, window=33) -> dict[str, float]:
    """mla_attention_absorbed over the first `window` rows against semantics.mla_attention over all rows
    (positions < window, staggered per request; rows past a position hold random values)."""
    from k3mk.bench.baseline import mla_attention_absorbed
    from k3mk.compiler.config import MLAConfig

    m = MLAConfig(heads, None, rank, nope, rope, v_dim, False, 1e-6)
    q = randn(gen, batch, heads * (nope + rope), dtype=dtype)
    cache = randn(gen, batch, rows, rank + rope, dtype=dtype)
    kv_b = randn(gen, heads * (nope + v_dim), rank, dtype=dtype, scale=rank**-0.5)
    positions = torch.tensor([window - 1 - 3 * b for b in range(batch)], device=gen.device)
    ref = semantics.mla_attention(q, cache, positions, kv_b, heads, nope, rope, v_dim, rank)
    out = mla_attention_absorbed(q, cache, positions, kv_b, m, window)
    return _check("mla_absorbed", {"o": rel(out, ref)}, F32_TOL if dtype == torch.float32 else LAYER_TOL)


# --- layers of a tiny model ---------------------------------------------------------------------------


def model_with_weights(name: str, device, dtype):
    """(config, weights, reference DecodeStep, BaselineStep) sharing one set of random weights."""
    from k3mk.bench.baseline import build_baseline_step
    from k3mk.compiler.generate import build_decode_step
    from k3mk.compiler.random_weights import random_weights

    config = load_config(name)
    weights = random_weights(config, 0, dtype, device)
    return config, weights, build_decode_step(config, weights, dtype), build_baseline_step(config, weights, dtype)


def _layer_input(gen, config, weights, layer: int, batch: int, norm: str) -> torch.Tensor:
    """A layer's normed input for random tokens: their embeddings carry the routing codes, so the
    routers see clear margins (compiler/random_weights.py)."""
    tokens = torch.randint(config.vocab_size, (batch,), generator=gen, device=gen.device)
    h = weights["model.embed_tokens.weight"][tokens]
    return semantics.rmsnorm(h, weights[f"model.layers.{layer}.{norm}.weight"], config.rms_norm_eps)


def check_moe_layer(gen, name, batch=3, dtype=torch.bfloat16) -> dict[str, float]:
    """BaselineStep._moe (Triton router, grouped experts, combine) against DecodeStep._moe: router ids
    exactly, the layer output within LAYER_TOL."""
    config, weights, ref, base = model_with_weights(name, gen.device, dtype)
    layer = next(i for i in range(config.num_layers) if config.is_moe_layer(i))
    x = _layer_input(gen, config, weights, layer, batch, "post_attention_layernorm")
    p = f"model.layers.{layer}.block_sparse_moe"
    logits = semantics.linear(x, weights[f"{p}.gate.weight"], True)
    moe = config.moe
    ref_ids, _ = semantics.router_topk(logits, weights[f"{p}.gate.e_score_correction_bias"], moe.top_k, moe.renormalize, moe.routed_scaling_factor)
    with torch.no_grad():
        y_ref, y = ref._moe(layer, x), base._moe(layer, x)
    assert torch.equal(base.routed_ids[layer], ref_ids), f"{name}: router ids differ"
    return _check(f"moe layer {name}", {"y": rel(y, y_ref)}, LAYER_TOL)


def random_state(gen, config, batch, rows, dtype) -> dict[str, torch.Tensor]:
    from k3mk.compiler.weights import state_specs

    return {s.name: randn(gen, *s.shape, dtype=s.torch_dtype(dtype), scale=0.1 if s.name.endswith("recurrent_state") else 1.0)
            for s in state_specs(config, batch, rows)}  # fmt: skip


def check_mla_layer(gen, name, batch=3, rows=40, window=33, dtype=torch.bfloat16) -> dict[str, float]:
    """BaselineStep._mla (absorbed, cache row written in place, attention over `window` rows) against
    DecodeStep._mla: the output and the written cache rows within LAYER_TOL, every other row untouched."""
    config, weights, ref, base = model_with_weights(name, gen.device, dtype)
    layer = config.mla_layers[0]
    x = _layer_input(gen, config, weights, layer, batch, "input_layernorm")
    key = f"layers.{layer}.kv_cache"
    cache = random_state(gen, config, batch, rows, dtype)[key]
    positions = torch.tensor([window - 1 - 3 * b for b in range(batch)], device=gen.device)
    new_ref: dict = {}
    new: dict = {}
    base.attention_window = window
    with torch.no_grad():
        o_ref = ref._mla(layer, x, positions, {key: cache.clone()}, new_ref)
        own = cache.clone()
        o = base._mla(layer, x, positions, {key: own}, new)
    assert new[key] is own, "the baseline must write the cache in place"
    written = torch.zeros(batch, rows, dtype=torch.bool, device=gen.device)
    written[torch.arange(batch), positions] = True
    assert torch.equal(own[~written], cache[~written]), "rows other than the new ones changed"
    return _check(f"mla layer {name}", {"o": rel(o, o_ref), "rows": rel(own[written], new_ref[key][written])}, LAYER_TOL)


def check_kda_layer(gen, name, batch=3, dtype=torch.bfloat16) -> dict[str, float]:
    """BaselineStep._kda (Triton conv, fla gate + recurrence, fla gated norm; states in place) against
    DecodeStep._kda: output within LAYER_TOL, conv state exactly, recurrent state within 1e-3 (a flipped
    bf16 rounding of q / k / v moves it slightly). GPU only (fla)."""
    config, weights, ref, base = model_with_weights(name, gen.device, dtype)
    layer = config.kda_layers[0]
    x = _layer_input(gen, config, weights, layer, batch, "input_layernorm")
    state = {k: v for k, v in random_state(gen, config, batch, 8, dtype).items() if k.startswith(f"layers.{layer}.")}
    new_ref: dict = {}
    new: dict = {}
    own = {k: v.clone() for k, v in state.items()}
    with torch.no_grad():
        o_ref = ref._kda(layer, x, state, new_ref)
        o = base._kda(layer, x, own, new)
    conv, recurrent = f"layers.{layer}.conv_state", f"layers.{layer}.recurrent_state"
    assert new[conv] is own[conv] and new[recurrent] is own[recurrent], "the baseline must update the KDA state in place"
    errors = {"o": rel(o, o_ref), "conv_state": rel(own[conv], new_ref[conv]), "recurrent_state": rel(own[recurrent], new_ref[recurrent])}
    return _check(f"kda layer {name}", errors, {"o": LAYER_TOL, "conv_state": 0.0, "recurrent_state": 1e-3})


# --- fla (GPU only) -----------------------------------------------------------------------------------


def check_kda_recurrence(gen, batch=2, heads=3, head_dim=128, lower_bound: float | None = -5.0) -> dict[str, float]:
    """fla's fused recurrent KDA (gate inside, state in place) against semantics.kda_gate + kda_recurrence."""
    from k3mk.bench.baseline import kda_recurrence_

    p = heads * head_dim
    q, k, v, f = (randn(gen, batch, p, dtype=torch.bfloat16) for _ in range(4))
    beta = randn(gen, batch, heads, dtype=torch.bfloat16)
    a_log = torch.rand(heads, generator=gen, device=gen.device) * 0.6 - 0.3
    dt_bias = torch.rand(p, generator=gen, device=gen.device) * 2.5 - 5.0
    state = randn(gen, batch, heads, head_dim, head_dim, scale=0.1)
    g = semantics.kda_gate(f, a_log, dt_bias, heads, lower_bound)
    o_ref, s_ref = semantics.kda_recurrence(q, k, v, g, beta, state)
    o = kda_recurrence_(q, k, v, f, beta, a_log, dt_bias, state, lower_bound)
    return _check("kda_recurrence", {"o": rel(o, o_ref), "state": rel(state, s_ref)}, {"o": BF16_TOL, "state": 1e-5})


def check_gated_rmsnorm(gen, batch=2, heads=3, head_dim=128) -> dict[str, float]:
    from k3mk.bench.baseline import gated_rmsnorm

    x, gate = (randn(gen, batch, heads * head_dim, dtype=torch.bfloat16, scale=2.0) for _ in range(2))
    w = randn(gen, head_dim) * 0.1 + 1
    out = gated_rmsnorm(x, gate, w, head_dim, 1e-5)
    return _check("gated_rmsnorm", {"y": rel(out, semantics.gated_rmsnorm(x, gate, w, head_dim, 1e-5))}, BF16_TOL)


# --- small sizes, every device --------------------------------------------------------------------------


def small_cases(device: str) -> dict:
    """Every Triton kernel at small, odd sizes (float32: tight; bfloat16: the dtype plumbing), the
    absorbed MLA, and the MoE and MLA layers of k3-tiny and kimi-linear-tiny: what runs on the CPU."""
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator(device=device).manual_seed(1 if dtype == torch.float32 else 2)
        tag = str(dtype).removeprefix("torch.")
        results[f"rmsnorm {tag}"] = check_rmsnorm(gen, dtype)
        results[f"act_mul {tag}"] = check_act_mul(gen, dtype)
        results[f"attn_res {tag}"] = check_attn_res(gen, dtype)
        results[f"kda_conv {tag}"] = check_kda_conv(gen, dtype)
        results[f"experts bf16 silu {tag}"] = check_experts(gen, dtype, activation="silu")
        results[f"experts mxfp4 situ {tag}"] = check_experts(gen, dtype, mxfp4=True)
        results[f"mla_absorbed {tag}"] = check_mla_absorbed(gen, dtype)
    gen = torch.Generator(device=device).manual_seed(3)
    results["router_topk"] = check_router_topk(gen)
    results["router_topk k1 no renormalize"] = check_router_topk(gen, batch=2, experts=9, top_k=1, renormalize=False, scaling=1.0)
    for name in ("k3-tiny", "kimi-linear-tiny"):
        results[f"moe layer {name}"] = check_moe_layer(gen, name)
        results[f"mla layer {name}"] = check_mla_layer(gen, name)
    return results


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(json.dumps(small_cases("cpu"), indent=1))
