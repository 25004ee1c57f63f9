"""The ring-aware deadlock check (ir/streaming.py check_ring, TaskTable.check_deadlock_free(ring=...)): every
table the compiler emits completes with the streaming loop's producers and consumers, even with the
smallest ring, in random interleavings too; a planted schedule whose producer would stall against its own
consumers is refused, naming the producer and what it waits for."""

from __future__ import annotations

import dataclasses
import random
import sys
from pathlib import Path

import pytest

from k3mk.ir.streaming import RingModel, StreamingError, check_ring, combine_rounds, fill_plan, routing_units, task_units
from k3mk.ir.task_table import (
    ExpertCombineParams,
    ExpertGatedParams,
    Event,
    GemvParams,
    MlaDecodeParams,
    NopParams,
    OpVariant,
    RouterTopkParams,
    Task,
    TaskTable,
    TaskTableError,
    WeightSpec,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "passes"))
from test_emit_models import emitted  # noqa: E402

EXPERT = OpVariant("expert_gated", ExpertGatedParams(64, 64, 4, 1, 2))
GEMV = OpVariant("gemv", GemvParams(64, 256, 1))
ROUTER = OpVariant("router_topk", RouterTopkParams(4, 1, 2))


@pytest.mark.parametrize("name, batch", [("k3-tiny", 1), ("k3-tiny", 4), ("kl", 4)])
def test_emitted_tables_complete_with_any_ring(name, batch):
    table = emitted(name, batch)[2].table
    streamed = sum(fill_plan(v.op, v.params) is not None for v in table.variants)
    assert streamed > 0
    for slots, records in ((13, 16), (2, 2)):
        table.check_deadlock_free(ring=RingModel(slots, records, 8))
    # every model's MLA decode holds a block's 2 fills at once: a 1-slot ring (which no kernel has: codegen/ops.py
    # MIN_RING_SLOTS) is refused
    assert any(v.op == "mla_decode" for v in table.variants)
    with pytest.raises(TaskTableError, match="deadlock in the streaming loop"):
        table.check_deadlock_free(ring=RingModel(1, 1, 8))
    for seed in range(5):  # random interleavings of every CTA's producer and consumers, small rings
        check_ring(table, RingModel(2, 2, 8), random.Random(seed))


@pytest.mark.parametrize("name, batch", [("k3-tiny", 1), ("k3-tiny", 4), ("kl", 4)])
def test_expert_producers_wait_for_their_router_only(name, batch):
    """Every routed-expert task's producer waits on its router's event: for the gated half one of the
    task's own waits, for the combine (which waits on the gated stage) an event the task's own waits
    leave implied, so its weights stream while the gated stage runs. No other task's producer waits."""
    table = emitted(name, batch)[2].table
    router = {i for i, v in enumerate(table.variants) if v.op in ("router", "router_topk")}
    router_events = {t.signal for ts in table.lists for t in ts if t.opcode in router}
    combines = 0
    for t in (t for ts in table.lists for t in ts):
        op = table.variants[t.opcode].op
        if op not in ("expert_gated", "expert_combine"):
            assert t.weight_wait is None
            continue
        assert t.weight_wait in router_events, t.label
        if op == "expert_gated":
            assert t.weight_wait in t.wait, t.label
        else:
            combines += 1
            assert t.weight_wait not in t.wait, t.label
    assert combines > 0


def table_of(lists, variants=(GEMV, EXPERT, ROUTER), events=2) -> TaskTable:
    weights = [WeightSpec("w", "bfloat16", (256, 64)), WeightSpec("w13", "bfloat16", (4, 64, 64))]
    return TaskTable(list(variants), lists, [Event(f"e{i}") for i in range(events)], weights=weights, arena_bytes=4096)


