"""Megakernel test cases of the KDA-side Kimi ops (codegen/testing_kda.py): the fused GEMV epilogues,
kda_conv, kda_recurrence, attn_res, a miniature KDA layer (conv + decay gate -> recurrence -> o_norm
-> o_proj + residual), and the K3-size recurrence benchmark. Registered in megakernel_cases.all_cases();
run on the GPU by tests/runtime/test_kda_ops_gpu.py. Shapes are odd on purpose, batch 1 and 4; the
decode states are random (never zeros) and evolve in place over the test's steps.
"""

from __future__ import annotations

import torch

from k3mk.codegen.testing import TableBuilder
from k3mk.ir.ops import SiluMul, SituMul

# Per case: weight name -> factor applied after random_weights (drive SiTU's clamp and softplus's
# pass-through range).
WEIGHT_SCALES: dict[str, dict[str, float]] = {}


def _bf16(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale).to(torch.bfloat16)


def _case(*args, **kwargs):
    from megakernel_cases import Case  # the shared dataclass (imported late: megakernel_cases imports us)

    return Case(*args, **kwargs)


# ---- GEMV epilogues ----------------------------------------------------------------------------------


def gated_case(name: str, batch: int, k: int, n: int, tiles: int, ctas: int, situ: bool, norm: bool):
    b = TableBuilder(ctas)
    x = b.buffer("x", "bfloat16", (batch, k))
    y = b.buffer("y", "bfloat16", (batch, n))
    wg, wu = b.weight("w_gate", "bfloat16", (n, k)), b.weight("w_up", "bfloat16", (n, k))
    g = b.weight("g", "bfloat16", (k,)) if norm else None
    act = SituMul(4.0, 25.0) if situ else SiluMul()
    b.gated_linear(x, wg, wu, y, act, tiles=tiles, norm_weight=g, eps=1e-5)
    if situ:
        WEIGHT_SCALES[name] = {"w_gate": 3.0, "w_up": 20.0}  # gate past beta = 4, up past linear_beta = 25
    return _case(name, b, lambda gen: {"x": _bf16(gen, batch, k, scale=2.0)}, outputs=["y"])


def sigmoid_gate_case(name: str, batch: int, k: int, n: int, tiles: int, ctas: int, norm: bool):
    b = TableBuilder(ctas)
    x = b.buffer("x", "bfloat16", (batch, k))
    o = b.buffer("o", "bfloat16", (batch, n))
    y = b.buffer("y", "bfloat16", (batch, n))
    g = b.weight("g", "bfloat16", (k,)) if norm else None
    b.linear_sigmoid_gate(x, b.weight("w", "bfloat16", (n, k)), o, y, tiles=tiles, norm_weight=g, eps=1e-6)
    return _case(name, b, lambda gen: {"x": _bf16(gen, batch, k, scale=2.0), "o": _bf16(gen, batch, n)}, outputs=["y"])


def residual_case(name: str, batch: int, k: int, n: int, residuals: int, tiles: int, ctas: int):
    b = TableBuilder(ctas)
    x = b.buffer("x", "bfloat16", (batch, k))
    rs = [b.buffer(f"r{i}", "bfloat16", (batch, n)) for i in range(residuals)]
    y = b.buffer("y", "bfloat16", (batch, n))
    b.linear_residual(x, b.weight("w", "bfloat16", (n, k)), y, rs, tiles=tiles)

    def inputs(gen):
        d = {"x": _bf16(gen, batch, k)}
        d.update({f"r{i}": _bf16(gen, batch, n, scale=4.0 ** i) for i in range(residuals)})  # mixed magnitudes
        return d

    return _case(name, b, inputs, outputs=["y"])


def fp32_case(name: str, batch: int, k: int, n: int, tiles: int, ctas: int):
    b = TableBuilder(ctas)
    x = b.buffer("x", "bfloat16", (batch, k))
    y = b.buffer("y", "float32", (batch, n))
    b.linear_fp32(x, b.weight("w", "bfloat16", (n, k)), y, tiles=tiles, norm_weight=b.weight("g", "bfloat16", (k,)), eps=1e-5)
    return _case(name, b, lambda gen: {"x": _bf16(gen, batch, k, scale=3.0)}, outputs=["y"])


