"""Megakernel test cases of the MoE and MLA Kimi ops (codegen/testing_moe_mla.py): the router, the routed
experts (bf16 and MXFP4, gated SiLU/SiTU and the w2 + combine form), a miniature MoE block whose experts
read the router's ids at run time, the absorbed MLA decode (latent + cache write -> q absorb -> chunked
decode -> LSE merge + W_UV), and the K3-size MXFP4 expert benchmarks. Registered in
megakernel_cases.all_cases(); run on the GPU by tests/runtime/test_moe_mla_gpu.py.

Shapes are odd on purpose, batch 1 and 4. Weights, caches and positions are random (never zeros);
router inputs are redrawn until the top-k has clear margins (fp32 summation order must not flip a
choice), and a tie case checks lowest-index-wins exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from k3mk.codegen.testing import TableBuilder


@dataclass
class MoeMlaCase:
    name: str
    builder: TableBuilder
    kind: str  # router | expert_gated | expert_combine | moe_graph | mla | bench
    weights: Callable[[torch.Generator, str], dict[str, torch.Tensor]]
    inputs: Callable[[torch.Generator, dict[str, torch.Tensor], int], dict[str, torch.Tensor]]  # (gen, weights, step)
    meta: dict = field(default_factory=dict)
    debug: bool = False
    check: bool = True
    outputs: list[str] = field(default_factory=list)
    exact: tuple[str, ...] = ()
    argmax_of: tuple[str, str] | None = None


# ---- random tensors ------------------------------------------------------------------------------------


def _randn(gen: torch.Generator, shape, device: str, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(shape, generator=gen, device=device) * scale


def default_weights(builder: TableBuilder, scale_range: tuple[int, int] = (122, 127), overrides: dict | None = None):
    """N(0, 1/in) matrices (bf16), gains near 1, N(0, 1) caches, random MXFP4 codes and UE8M0 scales in
    `scale_range` (2^-5 .. 2^0), biases U(-0.5, 0.5)."""
    overrides = overrides or {}

    def make(gen: torch.Generator, device: str) -> dict[str, torch.Tensor]:
        out = {}
        for w in builder.weights:
            if w.name in overrides:
                out[w.name] = overrides[w.name](gen, device)
            elif w.dtype == "uint8" and "scale" in w.name:
                out[w.name] = torch.randint(scale_range[0], scale_range[1] + 1, w.shape, generator=gen, device=device, dtype=torch.uint8)
            elif w.dtype == "uint8":
                out[w.name] = torch.randint(0, 256, w.shape, generator=gen, device=device, dtype=torch.uint8)
            elif w.name.startswith("cache"):
                out[w.name] = _randn(gen, w.shape, device).to(torch.bfloat16)
            elif w.dtype == "float32":
                out[w.name] = torch.rand(w.shape, generator=gen, device=device) - 0.5
            elif len(w.shape) == 1:
                out[w.name] = (1.0 + 0.1 * _randn(gen, w.shape, device)).to(torch.bfloat16)
            else:
                out[w.name] = _randn(gen, w.shape, device, w.shape[-1] ** -0.5).to(torch.bfloat16)
        return out

    return make


def _distinct_ids(gen: torch.Generator, batch: int, top_k: int, num_experts: int, device: str) -> torch.Tensor:
    rows = [torch.randperm(num_experts, generator=gen, device=device)[:top_k] for _ in range(batch)]
    return torch.stack(rows).to(torch.int32)


def _same_ids(gen: torch.Generator, batch: int, top_k: int, num_experts: int, device: str) -> torch.Tensor:
    """Every request chooses the same experts, each in its own random slot order (skewed routing: a grouped
    expert_gated streams each expert once for all requests)."""
    chosen = torch.randperm(num_experts, generator=gen, device=device)[:top_k]
    return torch.stack([chosen[torch.randperm(top_k, generator=gen, device=device)] for _ in range(batch)]).to(torch.int32)


# ---- router ---------------------------------------------------------------------------------------------


def router_margin_ok(x: torch.Tensor, weights: dict, names: dict, top_k: int, eps: float | None, margin: float) -> bool:
    """The k+1 largest selection scores of every row differ pairwise by >= margin (ids are exact)."""
    from k3mk.ir import semantics

    xn = x if eps is None else semantics.rmsnorm(x, weights[names["norm"]], eps)
    s = torch.sigmoid(semantics.linear(xn, weights[names["gate"]], fp32=True)) + weights[names["bias"]].float()
    top = s.topk(min(top_k + 1, s.shape[1]), dim=-1).values
    return bool((top[:, :-1] - top[:, 1:]).min() >= margin)


def router_case(name: str, batch: int, dim: int, experts: int, top_k: int, norm: bool, renormalize: bool,
                scaling: float, tiles: int = 0, ctas: int = 2) -> MoeMlaCase:  # fmt: skip
    """tiles: the router GEMV's tiles select (the last to arrive, on whichever CTA), as emitted for large gates."""
    b = TableBuilder(ctas)
    x = b.buffer("x", "bfloat16", (batch, dim))
    ids = b.buffer("ids", "int32", (batch, top_k))
    tw = b.buffer("topk_weights", "float32", (batch, top_k))
    gate = b.weight("gate", "bfloat16", (experts, dim))
    bias = b.weight("bias", "float32", (experts,))
    g = b.weight("g", "bfloat16", (dim,)) if norm else None
    b.router(x, gate, bias, ids, tw, top_k=top_k, renormalize=renormalize, scaling=scaling, norm_weight=g, eps=1e-5, cta=1, tiles=tiles)
    names = {"gate": "gate", "bias": "bias", "norm": "g"}

    def inputs(gen, weights, step):
        for _ in range(200):
            xv = _randn(gen, (batch, dim), "cpu", 2.0).to(torch.bfloat16)
            cpu_w = {k: v.cpu() for k, v in weights.items()}
            if router_margin_ok(xv, cpu_w, names, top_k, 1e-5 if norm else None, 3e-4):
                return {"x": xv}
        raise RuntimeError("no router input with clear margins")

    return MoeMlaCase(name, b, "router", default_weights(b), inputs, outputs=["ids", "topk_weights"], exact=("ids",),
                      meta={"top_k": top_k})  # fmt: skip