def test_a_producer_that_waits_behind_its_own_consumers_is_refused():
    """CTA 0 runs a routed expert whose router comes later in the same list: the expert's producer waits
    for the router's ids, so it never forwards the router's record, and the consumers (who need that
    record) never run the router."""
    gemv = Task(0, {"weight": 0, "row_count": 64}, (), 1, "gemv")
    expert = Task(1, {"weight": 1, "weight_up": 1, "row_count": 64}, (0,), None, "expert", weight_wait=0)
    router = Task(2, {}, (1,), 0, "router")
    table = table_of([[gemv, expert, router]])
    with pytest.raises(TaskTableError, match=r"(?s)deadlock in the streaming loop.*CTA 0: producer at task 1 \(expert; waits on "
                                              r"event 0 \(e0: 0/1\); its weights wait on event 0 \(e0: 0/1\)\); consumers at task 1"):  # fmt: skip
        table.check_deadlock_free(ring=RingModel(4, 4, 8))


def test_the_same_tasks_in_a_sound_order_complete():
    gemv = Task(0, {"weight": 0, "row_count": 64}, (), 1, "gemv")
    router = Task(2, {}, (1,), 0, "router")
    expert = Task(1, {"weight": 1, "weight_up": 1, "row_count": 64}, (0,), None, "expert", weight_wait=0)
    table_of([[gemv, router, expert]]).check_deadlock_free(ring=RingModel(1, 1, 8))


def test_a_ring_of_one_slot_streams_a_task_larger_than_the_ring():
    """A gemv of 256 rows is many fills; with one slot the producer and consumers alternate fill by fill."""
    plan = fill_plan("gemv", GEMV.params)
    assert plan.task_fills(256) > 1
    a = Task(0, {"weight": 0, "row_count": 256}, (), 0, "a")
    b = Task(0, {"weight": 0, "row_count": 256}, (0,), 1, "b")
    c = Task(3, {}, (1,), None, "c")
    table_of([[a], [b], [c]], (GEMV, EXPERT, ROUTER, OpVariant("nop", NopParams()))).check_deadlock_free(ring=RingModel(1, 1, 8))


def test_an_expert_whose_producer_would_not_wait_for_its_router_is_refused():
    """The router writes the ids the expert reads: an expert task without that weight wait would let its
    producer stream the experts of the previous step's ids (a race, not a hang: only this check sees it)."""
    router = Task(2, {}, (), 0, "router")
    expert = Task(1, {"weight": 1, "weight_up": 1, "row_count": 64}, (0,), None, "expert")
    with pytest.raises(TaskTableError, match=r"expert_gated reads expert ids a router task writes \(event \[0\]\), but its "
                                             r"producer's weight wait is None"):  # fmt: skip
        table_of([[router], [expert]]).validate()
    table_of([[router], [dataclasses.replace(expert, weight_wait=0)]]).validate()


def test_routing_units_number_the_distinct_experts_by_their_first_pair():
    """A grouped expert_gated's experts (FillPlan.grouped): each distinct expert once, with the slot each request chose
    it in, numbered in the order of its first (request, slot) pair; unit n goes to the task of slot n % top_k."""
    ids = [[3, 1, 4], [1, 5, 9], [2, 6, 5]]
    assert routing_units(ids) == [(3, {0: 0}), (1, {0: 1, 1: 0}), (4, {0: 2}), (5, {1: 1, 2: 2}), (9, {1: 2}), (2, {2: 0}),
                                  (6, {2: 1})]  # fmt: skip
    assert [[e for e, _ in task_units(ids, j)] for j in range(3)] == [[3, 5, 6], [1, 9], [4, 2]]
    # the combine's pairs by expert: 3 | 1 1 | 4 | 5 5 | 9 | 2 | 6; in rounds of 5 warps expert 5 straddles two rounds
    assert combine_rounds(ids, 4) == [[3, 1, 4], [5, 9, 2], [6]] and combine_rounds(ids, 5) == [[3, 1, 4, 5], [5, 9, 2, 6]]


