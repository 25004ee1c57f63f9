"""CPU tests of the MoE and MLA op templates (router, expert_gated, expert_combine, mla_latent,
mla_q_absorb, mla_decode, mla_v_up): their task-table records round-trip, codegen rejects what the
templates cannot do, and every template compiles to an sm_90a cubin (three kernels, each < 20 s on the
2-core build machine) with the expected instructions and no large spills."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from k3mk.codegen.ops import CodegenError
from k3mk.ir.task_table import (
    ExpertCombineParams,
    ExpertGatedParams,
    MlaDecodeParams,
    MlaLatentParams,
    MlaQAbsorbParams,
    MlaVUpParams,
    OpVariant,
    RouterParams,
    RouterTopkParams,
    TaskTable,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from megakernel_cases import all_cases  # noqa: E402

MOE_MLA_CASES = ["router_b4_norm", "router_ties_b2", "expert_gated_mxfp4_situ_b1", "expert_combine_bf16_b4",
                 "moe_graph_b4", "mla_k3dims_b1", "mla_odd_b4", "bench_expert_gated_mxfp4_k3"]  # fmt: skip


@pytest.mark.parametrize("name", MOE_MLA_CASES)
def test_table_round_trip(name):
    table = all_cases()[name].builder.table()
    data = table.encode()
    back = TaskTable.decode(data)
    assert back.encode() == data
    assert back.variants == table.variants


def test_router_is_one_task_and_experts_wait_on_it():
    table = all_cases()["moe_graph_b4"].builder.table()
    tasks = [t for tasks in table.lists for t in tasks]
    ops = [table.variants[t.opcode].op for t in tasks]
    assert ops.count("router") == 1
    router_event = next(t.signal for t, op in zip(tasks, ops) if op == "router")
    assert all(router_event in t.wait for t, op in zip(tasks, ops) if op in ("expert_gated", "expert_combine"))
    assert {t.operands["slot"] for t, op in zip(tasks, ops) if op == "expert_gated" and "slot" in t.operands} == {1, 2, 3}


@pytest.mark.parametrize(
    "variant, message",
    [
        (OpVariant("router", RouterParams(7168, 896, 16, 16)), "split the logits GEMV"),
        (OpVariant("router", RouterParams(100, 64, 1, 4)), "multiple of 8"),
        (OpVariant("router", RouterParams(64, 8, 1, 9)), "top_k 9"),
        (OpVariant("expert_gated", ExpertGatedParams(48, 16, 4, 1, 2, "mxfp4")), "multiple of 32"),
        (OpVariant("expert_gated", ExpertGatedParams(64, 16, 4, 1, 2, activation="gelu")), "activation"),
        (OpVariant("expert_gated", ExpertGatedParams(64, 16, 4, 1, 2, weight_format="fp8")), "weight_format"),
        (OpVariant("expert_combine", ExpertCombineParams(12288, 64, 32, 1, 32)), "expert_combine smem"),  # 8 warps x 12288 x 2 B of staged input
        (OpVariant("mla_latent", MlaLatentParams(500, 64, 16, 1)), "multiples of 8"),
        (OpVariant("mla_decode", MlaDecodeParams(8, 512, 64, 16, 1, 4, 16, 0.1, group_heads=64)), "group_heads 64"),
        (OpVariant("mla_q_absorb", MlaQAbsorbParams(4, 128, 64, 128, 4096, 1)), "kv_lora_rank 4096"),
        (OpVariant("mla_v_up", MlaVUpParams(4, 128, 128, 512, 1, 100)), "num_chunks 100"),
    ],
)
def test_codegen_rejects(variant, message):
    from k3mk.codegen.emit import emit_source

    with pytest.raises(CodegenError, match=message):
        emit_source([variant])


# ---- compiles (CuTe DSL) -------------------------------------------------------------------------------


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("K3MK_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _compile(variants: list[OpVariant]):
    pytest.importorskip("cutlass", reason="compiling needs nvidia-cutlass-dsl (the compile extra)")
    from k3mk.codegen.build import compile_source
    from k3mk.codegen.emit import emit_source

    entry, info = compile_source(emit_source(variants), "sm_90a")
    ptx = (entry / "megakernel.sm_90a.ptx").read_text()
    cubin = (entry / "megakernel.sm_90a.cubin").read_bytes()
    assert cubin[:4] == b"\x7fELF" and ".target sm_90a" in ptx
    assert info["spill_store_bytes"] <= 64, info
    return ptx, info


def test_moe_block_compiles(cache):
    """router (rmsnorm) + MXFP4 gated SiTU experts + MXFP4 w2 combine: the LatentMoE expert path."""
    table = all_cases()["moe_graph_b4"].builder.table()
    ptx, info = _compile(table.variants)
    assert "cp.async.bulk.shared::cluster.global" in ptx  # experts' codes and scales streamed through the ring
    assert "ld.shared.v4" in ptx  # 16-byte packed-code loads from the slots
    assert "ld.shared.b8" in ptx or "ld.shared.u8" in ptx  # UE8M0 scale bytes from the slots
    assert "shfl.sync.bfly" in ptx  # warp reductions and the top-k argmax
    assert ".ftz" not in ptx.replace("ex2.approx.ftz", "").replace("rcp.approx.ftz", "").replace("rsqrt.approx.ftz", "")


def test_bf16_experts_compile(cache):
    ptx, _ = _compile([
        OpVariant("expert_gated", ExpertGatedParams(520, 264, 7, 4, 3, "bfloat16", "silu")),
        OpVariant("expert_gated", ExpertGatedParams(264, 136, 5, 1, 2, "bfloat16", "situ", linear_beta=None)),
        OpVariant("expert_combine", ExpertCombineParams(264, 520, 7, 4, 3, "bfloat16")),
    ])  # fmt: skip
    assert "ld.global.v4" in ptx and "cvt.rn.bf16.f32" in ptx


def test_router_topk_compiles(cache):
    """The register top-k (topk_select.py.j2) at Kimi Linear's 256 / top-8 and K3's 896 / top-16 experts, with
    a ragged last lane group (E = 40); no shared memory, no local-memory spill of the per-lane scores."""
    ptx, info = _compile([
        OpVariant("router_topk", RouterTopkParams(256, 1, 8)),
        OpVariant("router_topk", RouterTopkParams(896, 4, 16, renormalize=False, scaling=2.5)),
        OpVariant("router_topk", RouterTopkParams(40, 3, 5)),
    ])  # fmt: skip
    assert "shfl.sync.bfly" in ptx and info["spill_store_bytes"] == 0, info


def test_mla_decode_path_compiles(cache):
    """latent + cache write, q absorb, chunked decode, LSE merge + W_UV at K3's MLA dims."""
    table = all_cases()["mla_k3dims_b1"].builder.table()
    assert [v.op for v in table.variants] == ["mla_latent", "mla_q_absorb", "mla_decode", "mla_v_up"]
    ptx, _ = _compile(table.variants)
    assert "shfl.sync.idx" in ptx  # probabilities broadcast from the lane that scored the row
    assert "ld.shared.v4" in ptx and "st.global.v4" in ptx


