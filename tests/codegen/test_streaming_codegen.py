"""The streaming task loop's codegen (ir/streaming.py fill plans, codegen/ops.py RingLayout, the ring and
loop templates): fill geometry against an independent model of what each lane sums, the shared-memory
map, the refusals, and the whole variant set compiled for sm_90a with the instructions the loop needs."""

from __future__ import annotations

import collections
import re

import sys
from pathlib import Path

import pytest
import torch

from k3mk.codegen.emit import emit_source
from k3mk.codegen.ops import MIN_RING_SLOTS, OP_SMEM_LIMIT, CodegenError, KernelConfig, fill_slot_bytes, ring_layout, router_select_spread, variant_code
from k3mk.ir.streaming import LANE_ORDER_ELEMENTS, SLOT_BYTES, MMA_ROWS, MXFP4_CHUNK_ELEMENTS, MXFP4_SPAN, VECTOR_BYTES, StreamingError, chunk_major, fill_plan, mma_code_row
from k3mk.ir.task_table import ExpertCombineParams, ExpertGatedParams, GemvParams, MlaDecodeParams, NopParams, OpVariant

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from megakernel_cases import all_cases  # noqa: E402

# Every gemv epilogue / prologue kind at batch 1, 4 and 16 (odd shapes, the GPU op cases'), the real
# models' shapes (Kimi Linear 48B, K3: K = 2304, 9216, 7168, 33792), and the experts in both formats.
GEMVS = [
    GemvParams(520, 333, 1),
    GemvParams(1032, 257, 4, rmsnorm=True, residuals=1),
    GemvParams(264, 100, 16, rmsnorm=True),
    GemvParams(7168, 16384, 16),  # x does not fit the smem: read from the arena
    GemvParams(520, 333, 1, rmsnorm=True, epilogue="situ_mul", linear_beta=25.0),
    GemvParams(264, 200, 4, epilogue="silu_mul"),
    GemvParams(264, 200, 16, epilogue="silu_mul"),
    GemvParams(1032, 257, 4, rmsnorm=True, epilogue="sigmoid_gate"),
    GemvParams(520, 333, 4, residuals=3),
    GemvParams(264, 97, 4, rmsnorm=True, out_dtype="float32"),
    GemvParams(136, 640, 1, epilogue="kda_gate", out_dtype="float32", head_dim=128, lower_bound=-5.0),
    GemvParams(264, 384, 4, rmsnorm=True, epilogue="kda_gate", out_dtype="float32", head_dim=128),
    GemvParams(520, 640, 1, rmsnorm=True, epilogue="gated_rmsnorm", head_dim=128, o_eps=1e-5),
    GemvParams(520, 640, 4, rmsnorm=True, epilogue="gated_rmsnorm", head_dim=128, o_eps=1e-5),
    GemvParams(7168, 1536, 16, epilogue="gated_rmsnorm", head_dim=128, o_eps=1e-5),  # K3's g_proj at 16: x from the arena
    GemvParams(2304, 4096, 1, rmsnorm=True),
    GemvParams(9216, 2304, 1, residuals=1),
    GemvParams(2304, 9216, 1, rmsnorm=True, epilogue="silu_mul"),
    GemvParams(7168, 2048, 4, rmsnorm=True, epilogue="situ_mul"),
    GemvParams(33792, 7168, 1, residuals=1),
    GemvParams(7168, 16384, 4),  # batched, chunked fills of 4 rows
    GemvParams(4096, 2304, 4, residuals=1),
    GemvParams(9216, 2304, 2, residuals=1),
]
EXPERTS = [
    ("expert_gated", ExpertGatedParams(2304, 1024, 256, 1, 8)),
    ("expert_combine", ExpertCombineParams(1024, 2304, 256, 4, 8)),
    ("expert_gated", ExpertGatedParams(3584, 3072, 64, 1, 16, "mxfp4", "situ")),
    ("expert_combine", ExpertCombineParams(3072, 3584, 64, 4, 16, "mxfp4")),
    ("expert_gated", ExpertGatedParams(256, 256, 16, 4, 4, "mxfp4", "situ")),  # k3-tiny: 8-byte scale rows (windows)
    ("expert_gated", ExpertGatedParams(544, 208, 9, 1, 4, "mxfp4", "situ")),  # 17 groups per row
]
VARIANTS = [OpVariant("gemv", p) for p in GEMVS] + [OpVariant(op, p) for op, p in EXPERTS]


def lane_vectors_whole_row(k: int, vector: int) -> dict[int, list[int]]:
    """Which 16-byte vectors of a bf16 row each lane sums, in order, when a warp loops over the whole row:
    lane l takes l, l + 32, ..."""
    n = k // vector
    return {lane: list(range(lane, n, 32)) for lane in range(32)}


def lane_vectors_by_chunks(plan, vector: int) -> dict[int, list[int]]:
    """The same for the streamed consumer: chunk c's vectors, lane l taking l, l + 32, ... of each chunk."""
    out = {lane: [] for lane in range(32)}
    for c in range(plan.chunks):
        first, n = c * plan.chunk // vector, plan.chunk_elements(c) // vector
        for lane in range(32):
            out[lane] += [first + i for i in range(lane, n, 32)]
    return out


