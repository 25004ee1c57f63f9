"""The fusion pass (passes/fuse.py and its rules passes/fuse_*.py) and the fused op kinds (ir/fused.py).

- the interpreter on the fused graph computes what it computes on the captured graph (k3-tiny and a
  Kimi-Linear-shaped config, batch 1 and 4, float32, random weights, state and positions), also after
  tensor-parallel sharding;
- every fusion the design needs fires on k3-tiny (a missing one fails by name), nothing unfused is left;
- each fused op equals the composition of the unfused ops on random inputs with odd shapes (bit for bit,
  in float32 and bfloat16), except the absorbed MLA, which matches mla_attention to float rounding;
- the tiling contract the docstrings of ir/fused.py state: a tile's slice of the operands computes the
  tile's slice of the result.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from k3mk.compiler.capture import capture
from k3mk.compiler.config import load_config
from k3mk.compiler.random_weights import random_weights
from k3mk.compiler.weights import state_specs
from k3mk.ir import fused as F
from k3mk.ir.graph import Graph
from k3mk.ir.interpreter import run
from k3mk.ir.ops import (
    Add,
    ExpertLinear,
    ExpertLinearMXFP4,
    GatedRMSNorm,
    KDAGate,
    Linear,
    MLAAttention,
    MoECombine,
    RMSNorm,
    RouterTopK,
    SigmoidGate,
    SiluMul,
    SituMul,
)
from k3mk.passes.fuse import fuse
from k3mk.passes.fuse_mla import fuse_mla
from k3mk.passes.manager import Target, run_pipeline

MAX_CONTEXT = 16
F32, BF16 = torch.float32, torch.bfloat16


CONFIGS = {"k3-tiny": lambda: load_config("k3-tiny"), "kimi-linear-small": lambda: load_config("kimi-linear-tiny")}


@functools.cache
def captured(config_name: str, batch: int) -> Graph:
    return capture(CONFIGS[config_name](), batch, MAX_CONTEXT, F32)


@functools.cache
def weights(config_name: str) -> dict[str, torch.Tensor]:
    return random_weights(CONFIGS[config_name](), 0, F32, "cpu")


def random_values(config_name: str, batch: int, seed: int) -> dict[str, torch.Tensor]:
    """The config's random weights, token ids, positions anywhere in the cache, and a random decode state."""
    config = CONFIGS[config_name]()
    gen = torch.Generator().manual_seed(seed)
    values = dict(weights(config_name))
    values["token_ids"] = torch.randint(0, config.vocab_size, (batch,), generator=gen)
    values["positions"] = torch.randint(0, MAX_CONTEXT, (batch,), generator=gen)
    for s in state_specs(config, batch, MAX_CONTEXT):
        scale = 0.1 if s.name.endswith("recurrent_state") else 1.0
        values[s.name] = scale * torch.randn(s.shape, generator=gen)
    return values


