"""The streaming engine's cost model (ir/replay.py) against step times worked out by hand for small
tables: a stream-bound task, a ring of one slot, a hand-off between CTAs, a routed expert whose producer
waits for its router, and the per-task costs of ops that do not stream. A fill is its consumer warp's, taken
at a warp's share of the consume rate (WARP_RATE), and a task ends with its last warp."""

from __future__ import annotations

import dataclasses

import pytest

from k3mk.ir.replay import H200_2026_12_03, EngineCosts, mla_chunk_rows, replay
from k3mk.ir.streaming import RingModel, fill_plan
from k3mk.ir.task_table import (Event, ExpertGatedParams, GemvParams, MlaDecodeParams, NopParams, OpVariant, RouterTopkParams, Task, TaskTable,
                                WeightSpec)  # fmt: skip

GEMV = OpVariant("gemv", GemvParams(64, 1024, 1))
EXPERT = OpVariant("expert_gated", ExpertGatedParams(64, 1024, 4, 1, 2))
ROUTER = OpVariant("router_topk", RouterTopkParams(4, 1, 2))
NOP = OpVariant("nop", NopParams())
COSTS = EngineCosts(sm_stream=20e9, fill_latency=1.5e-6, fill_issue=0.0, handoff=0.7e-6, task_overhead=0.5e-6,
                    consume={"bfloat16": 200e9, "mxfp4": 8e9}, prologue=0.3e-6, direct={"nop": (0.2e-6, 1e9)})  # fmt: skip


WARPS = 8
WARP_RATE = COSTS.consume["bfloat16"] / WARPS


def table_of(lists, events=2) -> TaskTable:
    weights = [WeightSpec("w", "bfloat16", (1024, 64)), WeightSpec("w13", "bfloat16", (4, 1024, 64))]
    return TaskTable([GEMV, EXPERT, ROUTER, NOP], lists, [Event(f"e{i}") for i in range(events)], weights=weights, arena_bytes=4096)


def fills(variant: OpVariant, rows: int) -> int:
    return fill_plan(variant.op, variant.params).task_fills(rows)


def test_a_streaming_task_is_as_fast_as_its_fills_land():
    """One gemv of F fills, the ring larger than F: fills land at the stream's rate after the first one's
    latency; each warp (1.25x the stream at its share) finishes its fill before its next one lands, so the step
    is the last fill's landing plus one warp's time on it."""
    f = fills(GEMV, 1024)
    assert f >= 2 * WARPS
    w = 1024 * 64 * 2
    b = w / f
    assert b / WARP_RATE < WARPS * b / COSTS.sm_stream  # a warp keeps up with its every-8th fill
    r = replay(table_of([[Task(0, {"weight": 0, "row_count": 1024}, (), None, "g")]]), [[(w, 0)]], RingModel(64, 4, WARPS), COSTS)
    expected = COSTS.fill_latency + (f - 1) * b / COSTS.sm_stream + b / WARP_RATE
    assert r.step_s == pytest.approx(expected, rel=1e-12)
    assert r.producer_blocked_s == 0 and r.consumer_wait_s == 0


def test_a_ring_of_one_slot_serialises_issue_latency_and_consumption():
    f = fills(GEMV, 1024)
    w = 1024 * 64 * 2
    b = w / f
    r = replay(table_of([[Task(0, {"weight": 0, "row_count": 1024}, (), None, "g")]]), [[(w, 0)]], RingModel(1, 4, WARPS), COSTS)
    per_fill = COSTS.fill_latency + b / WARP_RATE  # issue waits for the previous release
    assert r.step_s == pytest.approx(f * per_fill, rel=1e-12)
    assert r.producer_blocked_s == pytest.approx((f - 1) * per_fill, rel=1e-12)  # each issue waits a whole fill