@pytest.mark.parametrize("slot_bytes", [16 * 1024, 32 * 1024, 8 * 1024])
def test_fill_plans_fit_their_slot_and_keep_each_lanes_summation_order(slot_bytes):
    for v in VARIANTS:
        plan = fill_plan(v.op, v.params, slot_bytes)
        k = v.params.in_features
        assert plan.slot_need <= slot_bytes and plan.rows >= 1, (v, plan)
        assert (plan.chunks - 1) * plan.chunk < k <= plan.chunks * plan.chunk
        assert plan.chunks == 1 or plan.rows == 1 or (v.op == "gemv" and v.params.batch > 1)  # test below
        for s, st in enumerate(plan.streams):
            assert plan.stream_offset(s) % VECTOR_BYTES == 0
            if not st.window:
                assert all(st.bytes(plan.chunk_elements(c)) % VECTOR_BYTES == 0 for c in range(plan.chunks))
        if getattr(v.params, "weight_format", "bfloat16") == "mxfp4":
            # the MMA consumer sums a row's 32-code groups in order, one chunk after another: chunks of whole groups
            assert plan.chunks == 1 or plan.chunk % MXFP4_CHUNK_ELEMENTS == 0
            continue
        if plan.row_mma:
            continue  # test_row_mma_fills_are_conflict_free_and_chunk_independent
        # chunk independence: every lane loads the vectors a whole-row loop would, in its order, so each 256-element
        # span is the same MMA pair chunked or not (bf16_dot.py.j2)
        assert lane_vectors_by_chunks(plan, 8) == lane_vectors_whole_row(k, 8), (v, plan)
        if plan.chunks > 1:
            assert plan.chunk % LANE_ORDER_ELEMENTS == 0