def router_ties_case(name: str = "router_ties_b2", batch: int = 2, tiles: int = 0) -> MoeMlaCase:
    """Identical gate rows and biases: within the top-k the lower index comes first (20 before 33), and at
    the k-th place the lower index wins (5, not 9). With tiles at batch 1 the selection spreads over the warps
    (topk_select.py.j2 `_select_spread`): 5 and 9 tie inside a warp's chunk of 32 experts, 20 and 33 across two,
    and the second chunk's 24 places past the 40 experts are padding."""
    dim, experts, top_k = 264, 40, 4
    b = TableBuilder(1 if not tiles else 2)
    x = b.buffer("x", "bfloat16", (batch, dim))
    ids = b.buffer("ids", "int32", (batch, top_k))
    tw = b.buffer("topk_weights", "float32", (batch, top_k))
    gate = b.weight("gate", "bfloat16", (experts, dim))
    bias = b.weight("bias", "float32", (experts,))
    b.router(x, gate, bias, ids, tw, top_k=top_k, **({"cta": 1, "tiles": tiles} if tiles else {}))

    def make_gate(gen, device):
        w = _randn(gen, (experts, dim), device, dim**-0.5)
        w[33] = w[20]
        w[9] = w[5]
        return w.to(torch.bfloat16)

    def make_bias(gen, device):
        v = -torch.rand(experts, generator=gen, device=device)  # (-1, 0]: never chosen
        v[1] = v[20] = v[33] = 10.0
        v[5] = v[9] = 5.0
        return v

    weights = default_weights(b, overrides={"gate": make_gate, "bias": make_bias})
    return MoeMlaCase(name, b, "router", weights, lambda gen, w, s: {"x": _randn(gen, (batch, dim), "cpu").to(torch.bfloat16)},
                      outputs=["ids", "topk_weights"], exact=("ids",), meta={"top_k": top_k, "ties": True})  # fmt: skip