def relative(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def assert_same_step(out: dict, ref: dict, tolerance: float = 1e-5) -> None:
    assert out.keys() == ref.keys()
    assert relative(out["logits"], ref["logits"]) < tolerance
    assert torch.equal(out["next_tokens"], ref["next_tokens"])
    for name in ref:
        if name not in ("logits", "next_tokens"):
            assert relative(out[name], ref[name]) < tolerance, name


# --- (a) the fused graph computes the captured graph ---------------------------------------------------


@pytest.mark.parametrize("config_name", CONFIGS)
@pytest.mark.parametrize("batch", [1, 4])
def test_fused_graph_matches_captured_graph(config_name, batch):
    config, graph = CONFIGS[config_name](), captured(config_name, batch)
    fused = fuse(graph, Target(config))
    fused.verify()
    values = random_values(config_name, batch, seed=batch)
    assert_same_step(run(fused, values), run(graph, values))


def test_fused_graph_runs_in_the_pass_manager():
    config = load_config("k3-tiny")
    result = run_pipeline(captured("k3-tiny", 1), Target(config), [fuse])  # verifies after the pass
    assert result.output.meta["fusions"]


def test_fusion_leaves_the_input_graph_alone():
    graph = captured("k3-tiny", 1)
    before = graph.text()
    fuse(graph, Target(load_config("k3-tiny")))
    assert graph.text() == before


def test_fusing_twice_changes_nothing():
    target = Target(load_config("k3-tiny"))
    once = fuse(captured("k3-tiny", 1), target)
    assert fuse(once, target).text() == once.text()


# --- (b) which fusions fire ------------------------------------------------------------------------------

# k3-tiny: 8 layers (KDA 0-2, 4-6; MLA 3, 7), dense FFN in layer 0, MoE with MXFP4 experts and one
# shared expert in layers 1-7 (spec 11.1).
K3_TINY_FUSIONS = {
    "mla_attention->mla_q_absorb+mla_decode+mla_v_up": 2,
    "linear+linear+act->gated_linear": 8,  # dense layer 0 + 7 shared experts
    "expert_linear_mxfp4 w1+w3+act->expert_gated_linear_mxfp4": 7,
    "expert_linear_mxfp4 w2+moe_combine->expert_linear_mxfp4_combine": 7,
    "linear+kda_gate->linear_kda_gate": 6,
    "linear+gated_rmsnorm->linear_gated_rmsnorm": 6,
    "linear+sigmoid_gate->linear_sigmoid_gate": 2,
    "linear+router_topk->router": 7,
    "rmsnorm->linear": 51,
    "rmsnorm->gated_linear": 8,
    "rmsnorm->router": 7,
    "rmsnorm->linear_gated_rmsnorm": 6,
    "rmsnorm->linear_sigmoid_gate": 2,
    "add->linear_residual": 20,
}


def fusion_counts(graph: Graph) -> dict[str, int]:
    return {pattern: int(count) for pattern, _, count in (f.rpartition(" x ") for f in graph.meta["fusions"])}


def test_every_expected_fusion_fires_on_k3_tiny():
    fused = fuse(captured("k3-tiny", 4), Target(load_config("k3-tiny")))
    counts = fusion_counts(fused)
    missing = sorted(set(K3_TINY_FUSIONS) - set(counts))
    assert not missing, f"fusions that did not fire: {missing}"
    assert counts == K3_TINY_FUSIONS
    left = {n.op.name for n in fused.nodes} & {
        "rmsnorm", "situ_mul", "silu_mul", "kda_gate", "gated_rmsnorm", "sigmoid_gate", "router_topk",
        "moe_combine", "mla_attention", "expert_linear_mxfp4", "add",
    }
    assert not left, f"unfused ops left: {left}"


def test_a_norm_too_wide_to_stage_keeps_its_task(monkeypatch):
    """The rmsnorm prologue normalises a staged copy of its input: where batch x hidden bf16 exceeds the budget (K3's 7168
    at 16 tokens), the norm stays a task and its readers read y. Budget set between k3-tiny's batch 2 and 4."""
    import k3mk.passes.fuse_norm as fuse_norm

    hidden = load_config("k3-tiny").hidden_size
    monkeypatch.setattr(fuse_norm, "X_SMEM_BUDGET", 3 * hidden * 2)
    target = Target(load_config("k3-tiny"))
    assert {k: v for k, v in fusion_counts(fuse(captured("k3-tiny", 1), target)).items() if k.startswith("rmsnorm->")} == {
        k: v for k, v in K3_TINY_FUSIONS.items() if k.startswith("rmsnorm->")}  # fmt: skip
    graph = captured("k3-tiny", 4)
    fused = fuse(graph, target)
    fused.verify()
    def wide_norms(g: Graph) -> int:
        return sum(isinstance(n.op, RMSNorm) and g.tensors[n.inputs[0]].shape[-1] == hidden for n in g.nodes)

    assert wide_norms(graph) > 0 and wide_norms(fused) == wide_norms(graph)  # the narrower MLA norms still fuse
    values = random_values("k3-tiny", 4, seed=11)
    assert_same_step(run(fused, values), run(graph, values))


def test_kimi_linear_moe_adds_go_to_the_routed_combine():
    """Routed + shared and the residual stream add land on the routed combine (the end of the layer's
    critical path); the shared expert's down projection is a plain GEMV beside the routed experts."""
    fused = fuse(captured("kimi-linear-small", 1), Target(load_config("kimi-linear-tiny")))
    combines = [n for n in fused.nodes if n.op.name == "expert_linear_combine"]
    assert len(combines) == 3 and fusion_counts(fused)["add->expert_linear_combine"] == 6
    producers = {o: n for n in fused.nodes for o in n.outputs}
    for c in combines:
        shared, stream = c.inputs[:2]
        assert c.op.num_list_inputs(len(c.inputs)) == 2
        assert producers[shared].op.name == "linear" and "shared_experts.down_proj" in producers[shared].inputs[-1]
        assert producers[stream].op.name == "linear_residual"  # the attention block's o_proj + residual


def test_kimi_linear_keeps_the_norm_its_experts_read():
    fused = fuse(captured("kimi-linear-small", 1), Target(load_config("kimi-linear-tiny")))
    norms = [n for n in fused.nodes if isinstance(n.op, RMSNorm)]
    consumers = fused.consumers()
    assert len(norms) == 3  # one per MoE layer
    for norm in norms:
        assert {c.op.name for c in consumers[norm.outputs[0]]} == {"expert_gated_linear"}
    assert "linear+sigmoid_gate->linear_sigmoid_gate" not in fusion_counts(fused)  # no MLA output gate


def test_mla_kv_split_is_sized_by_partials_and_sms():
    decode = next(n.op for n in fuse(captured("k3-tiny", 4), Target(load_config("k3-tiny"))).nodes if n.op.name == "mla_decode")
    # 4 heads x rank 128 x 4 B of partials per chunk = 4 fp32 cache rows of 160 -> 4 rows per chunk
    assert (decode.num_chunks, decode.min_chunk_rows) == (4, 4)
    few_sms = next(n.op for n in fuse(captured("k3-tiny", 4), Target(load_config("k3-tiny"), num_sms=8)).nodes if n.op.name == "mla_decode")
    assert few_sms.num_chunks == 2  # ceil(8 SMs / 4 requests)


# --- tensor parallelism ----------------------------------------------------------------------------------


def test_fusion_after_tp2_sharding_keeps_the_collectives_and_the_numerics():
    tp_shard = pytest.importorskip("k3mk.passes.tp_shard", reason="passes/tp_shard.py is not written yet").tp_shard
    ranks = pytest.importorskip("k3mk.ir.ranks", reason="ir/ranks.py is not written yet")
    config = load_config("k3-tiny")
    target = Target(config, tp=2)
    sharded = tp_shard(captured("k3-tiny", 4), target)
    fused = fuse(sharded, target)
    fused.verify()
    collectives = lambda g: sorted(n.name for n in g.nodes if n.op.name in ("all_reduce", "all_gather"))  # noqa: E731
    assert collectives(fused) == collectives(sharded)
    counts = fusion_counts(fused)
    for pattern in ("mla_attention->mla_q_absorb+mla_decode+mla_v_up", "linear+linear+act->gated_linear", "linear+router_topk->router", "rmsnorm->linear"):
        assert pattern in counts, pattern
    values = random_values("k3-tiny", 4, seed=7)
    assert_same_step(ranks.run(fused, values), ranks.run(sharded, values))


# --- (c) each fused op is the composition of the unfused ops ----------------------------------------------

B, IN, OUT, EPS = 3, 37, 29, 1e-5


def rand(*shape: int, dtype=F32, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).to(dtype)


def gain(n: int, dtype=F32, seed: int = 0) -> torch.Tensor:
    return 1.0 + rand(n, dtype=F32, seed=seed, scale=0.1).to(dtype)


def mxfp4(e: int, out: int, inp: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (e, out, inp // 2), generator=gen, dtype=torch.uint8)
    scale = torch.randint(121, 125, (e, out, inp // 32), generator=gen).to(torch.uint8)
    return packed, scale


def ev(op, *inputs):
    out = op.evaluate(*inputs)
    return out if len(out) > 1 else out[0]


def one(op, *inputs):
    return op.evaluate(*inputs)[0]


def prologue(x, nw, with_norm: bool):
    """(the fused op's norm_eps, its leading operands, the unfused GEMV's input)"""
    return (EPS, (x, nw), one(RMSNorm(EPS), x, nw)) if with_norm else (None, (x,), x)


def case_rmsnorm_linear(dt):
    x, nw, w = rand(B, IN, dtype=dt), gain(IN, dt), rand(OUT, IN, dtype=dt, seed=1, scale=0.2)
    results = []
    for fp32 in (False, True):
        results.append((ev(F.RMSNormLinear(EPS, fp32), x, nw, w), one(Linear(fp32), one(RMSNorm(EPS), x, nw), w)))
    return results


def case_gated_linear(dt, with_norm):
    x, nw, wg, wu = rand(B, IN, dtype=dt), gain(IN, dt), rand(OUT, IN, dtype=dt, seed=1), rand(OUT, IN, dtype=dt, seed=2)
    norm_eps, lead, xn = prologue(x, nw, with_norm)
    results = []
    for act in (SiluMul(), SituMul(4.0, 25.0), SituMul(2.0, None)):
        fused = ev(F.GatedLinear(norm_eps, act), *lead, wg, wu)
        results.append((fused, one(act, one(Linear(False), xn, wg), one(Linear(False), xn, wu))))
    return results


def case_linear_residual(dt):
    x, w = rand(B, IN, dtype=dt), rand(OUT, IN, dtype=dt, seed=1)
    residuals = [rand(B, OUT, dtype=dt, seed=10 + i) for i in range(3)]
    results = []
    for n in (1, 2, 3):
        ref = one(Linear(False), x, w)
        for r in residuals[:n]:
            ref = one(Add(), r, ref)
        results.append((ev(F.LinearResidual(), *residuals[:n], x, w), ref))
    return results


def case_linear_sigmoid_gate(dt, with_norm):
    x, nw, w, o = rand(B, IN, dtype=dt), gain(IN, dt), rand(OUT, IN, dtype=dt, seed=1), rand(B, OUT, dtype=dt, seed=2)
    norm_eps, lead, xn = prologue(x, nw, with_norm)
    fused = ev(F.LinearSigmoidGate(norm_eps), *lead, w, o)
    return [(fused, one(SigmoidGate(), o, one(Linear(False), xn, w)))]


def case_linear_kda_gate(dt, with_norm):
    h, d = 3, 7
    x, nw, w = rand(B, IN, dtype=dt), gain(IN, dt), rand(h * d, IN, dtype=dt, seed=1)
    a_log, dt_bias = rand(h, seed=2, scale=0.3), rand(h * d, seed=3) - 2.0
    norm_eps, lead, xn = prologue(x, nw, with_norm)
    results = []
    for lower_bound in (-5.0, None):
        fused = ev(F.LinearKDAGate(norm_eps, h, lower_bound), *lead, w, a_log, dt_bias)
        results.append((fused, one(KDAGate(h, lower_bound), one(Linear(False), xn, w), a_log, dt_bias)))
    return results


def case_linear_gated_rmsnorm(dt, with_norm):
    h, d = 3, 7
    x, nw, w = rand(B, IN, dtype=dt), gain(IN, dt), rand(h * d, IN, dtype=dt, seed=1)
    o, o_norm = rand(B, h * d, dtype=dt, seed=2), gain(d, F32, seed=3)
    norm_eps, lead, xn = prologue(x, nw, with_norm)
    fused = ev(F.LinearGatedRMSNorm(norm_eps, d, EPS), *lead, w, o, o_norm)
    return [(fused, one(GatedRMSNorm(d, EPS), o, one(Linear(False), xn, w), o_norm))]


def case_router(dt, with_norm):
    e = 13
    x, nw, w, bias = rand(B, IN, dtype=dt), gain(IN, dt), rand(e, IN, dtype=dt, seed=1), rand(e, seed=2, scale=0.1)
    norm_eps, lead, xn = prologue(x, nw, with_norm)
    results = []
    for top_k, renormalize, scaling in ((3, True, 1.0), (4, False, 2.446), (1, True, 1.0)):
        fused = ev(F.Router(norm_eps, top_k, renormalize, scaling), *lead, w, bias)
        results.append((fused, ev(RouterTopK(top_k, renormalize, scaling), one(Linear(True), xn, w), bias)))
    return results


E, K, LATENT, INTER = 5, 3, 64, 33  # MXFP4 needs inputs in groups of 32


def routing(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(seed + b))[:K] for b in range(B)]).to(torch.int32)
    return ids, torch.rand(B, K, generator=torch.Generator().manual_seed(seed))


def case_expert_gated_linear(dt):
    z, (ids, _) = rand(B, LATENT, dtype=dt), routing(1)
    w1, w3 = rand(E, INTER, LATENT, dtype=dt, seed=2), rand(E, INTER, LATENT, dtype=dt, seed=3)
    act = SituMul(4.0, 25.0)
    results = [(ev(F.ExpertGatedLinear(act), z, w1, w3, ids), one(act, one(ExpertLinear(), z, w1, ids), one(ExpertLinear(), z, w3, ids)))]
    (p1, s1), (p3, s3) = mxfp4(E, INTER, LATENT, 4), mxfp4(E, INTER, LATENT, 5)
    fused = ev(F.ExpertGatedLinearMXFP4(act), z, p1, s1, p3, s3, ids)
    results.append((fused, one(act, one(ExpertLinearMXFP4(), z, p1, s1, ids), one(ExpertLinearMXFP4(), z, p3, s3, ids))))
    return results


def case_expert_linear_combine(dt):
    a, (ids, weights) = rand(B, K, 64, dtype=dt), routing(1)
    w2 = rand(E, 31, 64, dtype=dt, seed=2)
    combine = one(MoECombine(), one(ExpertLinear(), a, w2, ids), weights)
    results = [(ev(F.ExpertLinearCombine(), a, w2, ids, weights), combine)]
    # the MoE "+ shared" and the residual stream add in its epilogue (fuse_residual), one rounding each
    shared, stream = rand(B, 31, dtype=dt, seed=4), rand(B, 31, dtype=dt, seed=5)
    results.append((ev(F.ExpertLinearCombine(), shared, stream, a, w2, ids, weights), one(Add(), stream, one(Add(), combine, shared))))
    packed, scale = mxfp4(E, 31, 64, 3)
    fused = ev(F.ExpertLinearMXFP4Combine(), a, packed, scale, ids, weights)
    results.append((fused, one(MoECombine(), one(ExpertLinearMXFP4(), a, packed, scale, ids), weights)))
    results.append((ev(F.ExpertLinearMXFP4Combine(), shared, a, packed, scale, ids, weights), one(Add(), fused, shared)))
    return results


# kinds with a norm prologue run with and without it; the others have a fixed operand list
PROLOGUE_CASES = [case_gated_linear, case_linear_sigmoid_gate, case_linear_kda_gate, case_linear_gated_rmsnorm, case_router]
FIXED_CASES = [case_rmsnorm_linear, case_linear_residual, case_expert_gated_linear, case_expert_linear_combine]
CASES = FIXED_CASES + [functools.partial(c, with_norm=n) for c in PROLOGUE_CASES for n in (False, True)]


def case_id(case) -> str:
    name = getattr(case, "func", case).__name__.removeprefix("case_")
    return f"{name}-{'norm' if case.keywords['with_norm'] else 'plain'}" if isinstance(case, functools.partial) else name


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_fused_op_is_the_composition_bit_for_bit(case, dtype):
    for fused, ref in case(dtype):
        for f, r in zip(fused if isinstance(fused, tuple) else (fused,), ref if isinstance(ref, tuple) else (ref,)):
            assert f.dtype == r.dtype and f.shape == r.shape
            assert torch.equal(f, r)


# --- the absorbed MLA -------------------------------------------------------------------------------------

H, NOPE, ROPE, V, RANK, T = 3, 5, 3, 7, 11, 13


def mla_inputs(dtype, bsz=5, seed=0):
    q = rand(bsz, H * (NOPE + ROPE), dtype=dtype, seed=seed)
    cache = rand(bsz, T, RANK + ROPE, dtype=dtype, seed=seed + 1)
    kv_b = rand(H * (NOPE + V), RANK, dtype=dtype, seed=seed + 2, scale=RANK**-0.5)
    positions = torch.tensor([0, T - 1, 5, 1, 8][:bsz])
    return q, cache, positions, kv_b


def absorbed(q, cache, positions, kv_b, num_chunks, min_rows):
    q_abs = one(F.MLAQAbsorb(H, NOPE, V), q, kv_b)
    o, lse = ev(F.MLADecode(RANK, num_chunks, min_rows, (NOPE + ROPE) ** -0.5), q_abs, cache, positions)
    return one(F.MLAVUp(H, NOPE, V), o, lse, kv_b)


@pytest.mark.parametrize("num_chunks,min_rows", [(1, 1), (2, 1), (3, 2), (5, 1), (4, 4), (13, 1), (20, 1)])
@pytest.mark.parametrize("dtype,tolerance", [(F32, 1e-5), (BF16, 2e-2)], ids=["f32", "bf16"])
def test_absorbed_mla_matches_naive_attention(num_chunks, min_rows, dtype, tolerance):
    q, cache, positions, kv_b = mla_inputs(dtype)
    ref = one(MLAAttention(H, NOPE, ROPE, V, RANK), q, cache, positions, kv_b)
    out = absorbed(q, cache, positions, kv_b, num_chunks, min_rows)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert relative(out, ref) < tolerance


def test_absorbed_mla_ignores_rows_past_the_position():
    q, cache, positions, kv_b = mla_inputs(F32)
    junk = cache.clone()
    for b, p in enumerate(positions.tolist()):
        junk[b, p + 1 :] = 1e4
    assert torch.equal(absorbed(q, cache, positions, kv_b, 3, 1), absorbed(q, junk, positions, kv_b, 3, 1))


@pytest.mark.parametrize("num_chunks", [1, 2, 3, 5, 7])
@pytest.mark.parametrize("min_rows", [1, 2, 5])
def test_kv_chunks_tile_the_valid_rows(num_chunks, min_rows):
    positions = torch.arange(40)
    start, end = F.kv_chunk_bounds(positions, num_chunks, min_rows)
    for b, n in enumerate((positions + 1).tolist()):
        assert start[b, 0] == 0 and end[b, -1] == n and torch.equal(start[b, 1:], end[b, :-1])
        sizes = [s for s in (end[b] - start[b]).tolist() if s]  # empty chunks only at the end
        assert sizes == (end[b] - start[b]).tolist()[: len(sizes)]
        length = max(math.ceil(n / num_chunks), min_rows)
        assert all(s == length for s in sizes[:-1]) and 0 < sizes[-1] <= length


def test_empty_kv_chunks_give_zero_and_minus_infinity():
    q, cache, positions, kv_b = mla_inputs(F32)
    q_abs = one(F.MLAQAbsorb(H, NOPE, V), q, kv_b)
    o, lse = ev(F.MLADecode(RANK, 6, 2, 0.3), q_abs, cache, positions)
    start, end = F.kv_chunk_bounds(positions, 6, 2)
    empty = end == start  # position 0: one row, chunks 1..5 empty
    assert empty[0, 1:].all() and not empty[:, 0].any()
    assert torch.isneginf(lse[empty]).all() and torch.isfinite(lse[~empty]).all()
    assert (o[empty] == 0).all()


# --- the tiling contract of ir/fused.py -------------------------------------------------------------------


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_linear_family_tiles_by_output_rows():
    x, nw, res = rand(B, IN), gain(IN), rand(B, OUT, seed=9)
    w, w2, o = rand(OUT, IN, seed=1), rand(OUT, IN, seed=2), rand(B, OUT, seed=3)
    rows = slice(7, 19)
    close(ev(F.RMSNormLinear(EPS, False), x, nw, w[rows]), ev(F.RMSNormLinear(EPS, False), x, nw, w)[:, rows])
    gated = F.GatedLinear(EPS, SituMul(4.0, 25.0))
    close(ev(gated, x, nw, w[rows], w2[rows]), ev(gated, x, nw, w, w2)[:, rows])
    close(ev(F.LinearResidual(), res[:, rows], x, w[rows]), ev(F.LinearResidual(), res, x, w)[:, rows])
    gate = F.LinearSigmoidGate(EPS)
    close(ev(gate, x, nw, w[rows], o[:, rows]), ev(gate, x, nw, w, o)[:, rows])


def test_head_epilogues_tile_by_whole_heads():
    h, d = 4, 6
    x, nw, w = rand(B, IN), gain(IN), rand(h * d, IN, seed=1)
    a_log, dt_bias, o, o_norm = rand(h, seed=2), rand(h * d, seed=3), rand(B, h * d, seed=4), gain(d, seed=5)
    heads, rows = slice(1, 3), slice(d, 3 * d)
    full = ev(F.LinearKDAGate(EPS, h, -5.0), x, nw, w, a_log, dt_bias)
    close(ev(F.LinearKDAGate(EPS, 2, -5.0), x, nw, w[rows], a_log[heads], dt_bias[rows]), full[:, heads])
    part = slice(d + 2, d + 5)  # rows inside one head: a [B, 1, 3] box
    close(ev(F.LinearKDAGate(EPS, 1, -5.0), x, nw, w[part], a_log[1:2], dt_bias[part]), full[:, 1:2, 2:5])
    norm = F.LinearGatedRMSNorm(EPS, d, EPS)
    close(ev(norm, x, nw, w[rows], o[:, rows], o_norm), ev(norm, x, nw, w, o, o_norm)[:, rows])


def test_expert_ops_tile_by_rows_and_slots():
    z, (ids, weights) = rand(B, LATENT), routing(1)
    w1, w3, w2 = rand(E, INTER, LATENT, seed=2), rand(E, INTER, LATENT, seed=3), rand(E, 31, INTER, seed=4)
    gated = F.ExpertGatedLinear(SiluMul())
    full = ev(gated, z, w1, w3, ids)
    close(ev(gated, z, w1[:, 5:20], w3[:, 5:20], ids), full[:, :, 5:20])
    close(ev(gated, z, w1, w3, ids[:, 1:2]), full[:, 1:2])
    a = full
    close(ev(F.ExpertLinearCombine(), a, w2[:, 3:17], ids, weights), ev(F.ExpertLinearCombine(), a, w2, ids, weights)[:, 3:17])


def test_mla_pieces_tile_by_heads_and_requests():
    q, cache, positions, kv_b = mla_inputs(F32)
    per_head_q, per_head_kv = NOPE + ROPE, NOPE + V
    heads = slice(1, 3)
    q_abs = one(F.MLAQAbsorb(H, NOPE, V), q, kv_b)
    q_part = q[:, heads.start * per_head_q : heads.stop * per_head_q]
    kv_part = kv_b[heads.start * per_head_kv : heads.stop * per_head_kv]
    close(one(F.MLAQAbsorb(2, NOPE, V), q_part, kv_part), q_abs[:, heads])
    decode = F.MLADecode(RANK, 3, 2, 0.3)
    o, lse = ev(decode, q_abs, cache, positions)
    o_h, lse_h = ev(decode, q_abs[:, heads], cache, positions)
    close(o_h, o[:, :, heads])
    close(lse_h, lse[:, :, heads])
    o_b, lse_b = ev(decode, q_abs[2:3], cache[2:3], positions[2:3])
    close(o_b, o[2:3])
    close(lse_b, lse[2:3])
    full = one(F.MLAVUp(H, NOPE, V), o, lse, kv_b)
    close(one(F.MLAVUp(2, NOPE, V), o[:, :, heads], lse[:, :, heads], kv_part), full[:, heads.start * V : heads.stop * V])


# --- the MLA rule on its own ------------------------------------------------------------------------------


def test_mla_rule_with_many_chunks_matches_captured_graph():
    graph = captured("k3-tiny", 4)
    absorbed_graph = fuse_mla(graph, 132, split=(7, 1))
    absorbed_graph.verify()
    values = random_values("k3-tiny", 4, seed=3)
    assert_same_step(run(absorbed_graph, values), run(graph, values))