def kda_gate_case(name: str, batch: int, k: int, heads: int, lower_bound: float | None, tiles: int, ctas: int, norm: bool,
                  f_scale: float = 1.0):  # fmt: skip
    b = TableBuilder(ctas)
    d = 128
    x = b.buffer("x", "bfloat16", (batch, k))
    g = b.buffer("g", "float32", (batch, heads, d))
    w = b.weight("w", "bfloat16", (heads * d, k))
    a_log, dt = b.weight("A_log", "float32", (heads,)), b.weight("dt_bias", "float32", (heads * d,))
    nw = b.weight("gn", "bfloat16", (k,)) if norm else None
    b.linear_kda_gate(x, w, a_log, dt, g, num_heads=heads, lower_bound=lower_bound, tiles=tiles, norm_weight=nw, eps=1e-5)
    if f_scale != 1.0:
        WEIGHT_SCALES[name] = {"w": f_scale}
    return _case(name, b, lambda gen: {"x": _bf16(gen, batch, k)}, outputs=["g"])


def gated_rmsnorm_case(name: str, batch: int, k: int, heads: int, tiles: int, ctas: int, norm: bool):
    b = TableBuilder(ctas)
    d = 128
    x = b.buffer("x", "bfloat16", (batch, k))
    o = b.buffer("o", "bfloat16", (batch, heads * d))
    y = b.buffer("y", "bfloat16", (batch, heads * d))
    nw = b.weight("gn", "bfloat16", (k,)) if norm else None
    b.linear_gated_rmsnorm(x, b.weight("w", "bfloat16", (heads * d, k)), o, b.weight("o_norm", "float32", (d,)), y,
                           head_dim=d, o_eps=1e-5, tiles=tiles, norm_weight=nw, eps=1e-5)  # fmt: skip
    return _case(name, b, lambda gen: {"x": _bf16(gen, batch, k, scale=2.0), "o": _bf16(gen, batch, heads * d, scale=0.3)},
                 outputs=["y"])  # fmt: skip


# ---- KDA ---------------------------------------------------------------------------------------------


def kda_conv_case(name: str, batch: int, channels: int, channel_tile: int, ctas: int):
    b = TableBuilder(ctas)
    ins = [b.buffer(n, "bfloat16", (batch, channels)) for n in ("q", "k", "v")]
    outs = [b.buffer(n, "bfloat16", (batch, channels)) for n in ("qc", "kc", "vc")]
    state = b.weight("conv_state", "bfloat16", (batch, 3, 3 * channels))
    ws = [b.weight(f"{n}_conv1d", "float32", (channels, 1, 4)) for n in ("q", "k", "v")]
    b.kda_conv(*ins, state, *ws, *outs, channel_tile=channel_tile)
    return _case(name, b, lambda gen: {n: _bf16(gen, batch, channels) for n in ("q", "k", "v")}, outputs=["qc", "kc", "vc"])


def _recurrence_inputs(batch: int, heads: int, d: int):
    def inputs(gen):
        return {
            "q": _bf16(gen, batch, heads * d),
            "k": _bf16(gen, batch, heads * d),
            "v": _bf16(gen, batch, heads * d),
            "gk": -5.0 * torch.sigmoid(torch.randn(batch, heads, d, generator=gen)),  # K3's range (-5, 0)
            "beta": _bf16(gen, batch, heads),
        }

    return inputs


def kda_recurrence_case(name: str, batch: int, heads: int, d: int, value_tiles: int, ctas: int):
    b = TableBuilder(ctas)
    q, k, v = (b.buffer(n, "bfloat16", (batch, heads * d)) for n in ("q", "k", "v"))
    g = b.buffer("gk", "float32", (batch, heads, d))
    beta = b.buffer("beta", "bfloat16", (batch, heads))
    o = b.buffer("o", "bfloat16", (batch, heads * d))
    state = b.weight("kda_state", "float32", (batch, heads, d, d))
    b.kda_recurrence(q, k, v, g, beta, state, o, value_tiles=value_tiles)
    return _case(name, b, _recurrence_inputs(batch, heads, d), outputs=["o"])