def test_a_waiter_starts_a_handoff_after_its_producer_ends_and_its_weights_are_already_in():
    """CTA 1's gemv waits for CTA 0's nop: its producer streamed the weights during the wait, so its body
    is the prologue plus the last fill's consumption."""
    nop_time = COSTS.direct["nop"][0] + 3000 / COSTS.direct["nop"][1]
    f = fills(GEMV, 64)
    w = 64 * 64 * 2
    lists = [[Task(3, {}, (), 0, "a")], [Task(0, {"weight": 0, "row_count": 64}, (0,), None, "b")]]
    r = replay(table_of(lists, 1), [[(0, 3000)], [(w, 0)]], RingModel(64, 4, WARPS), COSTS)
    start = nop_time + COSTS.handoff  # the release follows the body at once
    assert COSTS.fill_latency + (f - 1) * (w / f) / COSTS.sm_stream < start  # the fills landed during the wait
    assert f <= WARPS  # one fill per warp, side by side
    body = COSTS.prologue + (w / f) / WARP_RATE
    assert r.step_s == pytest.approx(start + body, rel=1e-12)
    assert r.consumer_wait_s == pytest.approx(start, rel=1e-12)


def test_a_routed_experts_fills_start_after_its_router():
    """The expert's producer waits for the router's event, so its first fill lands a hand-off and a fill
    latency after the router ends, however early its CTA reached it."""
    f = fills(EXPERT, 64)
    w = 2 * 64 * 64 * 2
    b = w / f
    lists = [[Task(2, {}, (), 0, "router")], [Task(1, {"weight": 1, "weight_up": 1, "row_count": 64}, (0,), None, "expert", weight_wait=0)]]
    r = replay(table_of(lists, 1), [[(0, 4096)], [(w, 0)]], RingModel(64, 4, WARPS), COSTS)
    router_end = COSTS.direct_default[0] + 4096 / COSTS.direct_default[1]
    last_land = router_end + COSTS.handoff + COSTS.fill_latency + (f - 1) * b / COSTS.sm_stream
    assert r.step_s == pytest.approx(last_land + b / WARP_RATE, rel=1e-12)


def test_the_producer_issue_cost_caps_a_cta_stream():
    f = fills(GEMV, 1024)
    w = 1024 * 64 * 2
    slow = dataclasses.replace(COSTS, fill_issue=2e-6)
    r = replay(table_of([[Task(0, {"weight": 0, "row_count": 1024}, (), None, "g")]]), [[(w, 0)]], RingModel(64, 4, WARPS), slow)
    expected = (f - 1) * slow.fill_issue + slow.fill_latency + w / f / WARP_RATE
    assert r.step_s == pytest.approx(expected, rel=1e-12)


def test_task_bytes_must_match_the_lists():
    with pytest.raises(ValueError, match="one \\(weight, other\\) pair per task"):
        replay(table_of([[Task(3, {}, (), None, "a")]]), [[]], RingModel(4, 4, 8), H200_2026_12_03)


def test_a_ctas_next_task_starts_its_overhead_after_the_previous_body():
    lists = [[Task(3, {}, (), None, "a"), Task(3, {}, (), None, "b")]]
    r = replay(table_of(lists), [[(0, 1000), (0, 3000)]], RingModel(4, 4, 8), COSTS)
    a, b = (COSTS.direct_time("nop", n) for n in (1000, 3000))
    assert r.step_s == pytest.approx(a + COSTS.task_overhead + b, rel=1e-12)
    assert r.times[0][1][0] == pytest.approx(a + COSTS.task_overhead, rel=1e-12)  # b's start stamp


def test_a_combines_weights_stream_while_the_stage_it_waits_for_runs():
    """The expert waits (consumers) for a long task on CTA 1 but its weights only for the router: they are in
    the ring when the wait ends, so its body is the prologue plus consuming them."""
    f = fills(EXPERT, 64)
    w = 2 * 64 * 64 * 2
    lists = [[Task(2, {}, (), 0, "router")], [Task(3, {}, (), 1, "gated")],
             [Task(1, {"weight": 1, "weight_up": 1, "row_count": 64}, (0, 1), None, "combine", weight_wait=0)]]
    r = replay(table_of(lists, 2), [[(0, 4096)], [(0, 20000)], [(w, 0)]], RingModel(64, 4, WARPS), COSTS)
    gated_end = COSTS.direct_time("nop", 20000)
    router_end = COSTS.direct_default[0] + 4096 / COSTS.direct_default[1]
    assert router_end + COSTS.handoff + COSTS.fill_latency + (f - 1) * (w / f) / COSTS.sm_stream < gated_end + COSTS.handoff
    assert f <= WARPS  # one fill per warp, side by side
    assert r.step_s == pytest.approx(gated_end + COSTS.handoff + COSTS.prologue + (w / f) / WARP_RATE, rel=1e-12)