# ---- routed experts ---------------------------------------------------------------------------------------


def expert_gated_case(name: str, batch: int, k_in: int, n: int, experts: int, top_k: int, fmt: str, activation: str,
                      row_tiles: int, ctas: int, same_experts: bool = False) -> MoeMlaCase:  # fmt: skip
    b = TableBuilder(ctas)
    x = b.buffer("x", "bfloat16", (batch, k_in))
    ids = b.buffer("ids", "int32", (batch, top_k))
    y = b.buffer("y", "bfloat16", (batch, top_k, n))
    if fmt == "mxfp4":
        w1 = b.weight("w1_packed", "uint8", (experts, n, k_in // 2))
        s1 = b.weight("w1_scale", "uint8", (experts, n, k_in // 32))
        w3 = b.weight("w3_packed", "uint8", (experts, n, k_in // 2))
        s3 = b.weight("w3_scale", "uint8", (experts, n, k_in // 32))
    else:
        w1 = b.weight("w1", "bfloat16", (experts, n, k_in))
        w3 = b.weight("w3", "bfloat16", (experts, n, k_in))
        s1 = s3 = None
    b.expert_gated(x, ids, y, w1, w3, scale_gate=s1, scale_up=s3, activation=activation, row_tiles=row_tiles)
    # SiTU: gate values past beta = 4 and up values past linear_beta = 25 (the clamps matter); SiLU: O(1).
    scale_range = (124, 127) if activation == "situ" else (120, 123)
    bf16_scale = {"w1": 8.0, "w3": 40.0} if activation == "situ" else {}
    overrides = {nm: (lambda f, shp: lambda gen, dev: _randn(gen, shp, dev, f * shp[-1] ** -0.5).to(torch.bfloat16))(f, (experts, n, k_in))
                 for nm, f in bf16_scale.items() if fmt != "mxfp4"}  # fmt: skip

    def inputs(gen, weights, step):
        return {"x": _randn(gen, (batch, k_in), "cpu", 2.0).to(torch.bfloat16),
                "ids": (_same_ids if same_experts else _distinct_ids)(gen, batch, top_k, experts, "cpu")}  # fmt: skip

    return MoeMlaCase(name, b, "expert_gated", default_weights(b, scale_range, overrides), inputs, outputs=["y"])


def expert_combine_case(name: str, batch: int, k_in: int, n: int, experts: int, top_k: int, fmt: str, row_tiles: int,
                        ctas: int, scale_range: tuple[int, int] = (118, 121), residuals: int = 0, same_experts: bool = False) -> MoeMlaCase:  # fmt: skip
    """residuals: bf16 rows the combine adds in its epilogue (the MoE "+ shared" and the residual stream)."""
    b = TableBuilder(ctas)
    x = b.buffer("x", "bfloat16", (batch, top_k, k_in))
    ids = b.buffer("ids", "int32", (batch, top_k))
    tw = b.buffer("topk_weights", "float32", (batch, top_k))
    rs = [b.buffer(f"r{i}", "bfloat16", (batch, n)) for i in range(residuals)]
    y = b.buffer("y", "bfloat16", (batch, n))
    if fmt == "mxfp4":
        w2 = b.weight("w2_packed", "uint8", (experts, n, k_in // 2))
        s2 = b.weight("w2_scale", "uint8", (experts, n, k_in // 32))
    else:
        w2, s2 = b.weight("w2", "bfloat16", (experts, n, k_in)), None
    b.expert_combine(x, ids, tw, y, w2, scale=s2, row_tiles=row_tiles, residuals=rs)

    def inputs(gen, weights, step):
        return {"x": _randn(gen, (batch, top_k, k_in), "cpu").to(torch.bfloat16),
                "ids": (_same_ids if same_experts else _distinct_ids)(gen, batch, top_k, experts, "cpu"),
                "topk_weights": torch.rand((batch, top_k), generator=gen) + 0.1,
                **{r.name: _randn(gen, (batch, n), "cpu", 4.0).to(torch.bfloat16) for r in rs}}  # fmt: skip

    return MoeMlaCase(name, b, "expert_combine", default_weights(b, scale_range), inputs, outputs=["y"])


def moe_graph_case(router_tiles: int = 0) -> MoeMlaCase:
    """router (rmsnorm) -> gated MXFP4 SiTU experts (wait on the router: ids read at run time) -> MXFP4 w2 +
    combine (waits on the router and the experts), batch 4 over 8 CTAs. router_tiles: the router's GEMV
    tiles select (the experts' producers wait on the tiles' event)."""
    batch, dim, experts, top_k, n = 4, 256, 12, 4, 96
    b = TableBuilder(8)
    x = b.buffer("x", "bfloat16", (batch, dim))
    ids = b.buffer("ids", "int32", (batch, top_k))
    tw = b.buffer("topk_weights", "float32", (batch, top_k))
    h = b.buffer("h", "bfloat16", (batch, top_k, n))
    y = b.buffer("y", "bfloat16", (batch, dim))
    gate = b.weight("gate", "bfloat16", (experts, dim))
    bias = b.weight("bias", "float32", (experts,))
    g = b.weight("g", "bfloat16", (dim,))
    w1, s1 = b.weight("w1_packed", "uint8", (experts, n, dim // 2)), b.weight("w1_scale", "uint8", (experts, n, dim // 32))
    w3, s3 = b.weight("w3_packed", "uint8", (experts, n, dim // 2)), b.weight("w3_scale", "uint8", (experts, n, dim // 32))
    w2, s2 = b.weight("w2_packed", "uint8", (experts, dim, n // 2)), b.weight("w2_scale", "uint8", (experts, dim, n // 32))
    e_r = b.router(x, gate, bias, ids, tw, top_k=top_k, norm_weight=g, eps=1e-5, cta=0, tiles=router_tiles, name="router")
    e_g = b.expert_gated(x, ids, h, w1, w3, scale_gate=s1, scale_up=s3, activation="situ", row_tiles=3, wait=(e_r,), name="experts13")
    b.expert_combine(h, ids, tw, y, w2, scale=s2, row_tiles=6, wait=(e_r, e_g), name="experts2")
    names = {"gate": "gate", "bias": "bias", "norm": "g"}

    def inputs(gen, weights, step):
        cpu_w = {k: v.cpu() for k, v in weights.items() if k in names.values()}
        for _ in range(200):
            xv = _randn(gen, (batch, dim), "cpu", 2.0).to(torch.bfloat16)
            if router_margin_ok(xv, cpu_w, names, top_k, 1e-5, 3e-4):
                return {"x": xv}
        raise RuntimeError("no router input with clear margins")

    return MoeMlaCase(f"moe_graph_b4{'_tiled_router' if router_tiles else ''}", b, "moe_graph", default_weights(b, (123, 126)), inputs,
                      outputs=["ids", "topk_weights", "h", "y"], exact=("ids",), meta={"top_k": top_k})  # fmt: skip


# ---- MLA ------------------------------------------------------------------------------------------------


def mla_case(name: str, batch: int, heads: int, rank: int, rope: int, nope: int, v_dim: int, max_len: int,
             chunks: int, min_rows: int, group_heads: int, ctas: int, head_tiles: int = 2, value_tiles: int = 1,
             column_tiles: int = 1, bench: bool = False) -> MoeMlaCase:  # fmt: skip
    """latent + cache write -> (q absorb) -> chunked decode (waits on both) -> LSE merge + W_UV (column_tiles /
    value_tiles > 1: each head's q_lat columns / output rows in that many q_absorb / v_up tasks). bench: every
    request at the last position (the full cache), for timing."""
    b = TableBuilder(ctas)
    c = b.buffer("c", "bfloat16", (batch, rank + rope))
    q = b.buffer("q", "bfloat16", (batch, heads * (nope + rope)))
    pos = b.buffer("positions", "int32", (batch,))
    q_abs = b.buffer("q_abs", "bfloat16", (batch, heads, rank + rope))
    o = b.buffer("o", "float32", (batch, chunks, heads, rank))
    lse = b.buffer("lse", "float32", (batch, chunks, heads))
    out = b.buffer("out", "bfloat16", (batch, heads * v_dim))
    g = b.weight("kv_a_norm", "bfloat16", (rank,))
    kv_b = b.weight("kv_b", "bfloat16", (heads * (nope + v_dim), rank))
    cache = b.weight("cache", "bfloat16", (batch, max_len, rank + rope))
    scale = (nope + rope) ** -0.5
    e_lat = b.mla_latent(c, pos, g, cache, eps=1e-6, tasks=min(batch, 2), name="latent")
    e_q = b.mla_q_absorb(q, kv_b, q_abs, num_heads=heads, qk_nope=nope, qk_rope=rope, v_dim=v_dim, head_tiles=head_tiles,
                         column_tiles=column_tiles, name="q_absorb")  # fmt: skip
    e_d = b.mla_decode(q_abs, pos, cache, o, lse, num_chunks=chunks, min_chunk_rows=min_rows, scale=scale,
                       group_heads=group_heads, wait=(e_lat, e_q), name="decode")  # fmt: skip
    b.mla_v_up(o, lse, kv_b, out, qk_nope=nope, v_dim=v_dim, head_tiles=head_tiles, value_tiles=value_tiles, wait=(e_d,), name="v_up")

    def inputs(gen, weights, step):
        p = torch.randint(0, max_len, (batch,), generator=gen)
        p[0] = [3, max_len - 1, min_rows + 5][step % 3]  # few rows (empty chunks), the last row, a chunk boundary
        if batch > 1:
            p[-1] = max_len - 1 - step
        if bench:
            p[:] = max_len - 1
        return {"c": _randn(gen, (batch, rank + rope), "cpu").to(torch.bfloat16),
                "q": _randn(gen, (batch, heads * (nope + rope)), "cpu").to(torch.bfloat16),
                "positions": p.to(torch.int32)}  # fmt: skip

    meta = dict(heads=heads, rank=rank, rope=rope, nope=nope, v_dim=v_dim, chunks=chunks, min_rows=min_rows, scale=scale,
                bench=bench, max_len=max_len)
    return MoeMlaCase(name, b, "mla", default_weights(b), inputs, outputs=["q_abs", "o", "lse", "out"], meta=meta)


# ---- K3-size expert benchmarks (spec 5.3: w1/w3 [3072, 3584], w2 [3584, 3072], 16 of 896 experts), MXFP4 (the
# checkpoint's) and bf16 (the bf16 proxy's, Kimi Linear's form) ---


def bench_expert_case(form: str, mxfp4: bool = True, experts: int = 32, top_k: int = 16, ctas: int = 132, batch: int = 1) -> MoeMlaCase:
    """One MoE layer's routed experts at the K3 proxies' widths. `weight_bytes` is one request's; at batch > 1 (gated
    only: requests routed independently, the experts grouped) test_bench_expert_bandwidth counts the distinct experts'
    (meta `expert_bytes` each)."""
    latent, inter = 3584, 3072
    b = TableBuilder(ctas)
    ids = b.buffer("ids", "int32", (batch, top_k))
    if form == "gated":
        x = b.buffer("x", "bfloat16", (batch, latent))
        y = b.buffer("y", "bfloat16", (batch, top_k, inter))
        if mxfp4:
            w1, s1 = b.weight("w1_packed", "uint8", (experts, inter, latent // 2)), b.weight("w1_scale", "uint8", (experts, inter, latent // 32))
            w3, s3 = b.weight("w3_packed", "uint8", (experts, inter, latent // 2)), b.weight("w3_scale", "uint8", (experts, inter, latent // 32))
            b.expert_gated(x, ids, y, w1, w3, scale_gate=s1, scale_up=s3, activation="situ", row_tiles=33)
            weight_bytes = top_k * 2 * inter * (latent // 2 + latent // 32)
        else:
            w1, w3 = b.weight("w1", "bfloat16", (experts, inter, latent)), b.weight("w3", "bfloat16", (experts, inter, latent))
            b.expert_gated(x, ids, y, w1, w3, activation="situ", row_tiles=33)
            weight_bytes = top_k * 2 * inter * latent * 2

        def inputs(gen, weights, step):
            return {"x": _randn(gen, (batch, latent), "cpu").to(torch.bfloat16), "ids": _distinct_ids(gen, batch, top_k, experts, "cpu")}
    else:
        assert batch == 1, "the combine bench is of one request"
        x = b.buffer("x", "bfloat16", (1, top_k, inter))
        tw = b.buffer("topk_weights", "float32", (1, top_k))
        y = b.buffer("y", "bfloat16", (1, latent))
        if mxfp4:
            w2, s2 = b.weight("w2_packed", "uint8", (experts, latent, inter // 2)), b.weight("w2_scale", "uint8", (experts, latent, inter // 32))
            b.expert_combine(x, ids, tw, y, w2, scale=s2, row_tiles=ctas)
            weight_bytes = top_k * latent * (inter // 2 + inter // 32)
        else:
            b.expert_combine(x, ids, tw, y, b.weight("w2", "bfloat16", (experts, latent, inter)), row_tiles=ctas)
            weight_bytes = top_k * latent * inter * 2

        def inputs(gen, weights, step):
            return {"x": _randn(gen, (1, top_k, inter), "cpu").to(torch.bfloat16), "ids": _distinct_ids(gen, 1, top_k, experts, "cpu"),
                    "topk_weights": torch.rand((1, top_k), generator=gen) / top_k}  # fmt: skip

    name = f"bench_expert_{form}_{'mxfp4' if mxfp4 else 'bf16'}_k3" + (f"_b{batch}" if batch > 1 else "")
    return MoeMlaCase(name, b, "bench", default_weights(b, (118, 122)), inputs, outputs=["y"],
                      meta={"weight_bytes": weight_bytes, "expert_bytes": weight_bytes // top_k, "form": form})  # fmt: skip


def moe_mla_cases() -> list[MoeMlaCase]:
    return [
        router_case("router_b4_norm", 4, 1032, 264, 8, norm=True, renormalize=True, scaling=1.0),
        router_case("router_b1", 1, 520, 133, 6, norm=False, renormalize=False, scaling=2.446),
        router_ties_case(),
        router_ties_case("router_ties_tiled_b1", 1, tiles=3),
        # the router GEMV's tiles select where it finishes (GemvParams "router"): Kimi Linear's 256 experts over 5 of 8
        # CTAs, K3's 896 at batch 4 over 7 tiles on 4 CTAs (two tiles on a CTA)
        router_case("router_tiled_b1_norm", 1, 2304, 256, 8, norm=True, renormalize=True, scaling=2.446, tiles=5, ctas=8),
        router_case("router_tiled_b4", 4, 1032, 896, 8, norm=False, renormalize=False, scaling=1.0, tiles=7, ctas=4),
        router_case("router_tiled_b1_k3", 1, 1032, 896, 16, norm=False, renormalize=True, scaling=2.5, tiles=7, ctas=4),
        expert_gated_case("expert_gated_bf16_silu_b4", 4, 520, 264, 7, 3, "bfloat16", "silu", row_tiles=3, ctas=5),
        expert_gated_case("expert_gated_bf16_situ_b1", 1, 264, 136, 5, 2, "bfloat16", "situ", row_tiles=2, ctas=3),
        # batch > 1 streams the step's distinct experts once each (ir/streaming.py routing_units): every request on the
        # same experts in its own slot order; 48 routing pairs (two registers of the warp's grouping, expert_units.py.j2)
        expert_gated_case("expert_gated_bf16_silu_b4_same", 4, 520, 264, 7, 3, "bfloat16", "silu", row_tiles=3, ctas=5, same_experts=True),
        expert_gated_case("expert_gated_bf16_silu_b4_k12", 4, 264, 136, 20, 12, "bfloat16", "silu", row_tiles=2, ctas=6),
        expert_gated_case("expert_gated_mxfp4_situ_b4_same", 4, 544, 208, 9, 4, "mxfp4", "situ", row_tiles=2, ctas=3, same_experts=True),
        # 8 requests on one expert: two passes over each fill, 4 requests each (expert_gated.py.j2: MXFP4, in the MMA's
        # columns; bf16, 4 accumulator chains); bf16 with 3 requests past the first pass on some experts
        expert_gated_case("expert_gated_mxfp4_silu_b8_same", 8, 256, 72, 6, 3, "mxfp4", "silu", row_tiles=2, ctas=3, same_experts=True),
        expert_gated_case("expert_gated_bf16_situ_b8_same", 8, 2304, 72, 6, 3, "bfloat16", "situ", row_tiles=2, ctas=3, same_experts=True),
        expert_gated_case("expert_gated_bf16_silu_b8", 8, 2304, 72, 6, 3, "bfloat16", "silu", row_tiles=2, ctas=3),
        # rows cut into 2 chunks (18 KB gated rows), 36 rows x 4 requests per task: rounds of 8 units, chunk by chunk,
        # the last round short (ir/streaming.py chunk_major)
        expert_gated_case("expert_gated_bf16_silu_b4_chunked", 4, 4608, 72, 5, 2, "bfloat16", "silu", row_tiles=2, ctas=2),
        # MXFP4 rows of odd group counts (17, 7 scale bytes); an expert's scale block stays a multiple of 16 bytes,
        # which the streaming ring's bulk copies need (ir/streaming.py fill_plan)
        expert_gated_case("expert_gated_mxfp4_situ_b1", 1, 544, 208, 9, 4, "mxfp4", "situ", row_tiles=2, ctas=3),
        expert_gated_case("expert_gated_mxfp4_silu_b4", 4, 256, 72, 5, 2, "mxfp4", "silu", row_tiles=2, ctas=4),
        expert_combine_case("expert_combine_bf16_b4", 4, 264, 520, 7, 3, "bfloat16", row_tiles=5, ctas=4),
        # Kimi Linear's MoE output: the shared expert's output and the residual stream added in the epilogue
        expert_combine_case("expert_combine_bf16_residuals_b2", 2, 264, 520, 7, 3, "bfloat16", row_tiles=5, ctas=4, residuals=2),
        # batch > 1: each expert streamed once per round of 8 (request, slot) pairs, the warps holding its pairs read the one
        # fill (ir/streaming.py combine_rounds): all requests on the same experts; 48 pairs of 20 experts (experts
        # straddle rounds, two registers of the grouping); 8 requests on each of 4 MXFP4 experts (one expert per round)
        expert_combine_case("expert_combine_bf16_b4_same", 4, 264, 520, 7, 3, "bfloat16", row_tiles=5, ctas=4, same_experts=True),
        expert_combine_case("expert_combine_bf16_residuals_b4_k12", 4, 264, 520, 20, 12, "bfloat16", row_tiles=5, ctas=4, residuals=2),
        expert_combine_case("expert_combine_mxfp4_b8_same", 8, 224, 144, 9, 4, "mxfp4", row_tiles=4, ctas=4, same_experts=True),
        # requests that seldom share experts (96 of them, 12 slots: not grouped), each warp prefetching its next input
        # (codegen/ops.py combine_prefetches): the next round's slot (the second round holds 4 of the 8 warps), the next
        # batch of row groups', the next request's; and at batch 1 with more slots than warps
        expert_combine_case("expert_combine_bf16_b2_spread", 2, 264, 520, 96, 12, "bfloat16", row_tiles=2, ctas=2, residuals=1),
        expert_combine_case("expert_combine_mxfp4_b2_spread", 2, 224, 272, 96, 12, "mxfp4", row_tiles=2, ctas=2),
        expert_combine_case("expert_combine_bf16_b1_k12", 1, 264, 520, 20, 12, "bfloat16", row_tiles=3, ctas=3),
        expert_combine_case("expert_combine_mxfp4_residual_b1", 1, 224, 272, 9, 4, "mxfp4", row_tiles=3, ctas=3, residuals=1),
        # 16 tokens (--max-tokens 16): the router, both expert kinds in both formats (64 routing pairs), MLA decode
        router_case("router_b16_norm", 16, 1032, 264, 8, norm=True, renormalize=True, scaling=1.0),
        expert_gated_case("expert_gated_bf16_silu_b16", 16, 520, 136, 24, 4, "bfloat16", "silu", row_tiles=2, ctas=4),
        # 16 requests on each expert: four passes of 4 over each fill
        expert_gated_case("expert_gated_bf16_situ_b16_same", 16, 520, 136, 24, 4, "bfloat16", "situ", row_tiles=2, ctas=4, same_experts=True),
        expert_gated_case("expert_gated_mxfp4_situ_b16", 16, 544, 208, 9, 4, "mxfp4", "situ", row_tiles=2, ctas=3),
        expert_combine_case("expert_combine_bf16_residuals_b16", 16, 264, 520, 20, 4, "bfloat16", row_tiles=5, ctas=4, residuals=2),
        expert_combine_case("expert_combine_mxfp4_b16", 16, 224, 144, 9, 4, "mxfp4", row_tiles=4, ctas=4),
        # 16.5 KB rows in 2 chunks, 9 slots: a round of 8 slots and a round of 1, chunk by chunk
        expert_combine_case("expert_combine_bf16_b2_chunked", 2, 8448, 40, 11, 9, "bfloat16", row_tiles=2, ctas=2),
        expert_combine_case("expert_combine_mxfp4_b1", 1, 224, 272, 9, 4, "mxfp4", row_tiles=3, ctas=3),
        expert_combine_case("expert_combine_mxfp4_b4", 4, 224, 144, 9, 4, "mxfp4", row_tiles=4, ctas=4),
        # the ends of the scale range the MXFP4 decode takes exactly (mxfp4_dot.py.j2: bytes 10..136)
        expert_combine_case("expert_combine_mxfp4_low_scales_b1", 1, 224, 144, 9, 4, "mxfp4", row_tiles=2, ctas=2, scale_range=(10, 16)),
        expert_combine_case("expert_combine_mxfp4_high_scales_b1", 1, 224, 144, 9, 4, "mxfp4", row_tiles=2, ctas=2, scale_range=(130, 136)),
        moe_graph_case(),
        moe_graph_case(router_tiles=3),
        mla_case("mla_k3dims_b1", 1, 5, 512, 64, 128, 128, 700, 6, 32, 4, ctas=8),
        mla_case("mla_odd_b4", 4, 3, 136, 24, 40, 24, 157, 3, 16, 2, ctas=6),
        mla_case("mla_k3dims_b1_tiles", 1, 5, 512, 64, 128, 128, 700, 6, 32, 4, ctas=8, value_tiles=4, column_tiles=4),
        # q_absorb's 72 columns: 9 column vectors, 28 row slices (252 of 256 threads)
        mla_case("mla_odd_b4_tiles", 4, 3, 144, 16, 40, 24, 157, 3, 16, 2, ctas=6, value_tiles=2, column_tiles=2),
        mla_case("mla_odd_b16", 16, 3, 136, 24, 40, 24, 157, 3, 16, 2, ctas=6),
        # K3 MLA at T = 8192, batch 1: 96 heads; decode = 22 chunks x 6 groups of 16 heads = 132 tasks.
        mla_case("bench_mla_k3_t8192", 1, 96, 512, 64, 128, 128, 8192, 22, 64, 16, ctas=132, head_tiles=48, bench=True),
        bench_expert_case("gated"),
        bench_expert_case("combine"),
        bench_expert_case("gated", mxfp4=False),
        bench_expert_case("combine", mxfp4=False),
        # the bf16 proxy's gated experts at batch 8 (64 experts, top-16, requests routed independently: ~58 distinct)
        bench_expert_case("gated", mxfp4=False, experts=64, batch=8),
    ]