def test_mxfp4_bit_trick_matches_dequant():
    """The templates' decode (mxfp4_dot.py.j2 `pair`), emulated on the bits, equals semantics.dequant_mxfp4
    (low nibble = even index; the group scale is applied after) for every (code j, code j+4) pair."""
    import torch

    from k3mk.ir import semantics

    i = torch.arange(1 << 16, dtype=torch.int64)
    words = i | ((((i << 4) | (i >> 12)) & 0xFFFF) << 16)  # low half: every pattern; high half: it rotated by a nibble
    codes = torch.stack([(words >> (4 * j)) & 0xF for j in range(8)], dim=-1)  # code 8q+j = nibble j
    for j in range(4):
        assert len(set((codes[:, j] * 16 + codes[:, j + 4]).tolist())) == 256
    packed = torch.stack([(words >> (8 * k)) & 0xFF for k in range(4)], dim=-1).to(torch.uint8)
    expect = semantics.dequant_mxfp4(packed, torch.full((packed.shape[0], 1), 127, dtype=torch.uint8), torch.float32)

    def f32(bits: torch.Tensor) -> torch.Tensor:
        return torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32).view(torch.float32).double()

    got = torch.empty_like(expect)
    for j in range(4):
        top = (words << (12 - 4 * j)) & 0xFFFFFFFF
        pair = (top & 0x80008000) | ((top & 0x70007000) >> 6)
        got[:, j] = (f32((pair << 16) & 0xFFFFFFFF) * 2.0**126).float()
        got[:, j + 4] = (f32(pair & 0xFFFF0000) * 2.0**126).float()
    assert torch.equal(got, expect)