def test_chunks_that_break_the_lane_order_would_be_caught():
    """The lane model above can fail: a 464-element chunk (what Kimi Linear's K = 2304 once got) changes
    which elements lane 0 sums."""
    plan = fill_plan("gemv", GemvParams(9216, 2304, 1), 16 * 1024)
    bad = type(plan)(**{**plan.__dict__, "chunk": 464, "chunks": -(-9216 // 464)})
    assert lane_vectors_by_chunks(bad, 8) != lane_vectors_whole_row(9216, 8)


def test_fill_counts_and_owners():
    """Each warp's fills come in issue order; every row group of every request (and slot) is one warp's."""
    gemv = fill_plan("gemv", GemvParams(2304, 4096, 1), 16 * 1024)
    assert (gemv.rows, gemv.chunks) == (3, 1)  # 3 rows of 4608 B in a 16 KB slot
    assert gemv.task_fills(31) == 11 and gemv.owners(31, 8) == [g % 8 for g in range(11)]
    long = fill_plan("gemv", GemvParams(33792, 7168, 1), 16 * 1024)
    assert (long.rows, long.chunks, long.chunk) == (1, 5, 6912)  # 5 chunks of 13.5 KB
    assert long.task_fills(3) == 15 and long.owners(3, 8) == [0, 1, 2] * 5  # chunk-major: the 3 rows side by side
    gated = fill_plan("expert_gated", ExpertGatedParams(3584, 3072, 64, 2, 16, "mxfp4", "situ"), 16 * 1024)
    assert gated.rows == 4 and gated.task_fills(10) == 2 * 3  # 3 groups of 4 rows per expert, at most 2 experts
    assert gated.grouped and gated.owners(10, 8) == [0, 1, 2, 3, 4, 5]
    # bf16 gated rows of 18 KB in 2 chunks: rounds within each request, chunk by chunk; not grouped (each request's
    # partial sums would have to live across the chunks)
    chunked = fill_plan("expert_gated", ExpertGatedParams(4608, 72, 5, 2, 2, "bfloat16", "silu"), 16 * 1024)
    assert (chunked.rows, chunked.chunks) == (1, 2) and chunked.owners(3, 8) == [0, 1, 2, 0, 1, 2, 3, 4, 5, 3, 4, 5]
    assert not chunked.grouped and not fill_plan("expert_gated", ExpertGatedParams(3584, 3072, 64, 1, 16, "mxfp4", "situ")).grouped
    combine = fill_plan("expert_combine", ExpertCombineParams(1024, 2304, 256, 2, 8), 16 * 1024)
    assert combine.rows == 8 and combine.task_fills(20) == 2 * 3 * 8  # requests x groups x slots
    assert combine.owners(20, 8) == list(range(8)) * 6  # every row group's 8 slots over the 8 warps
    for plan, rows in ((gemv, 31), (long, 3), (gated, 10), (combine, 20)):
        owners = plan.owners(rows, 8)
        assert len(owners) == plan.task_fills(rows)


def test_chunk_major_order():
    """Fills go in rounds of one unit per warp, chunk by chunk; every warp's fills stay in order, and the index the
    templates compute (round start * chunks + c * units in the round + u % warps) is the fill's place."""
    for units, warps, chunks in ((11, 8, 4), (3, 8, 5), (16, 8, 2), (20, 8, 1), (9, 4, 3)):
        order = chunk_major(units, warps, chunks)
        assert sorted(order) == [(u, c) for u in range(units) for c in range(chunks)]
        for u, c in order:
            start = u - u % warps
            assert order.index((u, c)) == start * chunks + c * min(warps, units - start) + u % warps
        for w in range(warps):
            mine = [(u, c) for u, c in order if u % warps == w]
            assert mine == sorted(mine)
    # a ring of 10 slots holds fills of 8 warps, not of the 2-3 rows unit-major order gave (K3 b4: 4 chunks per row)
    assert len({u % 8 for u, _ in chunk_major(64, 8, 4)[:10]}) == 8


def test_batched_gemvs_stream_16_mma_rows_of_a_chunk():
    """From batch 4 a gemv whose input is staged (ir/streaming.py gemv_stages_x) streams 16 MMA A rows (8 rows' gate and
    up) x one K chunk of whole 32-element spans per fill, the fewest equal chunks whose rows, 64 bytes apart mod 128,
    fit the slot. One that reads x from the arena, or of 2 requests, keeps the diagonal form: 4 rows (2 gated at batch 4: the
    accumulator budget) of one K chunk when its slot holds fewer whole rows; batch 1 keeps whole rows."""
    def geometry(params):
        plan = fill_plan("gemv", params, 16 * 1024)
        return plan.rows, plan.chunk, plan.chunks, plan.row_offset(plan.streams[0], 1) if plan.row_mma else None

    assert geometry(GemvParams(7168, 16384, 1)) == (1, 7168, 1, None)
    assert geometry(GemvParams(7168, 16384, 4)) == (16, 480, 15, 960)  # 16 x 1024 B rows would need 17 KB padded
    assert geometry(GemvParams(7168, 2048, 4, epilogue="situ_mul")) == (8, 480, 15, 960)
    assert geometry(GemvParams(2304, 4096, 8)) == (16, 480, 5, 960)
    assert geometry(GemvParams(2304, 4096, 2)) == (3, 2304, 1, None)  # batch 2: the diagonal form (ROW_MMA_MIN_BATCH)
    assert geometry(GemvParams(264, 100, 16)) == (16, 264, 1, 576)  # one chunk: the row, padded to 64 mod 128
    assert geometry(GemvParams(1032, 257, 4)) == (16, 352, 3, 704)
    assert geometry(GemvParams(7168, 2048, 8, rmsnorm=True, epilogue="situ_mul")) == (8, 480, 15, 960)  # staged: normed
    # a non-gated task of one group spreads its chunks over the warps (partial sums meet in smem:
    # gemv.py.j2); of more groups, a group is one warp's, the fills chunk-major within a round of groups
    rm = fill_plan("gemv", GemvParams(2304, 4096, 4), 16 * 1024)
    assert rm.split and rm.task_fills(40) == 3 * 5 and rm.owners(40, 8) == [0, 1, 2] * 5
    assert rm.owners(16, 8) == [0, 1, 2, 3, 4]  # no more warps than chunks
    assert rm.owners(16 * 10, 8) == list(range(8)) * 5 + [0, 1] * 5  # rounds of 8 and 2 groups
    b8 = fill_plan("gemv", GemvParams(2304, 4096, 8), 16 * 1024)
    assert b8.row_mma and b8.split and b8.owners(16, 8) == [0, 1, 2, 3, 4]
    gated = fill_plan("gemv", GemvParams(7168, 2048, 4, rmsnorm=True, epilogue="situ_mul"), 16 * 1024)
    assert not gated.split and gated.owners(8, 8) == [0] * 15  # gated: one warp per group
    assert fill_plan("gemv", GemvParams(7168, 16384, 4), 16 * 1024).owners(16, 8) == [c % 8 for c in range(15)]
    # x read from the arena (over X_STAGE_BYTES, no prologue): the diagonal form's chunked rows
    assert geometry(GemvParams(9216, 2304, 4)) == (4, 2048, 5, None)
    assert geometry(GemvParams(7168, 16384, 8)) == (2, 3584, 2, None)
    assert geometry(GemvParams(7168, 16384, 16)) == (1, 7168, 1, None)  # one row already fills the accumulators


def row_mma_lane_vectors(plan) -> dict[int, list[int]]:
    """Which 16-byte vectors of a row lane 4i + t loads, in order, chunk after chunk: vector t of each 4-vector span."""
    out = {t: [] for t in range(4)}
    for c in range(plan.chunks):
        first, n = c * plan.chunk // 8, -(-plan.chunk_elements(c) // 8)
        for t in range(4):
            out[t] += [first + min(s + t, n - 1) for s in range(0, n, 4)]
    return out


@pytest.mark.parametrize("params", [p for p in GEMVS if p.batch > 1 and fill_plan("gemv", p).row_mma] + [GemvParams(4096, 2304, 8, residuals=1)])
def test_row_mma_fills_are_conflict_free_and_chunk_independent(params):
    """A batched gemv's consumer lane 4i + t loads the span's vector t of rows i and i + 8 (gated: row i's gate and
    up). The 8 lanes of a shared-memory wavefront (i = 2q, 2q + 1) load from distinct 16-byte bank groups in every
    span (the rows 64 bytes apart mod 128), and the spans a lane sums are the whole row's in order whatever the
    chunks (spans never straddle a chunk)."""
    plan = fill_plan("gemv", params, 16 * 1024)
    assert plan.row_mma and plan.rows * len(plan.streams) == 16 and plan.slot_need <= 16 * 1024
    gated = len(plan.streams) == 2
    for c in range(plan.chunks):
        nv = -(-plan.chunk_elements(c) // 8)
        for s in range(0, nv, 4):
            for q in range(4):
                for load in range(2):  # the two A loads: rows i / i + 8, or gate / up
                    at = [plan.stream_offset(load if gated else 0) + plan.row_offset(plan.streams[0], i + (0 if gated else 8 * load))
                          + 16 * min(s + t, nv - 1) for i in (2 * q, 2 * q + 1) for t in range(4)]
                    # distinct addresses in distinct bank groups (lanes past the row share one address: a broadcast)
                    assert len({(a // 16) % 8 for a in set(at)}) == len(set(at)), (c, s, q, load)
    whole = [min(s + t, params.in_features // 8 - 1) for t in range(4) for s in range(0, -(-params.in_features // 8), 4)]
    by_chunks = row_mma_lane_vectors(plan)
    if params.in_features % 32 == 0 or plan.chunks == 1:
        assert [v for t in range(4) for v in by_chunks[t]] == whole
    assert plan.chunks == 1 or plan.chunk % 32 == 0


def mma_m16n8k16(a: list, b: list, c: list) -> list:
    """The PTX ISA's mma.m16n8k16 .bf16 (row.col) over per-lane fragments, lane 4g + t: A {a0a1, a2a3, a4a5, a6a7} =
    A[g][2t, 2t + 1], A[g + 8][2t..], A[g][2t + 8..], A[g + 8][2t + 8..]; B {b0b1, b2b3} = B[2t..][g], B[2t + 8..][g];
    C {c0, c1, c2, c3} = C[g][2t], C[g][2t + 1], C[g + 8][2t], C[g + 8][2t + 1]. a[l][r] / b[l][r]: 2 elements."""
    A, B = torch.zeros(16, 16, dtype=torch.float64), torch.zeros(16, 8, dtype=torch.float64)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for r, (row, col) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8))):
            A[row, col:col + 2] = a[lane][r]
        for r, k in enumerate((2 * t, 2 * t + 8)):
            B[k:k + 2, g] = b[lane][r]
    C = A @ B
    return [[c[lane][i] + C[lane // 4 + 8 * (i // 2), 2 * (lane % 4) + i % 2] for i in range(4)] for lane in range(32)]


@pytest.mark.parametrize("batch", [8, 3, 5])
def test_row_mma_lane_loads_give_every_rows_dot_with_every_request(batch):
    """The batched gemv's loop as gemv.py.j2 renders it, on the PTX fragments: lane 4i + t loads the span's vector t
    of rows i and i + 8 (gated: gate and up of row i) and of request min(i, batch - 1); MMA j takes words 2j, 2j + 1
    of each (bf16_dot.py.j2 _mma2) into its own chain; lane 4i + t finishes (i, 2t + e) from d[e] and (i + 8, 2t + e)
    (gated: up) from d[2 + e]. Every output is the row's dot with the request."""
    gen = torch.Generator().manual_seed(batch)
    k = 96  # 3 spans
    w = torch.randn(16, k, generator=gen, dtype=torch.float64)  # the 16 A rows (gated: 8 gates, then 8 ups)
    x = torch.randn(batch, k, generator=gen, dtype=torch.float64)
    chains = [[[0.0] * 4 for _ in range(32)] for _ in range(2)]
    for s in range(k // 32):
        vec = lambda t: slice(32 * s + 8 * t, 32 * s + 8 * t + 8)  # noqa: E731
        a = [w[lane // 4, vec(lane % 4)] for lane in range(32)]
        a2 = [w[lane // 4 + 8, vec(lane % 4)] for lane in range(32)]
        xv = [x[min(lane // 4, batch - 1), vec(lane % 4)] for lane in range(32)]
        for j in range(2):
            words = lambda v, lane, m: v[lane][4 * j + 2 * m:4 * j + 2 * m + 2]  # noqa: E731
            chains[j] = mma_m16n8k16([[words(a, l, 0), words(a2, l, 0), words(a, l, 1), words(a2, l, 1)] for l in range(32)],
                                     [[words(xv, l, 0), words(xv, l, 1)] for l in range(32)], chains[j])  # fmt: skip
    want = w @ x.T  # [16 rows, batch]
    seen = set()
    for lane in range(32):
        i, t = lane // 4, lane % 4
        for e in range(2):
            b = 2 * t + e
            if b >= batch:
                continue
            d = [chains[0][lane][m] + chains[1][lane][m] for m in range(4)]
            assert abs(d[e] - want[i, b]) < 1e-9 and abs(d[2 + e] - want[i + 8, b]) < 1e-9
            seen |= {(i, b), (i + 8, b)}
    assert seen == {(r, b) for r in range(16) for b in range(batch)}  # gated: (i, b) gate and (i + 8, b) up


def test_mxfp4_scale_windows():
    """k3-tiny's experts have 8-byte scale rows: a fill copies the 16-byte window around them; K3's 112-byte
    rows are whole vectors and copy as they are."""
    tiny = fill_plan("expert_gated", ExpertGatedParams(256, 256, 16, 1, 4, "mxfp4", "situ"))
    assert [st.operand for st in tiny.streams] == ["weight", "weight_up", "scale", "scale_up"]
    assert [st.window for st in tiny.streams] == [False, False, True, True]
    assert tiny.stream_bytes(tiny.streams[2]) == -(-tiny.rows * 8 // 16) * 16 + 16
    k3 = fill_plan("expert_gated", ExpertGatedParams(3584, 3072, 896, 1, 16, "mxfp4", "situ"))
    assert not any(st.window for st in k3.streams)
    assert k3.fill_bytes(4, 0) == 4 * 2 * (1792 + 112)


@pytest.mark.parametrize("op, params, rows, copies", [
    ("expert_gated", ExpertGatedParams(3584, 3072, 896, 1, 16, "mxfp4", "situ"), 4, 1),  # K3: 2 x 4 rows of 1792 B
    ("expert_combine", ExpertCombineParams(3072, 3584, 896, 1, 16, "mxfp4"), 8, 2),  # K3 w2: 8 rows of 1536 B
    ("expert_gated", ExpertGatedParams(544, 208, 9, 1, 4, "mxfp4", "situ"), 4, 1),  # 272-byte rows
    ("expert_combine", ExpertCombineParams(256, 256, 16, 4, 4, "mxfp4"), 8, 2),
])  # fmt: skip
def test_mxfp4_code_rows_are_the_mma_rows(op, params, rows, copies):
    """An MXFP4 fill's code rows (gate then up) are A rows 0..7 of the consumer warp's MMAs (mma_code_row covers
    every row of the fill once), copied MMA_COPY_ROWS rows at a time, the copies 64 bytes apart mod 128. A
    lane's 16-byte load of a span (lane 4g + t: group t of MMA row g's row) is served 8 lanes per wavefront
    (MMA rows 2q, 2q + 1): those 8 loads cover 8 distinct 16-byte bank groups in every span (conflict-free)."""
    plan = fill_plan(op, params, 16 * 1024)
    codes = [st for st in plan.streams if st.mma_rows]
    assert plan.rows == rows and plan.rows * len(codes) <= MMA_ROWS and plan.copy_groups() == copies
    offsets = {(s, r): plan.stream_offset(s) + plan.row_offset(st, r) for s, st in enumerate(codes) for r in range(plan.rows)}
    assert all(o % 16 == 0 for o in offsets.values()) and len(set(offsets.values())) == len(offsets)
    row_bytes = codes[0].bytes(plan.chunk)
    assert max(offsets.values()) + row_bytes <= plan.stream_offset(len(codes))  # the rows do not overlap the scales
    read = [mma_code_row(len(codes), plan.copy_rows, g) for g in range(MMA_ROWS)]
    assert {m for m in read if m[1] < plan.rows} == set(offsets) and len(set(read)) == MMA_ROWS
    for span in range(params.in_features // MXFP4_SPAN):
        for q in range(4):
            groups = [((offsets[read[g]] + span * 64 + 16 * t) // 16) % 8 for g in (2 * q, 2 * q + 1) for t in range(4)]
            assert len(set(groups)) == 8, (span, q)
    for s, st in enumerate(codes):  # a copy's rows are adjacent in the slot, as in global memory
        for r in range(1, plan.rows):
            if r % plan.copy_rows:
                assert plan.row_offset(st, r) - plan.row_offset(st, r - 1) == row_bytes


@pytest.mark.parametrize("op, params, message", [
    ("expert_combine", ExpertCombineParams(224, 264, 9, 1, 4, "mxfp4"), "not a multiple of 16 bytes"),
    ("expert_gated", ExpertGatedParams(20736, 64, 4, 1, 2, "mxfp4"), "does not fit"),  # 648-byte scale rows: windows, no chunks
])  # fmt: skip
def test_fill_plan_rejects(op, params, message):
    with pytest.raises(StreamingError, match=message):
        fill_plan(op, params, 16 * 1024)


def test_ring_layout():
    ring = ring_layout(VARIANTS)
    assert ring.ring_offset >= ring.op_bytes and ring.ring_offset % 128 == 0
    assert ring.record_offset == ring.ring_offset + ring.slots * ring.slot_bytes
    assert ring.barrier_offset == ring.record_offset + ring.records * 128
    assert ring.total <= OP_SMEM_LIMIT
    assert layout_total(ring, ring.slots + 1) > OP_SMEM_LIMIT  # as many slots as fit
    capped = ring_layout(VARIANTS, KernelConfig(ring_bytes=64 * 1024))
    assert capped.slot_bytes == ring.slot_bytes == fill_slot_bytes(VARIANTS) and capped.slots == 64 * 1024 // capped.slot_bytes
    # a kernel of ops that do not stream keeps the fewest slots: the L1 keeps its share of the SM's memory
    assert ring_layout([OpVariant("nop", NopParams())]).slots == MIN_RING_SLOTS
    big = OpVariant("gemv", GemvParams(32768, 64, 1, rmsnorm=True))  # 64 KB of staged input
    with pytest.raises(CodegenError, match="ring slots"):
        ring_layout([big] + VARIANTS[:1], KernelConfig(slot_bytes=96 * 1024))


def test_slot_size_fits_the_gated_experts_rows():
    """A ring of N slots holds N fills in flight: where a routed gated expert's fill (one row's gate and up) would
    use under 3/4 of a 16 KB slot, the slot holds the fewest whole rows that fill 16 KB (up to 20 KB), and a gated fill
    then uses all of it; other kernels keep 16 KB; an explicit slot_bytes wins."""
    kimi = [OpVariant("expert_gated", ExpertGatedParams(2304, 1024, 256, b, 8)) for b in (1, 8)]
    for v in kimi:  # 2 x 2304 x 2 = 9,216 B a row: 56% of 16 KB
        slot = fill_slot_bytes([v])
        assert slot == 2 * 9216
        plan = fill_plan(v.op, v.params, slot)
        assert plan.rows == 2 and plan.fill_bytes(2, 0) == slot
        config = KernelConfig().for_kernel(VARIANTS[:3] + [v])
        assert config.slot_bytes == slot and ring_layout(VARIANTS[:3] + [v]).slot_bytes == slot
    bf16_proxy = OpVariant("expert_gated", ExpertGatedParams(3584, 3072, 64, 8, 16, activation="situ"))  # 14,336 B: 88%
    k3 = OpVariant("expert_gated", ExpertGatedParams(3584, 3072, 896, 1, 16, "mxfp4", "situ"))  # 4 rows, 93%
    wide = OpVariant("expert_gated", ExpertGatedParams(5120, 1024, 64, 1, 8))  # 20,480 B rows: chunked, not one row
    for v in (bf16_proxy, k3, wide):
        assert fill_slot_bytes(VARIANTS[:3] + [v]) == SLOT_BYTES
    assert fill_slot_bytes([OpVariant("expert_gated", ExpertGatedParams(1536, 512, 64, 1, 8))]) == SLOT_BYTES  # 6 KB rows: 75%
    assert fill_slot_bytes([OpVariant("expert_gated", ExpertGatedParams(2688, 512, 64, 1, 8))]) == SLOT_BYTES  # 2 rows: 21,504 B > 20 KB
    assert KernelConfig(slot_bytes=16 * 1024).for_kernel(kimi).slot_bytes == 16 * 1024
    assert ring_layout(kimi, KernelConfig(slot_bytes=16 * 1024)).slot_bytes == 16 * 1024
    with pytest.raises(CodegenError, match="for_kernel"):
        variant_code(0, kimi[0], KernelConfig())


def test_wide_input_does_not_take_the_ring():
    """A gemv that could read x from the arena stages it only within what the kernel's other ops already need
    of the op smem (or X_STAGE_BYTES): Kimi Linear's 9216-wide dense down projection at batch 8 (147 KB of x)
    reads x from the arena beside the rmsnorm gemvs' 36 KB, as K3's 33792-wide one (66 KB) beside the expert
    combine's 51 KB, and keeps it in smem beside a 68 KB op; an rmsnorm gemv stages its x whatever the others need.
    MLA decode needs 3 KB (its KV rows come through the ring)."""
    from k3mk.codegen.ops import X_STAGE_BYTES, _op_smem, gemv_tuning, x_staging_limit

    mla = OpVariant("mla_decode", MlaDecodeParams(32, 512, 64, 8192, 8, 64, 128, 0.1, group_heads=8))
    down = OpVariant("gemv", GemvParams(9216, 2304, 8, residuals=1))
    normed = OpVariant("gemv", GemvParams(2304, 4096, 8, rmsnorm=True))
    assert _op_smem(mla) < 4096
    limit = x_staging_limit([mla, down, normed])
    assert limit == max(X_STAGE_BYTES, _op_smem(normed)) < 8 * 9216 * 2
    assert not gemv_tuning(down.params, KernelConfig(), limit).x_smem and gemv_tuning(normed.params, KernelConfig(), limit).x_smem
    ring = ring_layout([mla, down, normed])
    assert ring.op_bytes == _op_smem(normed) and ring.slots >= 10
    assert "reads it from the arena" in emit_source([mla, down, normed])  # the template's arena path
    combine = OpVariant("expert_combine", ExpertCombineParams(3072, 7168, 896, 1, 16))  # K3: 8 warps' inputs, 51 KB
    k3_down = OpVariant("gemv", GemvParams(33792, 7168, 1, residuals=1))  # 66 KB of x
    assert not gemv_tuning(k3_down.params, KernelConfig(), x_staging_limit([combine, mla, k3_down])).x_smem
    wide = OpVariant("gemv", GemvParams(34816, 64, 1, rmsnorm=True))  # 68 KB
    assert gemv_tuning(k3_down.params, KernelConfig(), x_staging_limit([wide, k3_down])).x_smem


def test_a_combine_prefetches_its_next_input_within_the_staging_limit():
    """An expert_combine whose warps stage more than one input a task (batch > 1, or more slots than warps) copies each
    warp's next input into a second buffer while it sums the current one, where its smem stays within the kernel's
    staging limit (x_staging_limit: what the other ops need, or X_STAGE_BYTES, as a gemv's staged input): Kimi
    Linear's combine at batch 8 (grouped) and 4 (not: requests seldom share experts) beside its rmsnorm gemvs, 16 KB
    more (8 warps' 1024-wide inputs); at batch 1 only with more slots than warps; never past the limit."""
    from k3mk.codegen.ops import X_STAGE_BYTES, CombineTuning, _op_smem, combine_prefetches, variant_code, x_staging_limit

    slot = SLOT_BYTES
    for batch, grouped in ((8, True), (4, False)):
        combine = OpVariant("expert_combine", ExpertCombineParams(1024, 2304, 256, batch, 8, residuals=2))
        normed = OpVariant("gemv", GemvParams(2304, 4096, batch, rmsnorm=True))
        assert fill_plan("expert_combine", combine.params, slot).grouped == grouped
        config = KernelConfig(slot_bytes=slot)
        base, buffered = _op_smem(combine), _op_smem(combine, X_STAGE_BYTES, config)
        assert buffered - base == 8 * 1024 * 2  # every warp's next input, bf16
        limit = x_staging_limit([combine, normed])
        assert limit == max(X_STAGE_BYTES, _op_smem(normed)) and combine_prefetches(combine.params, config, limit)
        assert variant_code(0, combine, KernelConfig().for_kernel([combine, normed]), limit).tuning == CombineTuning(prefetch=True)
        assert ring_layout([combine, normed]).op_bytes == max(buffered, _op_smem(normed))
        assert not combine_prefetches(combine.params, config, buffered - 16)  # past the limit
        assert not combine_prefetches(combine.params, None, X_STAGE_BYTES)  # x_staging_limit's own sizes: none
        source = emit_source([combine, normed])
        assert "cp_async_wait_group(0)" in source and "sRaw" in source
    one_round = ExpertCombineParams(1024, 2304, 256, 1, 8)
    assert not combine_prefetches(one_round, KernelConfig(slot_bytes=slot), X_STAGE_BYTES)  # one input a task
    assert combine_prefetches(ExpertCombineParams(1024, 2304, 256, 1, 12), KernelConfig(slot_bytes=slot), X_STAGE_BYTES)  # two rounds of slots
    assert combine_prefetches(one_round, KernelConfig(slot_bytes=slot, threads=128), X_STAGE_BYTES)  # 4 consumer warps: two rounds
    assert "sRaw" not in emit_source([OpVariant("expert_combine", ExpertCombineParams(1024, 2304, 256, 1, 8, residuals=2))])


def layout_total(ring, slots: int) -> int:
    return type(ring)(ring.op_bytes, ring.slot_bytes, slots, ring.records).total


def test_registers_move_to_the_consumers_from_batch_8():
    """KernelConfig.for_batch: below 8 requests the kernel keeps the launch's even share (no spare warp, no
    setmaxnreg: the source of before); from 8 the support warpgroup keeps 120 and the consumers take 192."""
    narrow, wide = KernelConfig().for_batch(4), KernelConfig().for_batch(8)
    assert (narrow.block_threads, narrow.consumer_registers, narrow.moves_registers, narrow.dot_unroll(4)) == (352, 168, False, 1)
    assert (wide.block_threads, wide.support_registers, wide.consumer_registers, wide.dot_unroll(4)) == (384, 120, 192, 2)
    assert KernelConfig(support_registers=72).for_batch(1).consumer_registers == 216  # the knob wins over the batch
    assert 168 * 384 >= 120 * 128 + 192 * 256  # what setmaxnreg.inc waits for is free
    narrow_src = emit_source([OpVariant("gemv", GemvParams(512, 256, 4))])
    wide_src = emit_source([OpVariant("gemv", GemvParams(512, 256, 8))])
    assert "setmaxregister" not in narrow_src and "BLOCK_THREADS = 352" in narrow_src
    assert "setmaxregister_decrease(120)" in wide_src and "setmaxregister_increase(192)" in wide_src and "BLOCK_THREADS = 384" in wide_src
    with pytest.raises(CodegenError, match="multiple of 8"):
        KernelConfig(support_registers=100)
    with pytest.raises(CodegenError, match="multiple of 128"):
        KernelConfig(threads=192)


def test_router_top_k_spreads_over_the_warps_at_batch_1_only():
    router = dict(epilogue="router", out_dtype="float32", top_k=8)
    assert router_select_spread(GemvParams(2304, 256, 1, **router))  # Kimi Linear
    assert not router_select_spread(GemvParams(2304, 256, 2, **router))  # one warp per request
    assert not router_select_spread(GemvParams(7168, 896, 1, **{**router, "top_k": 16}))  # K3: 4 experts a lane
    assert "_select_spread(" in emit_source([OpVariant("gemv", GemvParams(2304, 256, 1, **router))])


def test_case_tables_emit():
    """Every GPU op case's table generates (the producer halves and consumer halves render)."""
    for name, case in all_cases().items():
        source = emit_source(case.builder.table().variants, KernelConfig(debug=case.debug))
        assert "def producer(" in source and "def consumers(" in source, name


def test_streaming_kernel_compiles_for_sm90a(tmp_path, monkeypatch):
    """All variant kinds in one kernel: ring copies, the loop's barriers and a release add without a fence."""
    pytest.importorskip("cutlass", reason="compiling needs nvidia-cutlass-dsl (the compile extra)")
    from k3mk.codegen.build import compile_source

    monkeypatch.setenv("K3MK_CACHE_DIR", str(tmp_path / "cache"))
    entry, info = compile_source(emit_source(VARIANTS), "sm_90a")
    print(f"streaming kernel: {info.get('registers')} registers, spills {info.get('spill_store_bytes')} / "
          f"{info.get('spill_load_bytes')} B, {info['compile_seconds']} s")  # fmt: skip
    assert info["spill_store_bytes"] == 0
    ptx = (entry / "megakernel.sm_90a.ptx").read_text()
    for needle in (".reqntid 384, 1, 1", ".minnctapersm 1", "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes",
                   "mbarrier.arrive.expect_tx", "mbarrier.try_wait.parity", "fence.mbarrier_init", "bar.sync 	1, 256",
                   "red.release.gpu.global.add.u64", "ld.acquire.gpu", "ld.shared.v4",
                   "setmaxnreg.dec.sync.aligned.u32 	120", "setmaxnreg.inc.sync.aligned.u32 	192"):  # fmt: skip
        assert needle in ptx, needle
    # one fence.acq_rel.gpu per CTA exit, none per task: the release add orders the body's stores
    assert ptx.count("fence.acq_rel.gpu") == 1


@pytest.mark.parametrize("op, params", [
    ("expert_gated", ExpertGatedParams(3584, 3072, 64, 1, 16, "mxfp4", "situ")),
    ("expert_combine", ExpertCombineParams(3072, 3584, 64, 1, 16, "mxfp4")),
    ("expert_gated", ExpertGatedParams(256, 256, 16, 4, 4, "mxfp4", "situ")),  # scale windows
])  # fmt: skip
def test_mxfp4_producer_copies_land_where_the_consumer_reads(op, params):
    """The rendered producer's bulk copies of an MXFP4 fill go to the slot offsets of the plan (each code stream's
    copies at stream_offset + j * group_pitch, every scale stream at its stream_offset), and the consumer's row
    addresses use the same pitch: a copy landing on another stream's bytes cannot pass unnoticed here."""
    plan = fill_plan(op, params, 16 * 1024)
    source = emit_source([OpVariant(op, params)])
    produce = source[source.index("_produce("):source.index("_run(")]
    landed = {int(m) for m in re.findall(r"ring_copy\(smem, fill, (\d+)", produce)}  # the combine renders one fill per round
    want = {plan.stream_offset(s) + j * plan.group_pitch(st) for s, st in enumerate(plan.streams) if st.mma_rows
            for j in range(plan.copy_groups())} | {plan.stream_offset(s) for s, st in enumerate(plan.streams) if not st.mma_rows}  # fmt: skip
    assert landed == want and len(want) == plan.copy_groups() * sum(st.mma_rows for st in plan.streams) + sum(not st.mma_rows for st in plan.streams)
    run = source[source.index("_run("):]
    assert f"* {plan.group_pitch(plan.streams[0])}" in run and f"% {plan.copy_rows}) * {plan.streams[0].bytes(plan.chunk)}" in run


@pytest.mark.parametrize("debug, profile", [(False, False), (True, True)])
def test_ring_words_fit_the_layout(tmp_path, debug, profile):
    """The ring template's last words (the record barriers, the status words, the profile and watchdog words)
    end within codegen/ops.py RingLayout.total, the smem the kernel declares: the layout and the template count
    the same words."""
    pytest.importorskip("cutlass", reason="importing the generated module needs nvidia-cutlass-dsl (the compile extra)")
    import importlib.util

    config = KernelConfig(debug=debug, profile=profile)
    path = tmp_path / "megakernel_gen.py"
    path.write_text(emit_source(VARIANTS, config))
    spec = importlib.util.spec_from_file_location("megakernel_gen", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ring = ring_layout(VARIANTS, config)
    assert mod.SLOT_FULL == ring.barrier_offset and mod.RING_SLOTS == ring.slots and mod.RECORDS == ring.records
    end = (mod.WATCHDOG + 24) if debug else (mod.CONSUMER_STATS + 24)
    assert mod.RECORD_DONE + mod.RECORDS * 8 <= mod.SLOT_SEQ and mod.RECORD_STATUS + mod.RECORDS * 4 <= mod.PRODUCER_STATS
    assert end <= ring.total == mod.SMEM_BYTES


@pytest.mark.parametrize("batch, width, channels, begin, count", [(1, 4, 4096, 384, 128), (4, 4, 200, 40, 160), (3, 2, 64, 0, 64)])
def test_kda_conv_producer_prefetches_what_the_body_reads(batch, width, channels, begin, count):
    """kda_conv's producer half brings into L2 exactly the state bytes the task's body reads and rewrites
    (state[b, j, g * P + c] for its channels c: an independent model of the [B, W-1, 3P] layout) and its channels'
    taps of q, k and v ([P, 1, W] fp32 each): the rendered offset and size expressions, evaluated."""
    from k3mk.ir.task_table import KdaConvParams

    source = emit_source([OpVariant("kda_conv", KdaConvParams(channels, batch, width))])
    produce = source[source.index("def op0_kda_conv_produce("):source.index("def op0_kda_conv_run(")]
    rows = int(re.search(r"if i < (\d+):", produce).group(1))
    state = re.search(r"cp_async_bulk_prefetch\(gmem_ptr\(state, Uint8, (.+)\), (.+)\)\n", produce)
    taps = re.search(r"cp_async_bulk_prefetch\(gmem_ptr\(taps, Uint8, (.+)\), (.+)\)\n", produce)
    env = {"Int64": int, "c0": begin, "cc": count}
    fetched = set()
    for i in range(rows):
        start, size = eval(state.group(1), {**env, "i": i}), eval(state.group(2), env)
        assert start % 16 == 0 and size % 16 == 0
        fetched |= set(range(start, start + size))
    read = {((b * (width - 1) + j) * 3 * channels + g * channels + c) * 2 + e for b in range(batch) for j in range(width - 1)
            for g in range(3) for c in range(begin, begin + count) for e in range(2)}  # fmt: skip
    assert fetched == read
    start, size = eval(taps.group(1), env), eval(taps.group(2), env)
    assert (start, size) == (begin * width * 4, count * width * 4)  # taps [c, 0, j] of channels [begin, +count), fp32
    assert f"cutlass.range(lane, {rows + 3}, 32)" in produce  # one lane per state row, then one per q, k, v taps
    from k3mk.codegen.ops import variant_code

    conv = OpVariant("kda_conv", KdaConvParams(channels, batch, width))
    code = variant_code(0, conv, KernelConfig().for_kernel([conv]))
    assert [code.operand(w) for w in ("weight_q", "weight_k", "weight_v")] == [code.operand("weight_q") + g for g in range(3)]
    assert f"task[{code.operand('weight_q')} + i - {rows}]" in produce
