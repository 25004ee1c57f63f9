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
        (OpVariant("mla_decode", MlaDecodeParams(8, 512, 64, 16, 1, 4, 16, 0.1, group_heads=17)), "group_heads 17"),
        (OpVariant("mla_decode", MlaDecodeParams(8, 512, 8, 16, 1, 4, 16, 0.1)), "520 must be a multiple of 16"),
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
        OpVariant("expert_gated", ExpertGatedParams(4608, 72, 5, 4, 2, "bfloat16", "silu")),  # rows in chunks: not grouped
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
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx  # mla_decode's scores (and q absorb's none)
    assert "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32" in ptx and "cvt.rna.tf32.f32" in ptx  # its p . V
    assert "cp.async.bulk.shared::cluster.global" in ptx  # its KV rows through the ring (no op streams weights here)
    assert "cp.async.cg.shared.global" in ptx  # the row this step writes, loaded after the wait
    assert "fence.proxy.async.shared::cta" in ptx  # before the producer's next bulk copy into those slots
    assert "ld.shared.v4" in ptx and "st.global.v4" in ptx


def _bf16_bits(bits):
    """The bf16 values (as float64) of 16-bit patterns (int64 tensor)."""
    import torch

    return ((bits & 0xFFFF).to(torch.int32) << 16).view(torch.float32).double()


def _pair_bits(word, j):
    """mxfp4_dot.py.j2 `pair`'s integer ops for codes j and j + 4 of 32-bit words (j = 2, 3: codes 0, 1 of word >> 8)."""
    src, q = (word, j) if j < 2 else (word >> 8, j - 2)
    return (((src & (0x000F000F << (4 * q))) * (0x1040 >> (4 * q))) & 0xFFFFFFFF) & 0x81C081C0


def _pair(word, j, mult):
    """mxfp4_dot.py.j2 `pair` on the bits: codes j and j + 4 of 32-bit words as bf16 values (float64) after the
    bf16 multiply by the bf16 `mult` (float64 tensor or float): (low half, high half)."""
    import torch

    bits = _pair_bits(word, j)
    lo, hi = _bf16_bits(bits), _bf16_bits(bits >> 16)
    return ((lo * mult).to(torch.bfloat16).double(), (hi * mult).to(torch.bfloat16).double())


def _multiplier(s):
    """mxfp4_dot.py.j2 `scale`: the bf16 of s * 0x0080 + 0x3B00 (one half of the bf16x2)."""
    return _bf16_bits(s * 0x0080 + 0x3B00)


def test_mxfp4_scaled_decode_is_exact():
    """The templates' decode (mxfp4_dot.py.j2 `pair` of a word and of it >> 8, times `scale`), emulated on the bits
    with bf16 rounding, is
    semantics.dequant_mxfp4 x 2^-8 exactly, for every code pair and every scale byte the loaders accept
    (MXFP4_MAX_SCALE) down to 10; x times 2^8 is exact; past the limit the multiplier is not finite."""
    import torch

    from k3mk.codegen.emit import emit_source
    from k3mk.ir import semantics
    from k3mk.runtime.abi import MXFP4_MAX_SCALE

    i = torch.arange(1 << 16, dtype=torch.int64)
    words = i | ((((i << 4) | (i >> 12)) & 0xFFFF) << 16)  # low half: every pattern; high half: it rotated by a nibble
    codes = torch.stack([(words >> (4 * j)) & 0xF for j in range(8)], dim=-1)  # code 8q+j = nibble j
    for j in range(4):
        assert len(set((codes[:, j] * 16 + codes[:, j + 4]).tolist())) == 256
    packed = torch.stack([(words >> (8 * k)) & 0xFF for k in range(4)], dim=-1).to(torch.uint8)
    source = emit_source([OpVariant("expert_combine", ExpertCombineParams(256, 256, 16, 1, 4, "mxfp4"))])
    for needle in ("Uint32(0x00800080) + Uint32(0x3B003B00)", "0x43804380", "(w & Uint32(0x000F000F << (4 * q))) * Uint32(0x1040 >> (4 * q))",
                   "spread & Uint32(0x81C081C0)", "w8 = w >> 8"):  # what is emulated here
        assert needle in source, needle
    for s in list(range(10, MXFP4_MAX_SCALE + 1, 7)) + [MXFP4_MAX_SCALE]:
        expect = semantics.dequant_mxfp4(packed, torch.full((packed.shape[0], 1), s, dtype=torch.uint8), torch.bfloat16).double()
        got = torch.empty_like(expect)
        for j in range(4):
            got[:, j], got[:, j + 4] = _pair(words, j, _multiplier(torch.tensor(s)))
        assert torch.equal(got * 2.0**8, expect), s
    assert not torch.isfinite(_multiplier(torch.tensor(MXFP4_MAX_SCALE + 1)))
    x = torch.randn(4096, dtype=torch.float64).to(torch.bfloat16)
    assert torch.equal((x * torch.tensor(2.0**8, dtype=torch.bfloat16)).double(), x.double() * 2.0**8)