def attn_res_case(name: str, batch: int, dim: int, sources: int, tasks: int):
    b = TableBuilder(tasks)
    srcs = [b.buffer(f"s{i}", "bfloat16", (batch, dim)) for i in range(sources)]
    y = b.buffer("y", "bfloat16", (batch, dim))
    b.attn_res(srcs, b.weight("res_norm", "bfloat16", (dim,)), b.weight("res_proj", "bfloat16", (1, dim)), y, eps=1e-5, tasks=tasks)
    # sources of very different scales (block sums grow along the depth)
    return _case(name, b, lambda gen: {f"s{i}": _bf16(gen, batch, dim, scale=0.5 + i) for i in range(sources)}, outputs=["y"])


def kda_layer_case():
    """A miniature K3 KDA layer, batch 4, 3 heads: conv (q, k, v) and the decay gate (f_b_proj + kda_gate)
    -> the recurrence (joins both) -> o_norm in the g_proj epilogue -> o_proj + residual."""
    batch, heads, d, hidden = 4, 3, 128, 264
    p = heads * d
    b = TableBuilder(8)
    x = b.buffer("x", "bfloat16", (batch, hidden))
    qkv = [b.buffer(n, "bfloat16", (batch, p)) for n in ("q", "k", "v")]
    conv = [b.buffer(n, "bfloat16", (batch, p)) for n in ("qc", "kc", "vc")]
    fa = b.buffer("fa", "bfloat16", (batch, d))
    g = b.buffer("gk", "float32", (batch, heads, d))
    beta = b.buffer("beta", "bfloat16", (batch, heads))
    o = b.buffer("o", "bfloat16", (batch, p))
    on = b.buffer("on", "bfloat16", (batch, p))
    y = b.buffer("y", "bfloat16", (batch, hidden))
    conv_state = b.weight("conv_state", "bfloat16", (batch, 3, 3 * p))
    convw = [b.weight(f"{n}_conv1d", "float32", (p, 1, 4)) for n in ("q", "k", "v")]
    state = b.weight("kda_state", "float32", (batch, heads, d, d))
    e_conv = b.kda_conv(*qkv, conv_state, *convw, *conv, channel_tile=d)
    e_gate = b.linear_kda_gate(fa, b.weight("f_b", "bfloat16", (p, d)), b.weight("A_log", "float32", (heads,)),
                               b.weight("dt_bias", "float32", (p,)), g, num_heads=heads, lower_bound=-5.0, tiles=5)  # fmt: skip
    e_rec = b.kda_recurrence(*conv, g, beta, state, o, value_tiles=2, wait=(e_conv, e_gate))
    e_norm = b.linear_gated_rmsnorm(x, b.weight("g_proj", "bfloat16", (p, hidden)), o, b.weight("o_norm", "float32", (d,)), on,
                                    head_dim=d, o_eps=1e-5, tiles=6, wait=(e_rec,), norm_weight=b.weight("in_norm", "bfloat16", (hidden,)),
                                    eps=1e-5)  # fmt: skip
    b.linear_residual(on, b.weight("o_proj", "bfloat16", (hidden, p)), y, [x], tiles=8, wait=(e_norm,))

    def inputs(gen):
        d_in = {n: _bf16(gen, batch, p) for n in ("q", "k", "v")}
        d_in.update({"x": _bf16(gen, batch, hidden), "fa": _bf16(gen, batch, d), "beta": _bf16(gen, batch, heads)})
        return d_in

    return _case("kda_layer_b4", b, inputs, outputs=["qc", "kc", "vc", "gk", "o", "on", "y"])


def bench_recurrence_case(batch: int, value_tiles: int = 1):
    """K3's recurrence (96 heads, D = 128): 64 KB of fp32 state per (request, head) read and written once.
    value_tiles 1: one task per head on 96 CTAs (what passes/tile.py makes today); more: (head, value rows)
    tasks round-robin over all 132 SMs."""
    if value_tiles == 1:
        return kda_recurrence_case(f"bench_kda_recurrence_k3_b{batch}", batch, 96, 128, 1, 96)
    return kda_recurrence_case(f"bench_kda_recurrence_k3_b{batch}_v{value_tiles}", batch, 96, 128, value_tiles, 132)