def test_mxfp4_mma_fragments_give_the_group_dot():
    """mxfp4_dot.py.j2's ONE m16n8k16 MMA per 32-code group, emulated with the PTX fragment layouts (A row-major:
    lane 4g + t holds a0 = A[g][2t..2t+1], a1 = A[g+8][2t..], a2 = A[g][2t+8..], a3 = A[g+8][2t+8..]; B: b0 =
    B[2t..2t+1][g], b1 = B[2t+8..][g]; C: c0 = C[g][2t], c3 = C[g+8][2t+1]): each lane's pairs of its word of
    row g and the x words staged for its column (x_words) give d0 + d3 of lane 4g = row g's dot of the group
    with x (float64: exact), on random codes and activations; a wrong pairing of codes and x is caught."""
    import torch

    from k3mk.ir import semantics

    gen = torch.Generator().manual_seed(5)
    packed = torch.randint(0, 256, (8, 16), generator=gen, dtype=torch.uint8)  # 8 rows x one 32-code group
    x = torch.randn(32, generator=gen, dtype=torch.float64).to(torch.bfloat16).double()
    ref = semantics.dequant_mxfp4(packed, torch.full((8, 1), 127, dtype=torch.uint8), torch.float32).double() @ x
    codes = semantics.dequant_mxfp4(packed, torch.full((8, 1), 127, dtype=torch.uint8), torch.float32).double()

    def pair(row: int, t: int, j: int) -> tuple[float, float]:  # (code 8t + j, code 8t + j + 4): lane 4g + t's word t
        return codes[row, 8 * t + j].item(), codes[row, 8 * t + j + 4].item()

    def x_words(t: int) -> list[tuple[float, float]]:  # (x0, x4), (x1, x5), (x2, x6), (x3, x7) of vector t
        v = x[8 * t : 8 * t + 8].tolist()
        return [(v[0], v[4]), (v[1], v[5]), (v[2], v[6]), (v[3], v[7])]

    def emulate(a_pairs, xcol) -> torch.Tensor:
        A, B = torch.zeros(16, 16, dtype=torch.float64), torch.zeros(16, 8, dtype=torch.float64)
        for lane in range(32):
            g, t = lane // 4, lane % 4
            a0, a1, a2, a3 = a_pairs(g, t)
            A[g, 2 * t : 2 * t + 2], A[g + 8, 2 * t : 2 * t + 2] = torch.tensor(a0), torch.tensor(a1)
            A[g, 2 * t + 8 : 2 * t + 10], A[g + 8, 2 * t + 8 : 2 * t + 10] = torch.tensor(a2), torch.tensor(a3)
            words = x_words(t)[2 * (g % 2) : 2 * (g % 2) + 2] if xcol else x_words(t)[:2]
            B[2 * t : 2 * t + 2, g], B[2 * t + 8 : 2 * t + 10, g] = torch.tensor(words[0]), torch.tensor(words[1])
        C = A @ B
        return torch.stack([C[g, 0] + C[g + 8, 1] for g in range(8)])  # lane 4g's c0 + c3

    kernel = lambda g, t: (pair(g, t, 0), pair(g, t, 2), pair(g, t, 1), pair(g, t, 3))  # noqa: E731 (read_only_args order)
    assert torch.equal(emulate(kernel, True), ref)
    assert not torch.allclose(emulate(kernel, False), ref)  # every column column 0's x: row g + 8 meets the wrong codes
    swapped = lambda g, t: (pair(g, t, 0), pair(g, t, 1), pair(g, t, 2), pair(g, t, 3))  # noqa: E731
    assert not torch.allclose(emulate(swapped, True), ref)