@pytest.mark.parametrize("code_streams, rows, in_features", [(2, 4, 416), (1, 8, 384), (1, 3, 160)])
def test_mxfp4_mma_spans_give_the_row_dots(code_streams, rows, in_features):
    """mxfp4_dot.py.j2's MMAs over a fill of `rows` rows per code stream, emulated with the PTX fragment layouts
    (A row-major: lane 4g + t holds a0 = A[g][2t..2t+1], a1 = A[g+8][2t..], a2 = A[g][2t+8..], a3 = A[g+8][2t+8..];
    B: b0 = B[2t..2t+1][g], b1 = B[2t+8..][g]; C: c0 = C[g][2t], c3 = C[g+8][2t+1]): MMA row g reads code row
    mma_code_row(g) (clamped to the fill's rows), lane t group t of each span (the tail's lanes past the row
    re-read its last group), x staged by `x_store`'s formula with zeros past in_features, four accumulator
    chains summed as `row_sum` in lane 4g; every row's result equals its dot with x (float64, exact) on random
    codes, scales and activations. A wrong B column or pair order is caught."""
    import torch

    from k3mk.ir import semantics
    from k3mk.ir.streaming import MMA_COPY_ROWS, MXFP4_SPAN, mma_code_row, mxfp4_padded

    gen = torch.Generator().manual_seed(in_features)
    k, kp, copy_rows = in_features, mxfp4_padded(in_features), min(rows, MMA_COPY_ROWS)
    packed = torch.randint(0, 256, (code_streams, rows, k // 2), generator=gen, dtype=torch.uint8)
    scale = torch.randint(118, 127, (code_streams, rows, k // 32), generator=gen, dtype=torch.uint8)
    x = torch.randn(k, generator=gen, dtype=torch.float64).to(torch.bfloat16).double()
    ref = semantics.dequant_mxfp4(packed, scale, torch.bfloat16).double() @ x  # [stream, row]
    words = torch.from_numpy(packed.numpy().view("<u4").astype("int64"))  # [stream, row, k / 8] code words

    def x_words(kv):  # (x0, x4), (x1, x5), (x2, x6), (x3, x7) of vector kv, x 2^8, zeros past k
        v = [256 * e for e in x[8 * kv : 8 * kv + 8].tolist()] if 8 * kv < k else [0.0] * 8
        return [(v[0], v[4]), (v[1], v[5]), (v[2], v[6]), (v[3], v[7])]

    sx = {}  # x_store: word index -> its (low, high) bf16 values
    for kv in range(kp // 8):
        r, w = kv % 16, x_words(kv)
        at = (kv // 16) * 64 + ((r % 4) // 2) * 32 + (r // 4) * 8 + (r % 2) * 2
        sx[at], sx[at + 1], sx[at + 4], sx[at + 5] = w

    def codes(word, q):  # the exact E2M1 values of pair q's halves (its bits x 2^126)
        bits = _pair_bits(torch.tensor([word]), q)
        return float(_bf16_bits(bits)) * 2.0**126, float(_bf16_bits(bits >> 16)) * 2.0**126

    def run(xcolumn, order):
        acc = torch.zeros(4, 16, 8, dtype=torch.float64)  # C of the four MMA chains
        for p in range(kp // MXFP4_SPAN):
            for j in range(4):
                A, B = torch.zeros(16, 16, dtype=torch.float64), torch.zeros(16, 8, dtype=torch.float64)
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    stream, row = mma_code_row(code_streams, copy_rows, g)
                    row = min(row, rows - 1)
                    group = min(4 * p + t, k // 32 - 1)  # the tail's lanes past the row: its last group again
                    m = 2.0 ** (int(scale[stream, row, group]) - 127 - 8)  # `pair` x `scale` (exact: the test above)
                    pairs = [tuple(c * m for c in codes(int(words[stream, row, 4 * group + j]), q)) for q in range(4)]
                    a0, a1, a2, a3 = (pairs[q] for q in order)
                    A[g, 2 * t : 2 * t + 2], A[g + 8, 2 * t : 2 * t + 2] = torch.tensor(a0), torch.tensor(a1)
                    A[g, 2 * t + 8 : 2 * t + 10], A[g + 8, 2 * t + 8 : 2 * t + 10] = torch.tensor(a2), torch.tensor(a3)
                    base = p * 64 + (j // 2) * 32 + t * 8 + xcolumn(g) * 4 + (j % 2) * 2
                    B[2 * t : 2 * t + 2, g], B[2 * t + 8 : 2 * t + 10, g] = torch.tensor(sx[base]), torch.tensor(sx[base + 1])
                acc[j] += A @ B
        out = torch.full((code_streams, rows), float("nan"), dtype=torch.float64)
        for g in range(8):
            stream, row = mma_code_row(code_streams, copy_rows, g)
            if row < rows:  # the kernel stores only the unclamped rows
                out[stream, row] = sum(acc[j, g, 0] + acc[j, g + 8, 1] for j in range(4))  # row_sum in lane 4g
        return out

    kernel = (0, 2, 1, 3)  # the pairs in read_only_args order
    assert torch.equal(run(lambda g: g % 2, kernel), ref)
    assert not torch.allclose(run(lambda g: 0, kernel), ref)  # column 0's x everywhere: rows g + 8 meet the wrong codes
    assert not torch.allclose(run(lambda g: g % 2, (0, 1, 2, 3)), ref)