def kda_cases() -> list:
    return [
        gated_case("gated_situ_b1", 1, 520, 333, tiles=7, ctas=5, situ=True, norm=True),
        gated_case("gated_silu_b4", 4, 264, 200, tiles=5, ctas=3, situ=False, norm=False),
        gated_case("gated_situ_b4", 4, 1032, 97, tiles=3, ctas=3, situ=True, norm=False),
        # 2 rows x chunks of 1280 / 1024 per fill (ir/streaming.py fill_plan at batch > 1), a short last group
        gated_case("gated_silu_b4_chunked", 4, 2304, 45, tiles=2, ctas=2, situ=False, norm=True),
        sigmoid_gate_case("sigmoid_gate_b4", 4, 1032, 257, tiles=9, ctas=4, norm=True),
        sigmoid_gate_case("sigmoid_gate_b1", 1, 136, 96, tiles=2, ctas=2, norm=False),
        residual_case("residual3_b4", 4, 520, 333, residuals=3, tiles=6, ctas=4),
        residual_case("residual2_b1", 1, 264, 100, residuals=2, tiles=3, ctas=3),
        fp32_case("linear_fp32_b4", 4, 264, 97, tiles=3, ctas=3),
        kda_gate_case("kda_gate_lb_b1", 1, 136, 5, -5.0, tiles=7, ctas=4, norm=False),
        kda_gate_case("kda_gate_softplus_b4", 4, 264, 3, None, tiles=5, ctas=3, norm=True, f_scale=12.0),
        gated_rmsnorm_case("gated_rmsnorm_b4", 4, 264, 3, tiles=4, ctas=4, norm=False),
        gated_rmsnorm_case("gated_rmsnorm_b1", 1, 520, 5, tiles=6, ctas=3, norm=True),
        # 16 x 5200 bf16 > X_SMEM_BUDGET: x read from the arena, the rstd table at the op smem's start
        gated_rmsnorm_case("gated_rmsnorm_b16_arena", 16, 5200, 3, tiles=3, ctas=3, norm=False),
        kda_conv_case("kda_conv_b1", 1, 640, 128, ctas=3),
        kda_conv_case("kda_conv_b4", 4, 200, 64, ctas=2),
        gated_case("gated_situ_b16", 16, 1032, 97, tiles=3, ctas=3, situ=True, norm=True),
        # gated row MMAs (8 rows' gate and up per fill) at b16 / b8: tiles whose last group is short; b8 a shorter last chunk
        gated_case("gated_situ_b16_rm", 16, 1056, 97, tiles=3, ctas=3, situ=True, norm=True),
        gated_case("gated_silu_b8_rm", 8, 2304, 45, tiles=2, ctas=2, situ=False, norm=True),
        kda_conv_case("kda_conv_b16", 16, 200, 64, ctas=2),
        kda_recurrence_case("kda_recurrence_b16", 16, 3, 128, value_tiles=2, ctas=4),
        kda_recurrence_case("kda_recurrence_b1", 1, 5, 128, value_tiles=1, ctas=5),
        kda_recurrence_case("kda_recurrence_b4", 4, 3, 128, value_tiles=3, ctas=4),
        kda_recurrence_case("kda_recurrence_d64_b2", 2, 2, 64, value_tiles=2, ctas=2),
        attn_res_case("attn_res_b1_n9", 1, 7168, 9, tasks=1),
        attn_res_case("attn_res_b4_n3", 4, 1048, 3, tasks=3),
        kda_layer_case(),
        bench_recurrence_case(1),
        bench_recurrence_case(4),
        bench_recurrence_case(16),
        bench_recurrence_case(4, value_tiles=4),
        bench_recurrence_case(16, value_tiles=4),
    ]


# The cases the GPU correctness test runs (the bench cases are timed, not compared step by step).
KDA_OP_CASES = [c.name for c in kda_cases() if not c.name.startswith("bench_")]