@pytest.mark.parametrize("seed", range(20))
def test_routing_units_cover_every_pair_once_and_balance_the_tasks(seed):
    rng = random.Random(seed)
    batch, top_k, experts = rng.choice([(2, 4, 9), (4, 16, 64), (4, 8, 256), (8, 16, 64), (16, 16, 896)])
    skew = rng.random() < 0.3  # every request on the same experts
    chosen = rng.sample(range(experts), top_k)
    ids = [rng.sample(chosen, top_k) if skew else rng.sample(range(experts), top_k) for _ in range(batch)]
    units = routing_units(ids)
    assert len(units) == len({e for row in ids for e in row}) and (not skew or len(units) == top_k)
    pairs = sorted((b, j, e) for e, slots in units for b, j in slots.items())
    assert pairs == sorted((b, j, e) for b, row in enumerate(ids) for j, e in enumerate(row))
    counts = [len(task_units(ids, j)) for j in range(top_k)]
    assert sum(counts) == len(units) and max(counts) - min(counts) <= 1 and max(counts) <= batch
    rounds = combine_rounds(ids, 8)  # every expert once, once more per round it straddles into
    assert len(units) <= sum(map(len, rounds)) <= len(units) + len(rounds) - 1 and all(len(r) <= 8 for r in rounds)


@pytest.mark.parametrize("experts,top_k,batch,grouped", [
    (64, 16, 4, True),  # the K3 proxies: 0.68 of the pairs distinct, were requests routed independently
    (256, 8, 4, False),  # Kimi Linear: 0.95
    (896, 16, 4, False),  # K3: 0.97
    (896, 16, 16, True),  # K3 at batch 16: 0.88
    (64, 16, 1, False),  # batch 1: nothing to share
])  # fmt: skip
def test_experts_are_grouped_where_requests_would_share_them(experts, top_k, batch, grouped):
    """FillPlan.grouped: whole rows and expected distinct experts at most GROUPING_DISTINCT of the pairs (with every
    pair's expert distinct the grouping's tables cost 2-3%: BENCHMARKS.md 2026-12-03 late night)."""
    gated = fill_plan("expert_gated", ExpertGatedParams(3584, 3072, experts, batch, top_k, "mxfp4", "situ"))
    combine = fill_plan("expert_combine", ExpertCombineParams(3072, 3584, experts, batch, top_k, "mxfp4"))
    assert gated.grouped == combine.grouped == grouped


def test_an_mla_decode_block_holds_two_fills_of_a_two_slot_ring():
    """An mla_decode task streams its chunk's KV rows in blocks of 2 fills that every consumer warp holds together
    (ir/streaming.py FillPlan.held): 2 slots suffice whatever the chunk's length, 1 is a deadlock the check names."""
    mla = OpVariant("mla_decode", MlaDecodeParams(8, 512, 64, 4096, 1, 16, 16, 0.1))
    plan = fill_plan(mla.op, mla.params)
    assert (plan.rows, plan.pitch, plan.held, plan.out_features) == (8, (576 + 8) * 2, 2, 256)
    assert plan.task_fills(0) == 2 * 256 // 16 and plan.slot_need == 8 * 1168
    tasks = [Task(0, {"chunk": c}, (), None, f"mla {c}") for c in range(3)]
    check_ring(table_of([tasks], (mla,)), RingModel(2, 2, 8))
    for seed in range(3):
        check_ring(table_of([tasks[:2], tasks[2:]], (mla,)), RingModel(2, 2, 8), random.Random(seed))
    with pytest.raises(ValueError, match=r"deadlock in the streaming loop \(1 ring slots, 2 records\): every mla_decode task holds 2 fills at once"):
        check_ring(table_of([tasks], (mla,)), RingModel(1, 2, 8))


def test_mla_decode_kv_rows_that_do_not_fit_a_slot_are_refused():
    wide = MlaDecodeParams(8, 1024, 64, 4096, 1, 16, 16, 0.1)  # 8 rows x 2192 B > 16 KB
    with pytest.raises(StreamingError, match="8 KV rows of 1088 elements"):
        fill_plan("mla_decode", wide)
    assert fill_plan("mla_decode", wide, 32 * 1024).slot_need == 8 * (1088 + 8) * 2