def test_an_mla_decode_task_costs_its_chunk_rows_at_the_context():
    """A chunk of L = max(ceil(n / chunks), min rows) rows, clipped to the n tokens of the context: at n = 10 over 4
    chunks of at least 8 rows, chunk 0 has 8 rows and chunk 1 the other 2; at n = 100 every chunk has 25. The task
    costs its fixed time plus mla_head_row per (row, head); without a context, the cache's length (max_len)."""
    params = MlaDecodeParams(num_heads=4, kv_lora_rank=64, rope_dim=32, max_len=128, batch=1, num_chunks=4, min_chunk_rows=8, scale=0.1)
    assert mla_chunk_rows(params, 10) == [8, 2, 0, 0] and mla_chunk_rows(params, 100) == [25, 25, 25, 25]
    assert mla_chunk_rows(params, 128) == [32, 32, 32, 32]
    costs = dataclasses.replace(COSTS, direct={"mla_decode": (1e-6, 1e15)}, mla_head_row=1e-8)
    table = TaskTable([OpVariant("mla_decode", params)], [[Task(0, {"chunk": 1, "head_count": 3}, (), None, "d")]], [], arena_bytes=4096)

    def step(context):
        return replay(table, [[(0, 0)]], RingModel(4, 4, WARPS), costs, context).step_s

    assert step(10) == pytest.approx(1e-6 + 2 * 3 * 1e-8, rel=1e-12)
    assert step(100) == pytest.approx(1e-6 + 25 * 3 * 1e-8, rel=1e-12)
    assert step(None) == pytest.approx(1e-6 + 32 * 3 * 1e-8, rel=1e-12)
    assert H200_2026_12_03.mla_head_row > 0


def test_grouped_experts_stream_the_expected_distinct_experts():
    """4 requests choosing 2 of 4 experts independently touch 4 (1 - (1/2)^4) = 3.75 of them in expectation: a grouped
    expert_gated task of slot j holds units j, j + 2 of round(3.75) = 4 (half its 4 per-request fills), a grouped
    combine 3.75 of its 8 pairs' experts; ungrouped tasks stream them all."""
    from k3mk.ir.replay import grouped_share
    from k3mk.ir.streaming import fill_plan
    from k3mk.ir.task_table import ExpertCombineParams

    gated = fill_plan("expert_gated", ExpertGatedParams(64, 64, 4, 4, 2))
    combine = fill_plan("expert_combine", ExpertCombineParams(64, 64, 4, 4, 2))
    assert gated.grouped and combine.grouped
    assert grouped_share(gated, 0) == grouped_share(gated, 1) == 0.5
    assert grouped_share(combine, 0) == pytest.approx(3.75 / 8)
    assert not fill_plan("expert_gated", ExpertGatedParams(64, 64, 256, 4, 2)).grouped  # 7.9 of 8 distinct


def test_the_mla_term_replays_the_k3_mla_layer_bench():
    """H200_2026_12_03's MLA constants against their op microbenchmark: the K3-size MLA layer at 8K
    (tests/runtime bench_mla_k3_t8192: latent, q absorb, 132 decode tasks, v_up; every op a direct one, so its bytes do
    not enter) measured 75.1 us on an H200 (BENCHMARKS.md, 2026-12-02: MLA decode on mma.sync)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
    from moe_mla_cases import moe_mla_cases

    case = next(c for c in moe_mla_cases() if c.name == "bench_mla_k3_t8192")
    table = case.builder.table()
    step = replay(table, [[(0, 0)] * len(ts) for ts in table.lists], RingModel(4, 16, WARPS), H200_2026_12_03, 8192).step_s
    assert step == pytest.approx(75.1e-6, rel=0.05)
