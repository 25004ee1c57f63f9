"""The cost model of the engine that runs (PERFORMANCE.md E9): a replay of an emitted task table on the
streaming loop (docs/megakernel.md "The streaming task loop"), with constants measured on the GPU.

Per CTA two processes, as in the kernel and in the ring-aware deadlock check (ir/streaming.py check_ring):
- the producer walks the list in order. It forwards task i's record once the consumers finished task
  i - records; a routed expert then waits for its router's event (the table's weight wait); then it
  issues the task's ring fills (ir/streaming.py fill_plan), fill f once the consumers released fill
  f - slots. A fill lands `fill_latency` after its issue, and the CTA's fills land no faster than the
  CTA's share of HBM (`sm_stream` bytes/s, one stream per SM);
- the consumers take task i once its record is there and the previous task is done, wait for its events
  (`handoff` after the last producer's end), and run the body: a streaming op spends its `prologue`
  (input staging), then each fill's consumer warp (ir/streaming.py FillPlan.owners) takes it no earlier than
  it landed and `fill bytes / (consume rate / warps)` after that warp's previous fill, and the body ends
  with its last warp (the CTA barrier before the release); any other op reads what it reads straight from memory (a fixed
  time plus its bytes at a per-op rate; an MLA decode task also `mla_head_row` per KV row and head of its
  chunk at the step's context, the chunk's run-time length: ir/fused.py kv_chunk_bounds), and signals;
  taking the next record costs the CTA `task_overhead`. The step ends with the last body (the profile's
  wall: first start to last body_end).

The routed experts grouped by expert (batch > 1, ir/streaming.py FillPlan.grouped) stream the distinct experts that
requests routed independently would choose (`grouped_share`), while their consumers still take a pass per request
(the MXFP4 gated expert's: one pass for 4): a step whose requests share more experts streams less.

What it leaves out: HBM shared unevenly (an SM streaming alone gets more than its share: the model errs
slow when few SMs stream), L2 hits, the KDA state's L2 prefetch.

Every constant is a measurement: `H200_2026_12_03` says which. The replay runs in an order the events
allow (ir/table_exec.py table_order), so each task's inputs are known when it is timed. Python over the
table and per-task byte counts (the compiler's: `compiler/pipeline.py` passes them), like the deadlock
check; `bench/decode_bench.py` replays each cell at its context.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from typing import Sequence

import torch

from k3mk.ir.fused import kv_chunk_bounds
from k3mk.ir.streaming import FillPlan, RingModel, expected_distinct_experts, fill_plan
from k3mk.ir.table_exec import table_order
from k3mk.ir.task_table import MlaDecodeParams, TaskTable


@dataclass(frozen=True)
class EngineCosts:
    """The streaming engine's constants on one GPU (module docstring)."""

    sm_stream: float  # bytes/s of one SM's weight stream while every SM streams: copy bandwidth / SMs
    fill_latency: float  # s from a ring fill's bulk copy issue to its landing, loaded
    fill_issue: float  # s the producer lane spends per fill (slot wait when free, expect_tx, the copies, SLOT_SEQ)
    handoff: float  # s from an event's last signal to its waiter running
    task_overhead: float  # s between a task's body end (its release) and the next task's start on its CTA
    consume: dict[str, float]  # bytes/s at which a CTA's consumer warps together take a streaming op's fills (bf16; "mxfp4": MXFP4 experts)
    prologue: float  # s a streaming op spends before its first fill (input staged, norm statistics)
    direct: dict[str, tuple[float, float]] = field(default_factory=dict)  # other op: (fixed s, bytes/s of what it reads / writes)
    direct_default: tuple[float, float] = (1.0e-6, 20e9)
    mla_head_row: float = 0.0  # s an mla_decode task spends per KV row of its chunk and per head (module docstring)

    def direct_time(self, op: str, nbytes: int) -> float:
        fixed, rate = self.direct.get(op, self.direct_default)
        return fixed + nbytes / rate

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @staticmethod
    def from_json(data: dict) -> "EngineCosts":
        d = dict(data)
        d["direct"] = {k: tuple(v) for k, v in d.get("direct", {}).items()}
        if "direct_default" in d:
            d["direct_default"] = tuple(d["direct_default"])
        return EngineCosts(**d)


# H200, 2026-12-03 afternoon (BENCHMARKS.md "2026-12-03, afternoon"): bench/calibrate.py on the Kimi Linear 48B b1
# timeline of the waiter / signaller kernel at position 1,005 (813c1ba's profile build, whose kernel differs from
# d3a0ce2's only in the GEMV epilogue's load order, measured neutral; 3,066 us recorded, 3,203 replayed), except where
# a line says otherwise
H200_2026_12_03 = EngineCosts(
    sm_stream=4.20e12 / 132,  # the decode bench's copy bandwidth that day, 4.20 TB/s, over 132 SMs
    fill_latency=0.75e-6,  # the calibration grid's value closest to the recorded step (its smallest)
    fill_issue=0.373e-6,  # the median producer time per fill of the streaming tasks that wait on nothing
    handoff=0.954e-6,  # the median blocking hand-off (the signaller's wake-up and release, L2, the waiter's poll)
    task_overhead=0.0,  # the median gap from a body's end to the next task's start (the arrive on `done`: < 32 ns)
    # bf16: the fit over streaming tasks whose fills had landed (with every warp holding fills since the chunk-major
    # order, the bytes barely show: the fixed part is the body); MXFP4 (no Kimi Linear task streams it): the K3 proxy
    # b1 timeline of the same build, its expert bodies' bytes over their time from the first fill to the last release
    # (gated 27.2, combine 28.8 GB/s per CTA; the K3-size benches' 2.67 / 2.25 TB/s over 132 CTAs, 18.6 GB/s, made the
    # replay 16-20% slow on the K3 proxy b1)
    consume={"bfloat16": 490.8e9, "mxfp4": 28.0e9},
    prologue=3.14e-6,  # the same fit's fixed part per task (input staging, norm statistics, the epilogues, the barrier)
    direct={
        # kda_recurrence at K3 size (96 tasks on 96 CTAs, L2 evicted, 2026-12-01): b1 12.6 us, b4 28.6 us a step,
        # 5.8 us empty: 1.0 us + the state's bytes at 23 GB/s fits both batches (a b1 fit alone has no byte term)
        "kda_recurrence": (1.0e-6, 23e9),
        # the others: the b1 fit, a fixed time per task (their bytes did not fit a rate at one batch)
        "kda_conv": (5.25e-6, 1e15),
        # mla_decode's fixed part: Kimi Linear b4 timelines of 576f448 at positions 1,006 and 8,106 (BENCHMARKS.md,
        # 2026-12-02 late evening: the FMA kernel's 37.9 / 242.9 ms of bodies over 3,696 tasks, 0.90M / 7.26M (KV row, head) pairs)
        "mla_decode": (2.4e-6, 1e15),
        "mla_q_absorb": (5.25e-6, 1e15),
        "mla_v_up": (9.06e-6, 1e15),
        "mla_latent": (2.86e-6, 1e15),
        "rmsnorm": (2.38e-6, 1e15),
        "router_topk": (5.72e-6, 1e15),
        "nop": (1.19e-6, 1e15),
    },
    # per (KV row, head) of an mla_decode task: the K3-size MLA layer bench on mma.sync (tests/runtime bench_mla_k3_t8192:
    # 132 decode tasks of 16 heads x 373 rows at 8K) measured 75.1 us on the H200 (2026-12-02; 77.96 us on an H100 on
    # 2026-12-06 with the KV rows through the ring), which this replay of its table gives at 9.5 ns. The FMA kernel's
    # 32.2 ns (the timelines above; its bench 192.1 us, replayed as 210.8) had the replay 10-16% slow on the batch-1 8K
    # cells of the 2026-12-05 grid and 26% on Kimi Linear b4 8K; with 9.5 ns every one of them is within 4.5-7.6%.
    mla_head_row=9.5e-9,
)


@dataclass
class Replay:
    """The replay's account of one step."""

    step_s: float
    consumer_wait_s: float  # summed over CTAs: consumers waiting for events (their record in hand)
    body_s: float  # summed over CTAs: in op bodies (waiting for fills inside a body included)
    producer_blocked_s: float  # summed over CTAs: the producer waiting for a free slot
    body_by_op: dict[str, float]  # summed body time per op kind
    ctas: int
    # per task [list][position]: (start, wait_done, body_end, produce_start, produce_end, ring_wait) in s, the
    # profile build's stamps (runtime/profile.py) as the replay sees them
    times: list[list[tuple[float, ...]]] = field(default_factory=list)

    def shares(self) -> dict[str, float]:
        total = self.step_s * self.ctas
        return {"consumer_wait": self.consumer_wait_s / total, "body": self.body_s / total,
                "producer_blocked": self.producer_blocked_s / total}  # fmt: skip


def grouped_share(plan: FillPlan, slot: int) -> float:
    """The share of its per-(request, slot) fills a grouped task streams when the requests route independently
    (ir/streaming.py expected_distinct_experts): expert_gated the task's share of the distinct experts (units slot,
    slot + top_k, ...) over its `batch`; expert_combine the distinct experts over the pairs (rounds' straddles
    neglected)."""
    distinct = expected_distinct_experts(plan.num_experts, plan.top_k, plan.batch)
    if plan.op == "expert_gated":
        return len(range(slot, round(distinct), plan.top_k)) / plan.batch
    return distinct / (plan.batch * plan.top_k)


def streamed_plans(table: TaskTable, slot_bytes: int) -> list[FillPlan | None]:
    """Each variant's fill plan as the replay prices it: an mla_decode task's KV rows come through the ring too
    (ir/streaming.py _kv_fill_plan), but the replay times it as a direct op with its per-(row, head) term, which
    holds its consumers' MMA time (from the K3 MLA layer bench: mla_head_row; the ring kernel timed that bench within
    1.1% of the one whose consumers staged the rows from L2, 2026-12-06)."""
    plans = [fill_plan(v.op, v.params, slot_bytes) for v in table.variants]
    return [None if plan is not None and plan.kv_rows else plan for plan in plans]


def mla_chunk_rows(params: MlaDecodeParams, context: int) -> list[int]:
    """KV rows of each chunk of an mla_decode variant when a request's context is `context` tokens (its
    position + 1): ir/fused.py kv_chunk_bounds, the split the kernel makes at run time."""
    start, end = kv_chunk_bounds(torch.tensor([context - 1]), params.num_chunks, params.min_chunk_rows)
    return (end - start)[0].tolist()


def replay(
    table: TaskTable, task_bytes: Sequence[Sequence[tuple[int, int]]], ring: RingModel, costs: EngineCosts, context: int | None = None
) -> Replay:
    """Time one step of `table` on a kernel with ring `ring`; `task_bytes[s][i]` = (weights streamed,
    other bytes read or written) of task i of list s; every request at `context` tokens (default: the
    MLA caches' length, the artifact's max context)."""
    n = len(table.lists)
    if [len(b) for b in task_bytes] != [len(ts) for ts in table.lists]:
        raise ValueError("task_bytes needs one (weight, other) pair per task of every list")
    plans = streamed_plans(table, ring.slot_bytes)
    chunk_rows = [mla_chunk_rows(v.params, context or v.params.max_len) if v.op == "mla_decode" else [] for v in table.variants]
    event_done = [0.0] * len(table.events)
    # per CTA: the consumers' end of each task so far, the producer's clock, each fill's land / release time
    ends: list[list[float]] = [[] for _ in range(n)]
    times: list[list[tuple[float, ...]]] = [[()] * len(ts) for ts in table.lists]
    producer = [0.0] * n
    landed: list[list[float]] = [[] for _ in range(n)]
    released: list[list[float]] = [[] for _ in range(n)]
    wait_s = body_s = blocked_s = step = 0.0
    by_op: dict[str, float] = {}
    for s, k in table_order(table):
        task = table.lists[s][k]
        variant = table.variants[task.opcode]
        plan = plans[task.opcode]
        weight_bytes, other_bytes = task_bytes[s][k]
        free = ends[s][-1] if ends[s] else 0.0
        # the producer: the record slot, a routed expert's wait for its router, then the fills
        p = max(producer[s], ends[s][k - ring.records] if k >= ring.records else 0.0)
        produce_start, blocked_before = p, blocked_s
        if task.weight_wait is not None:
            p = max(p, event_done[task.weight_wait] + costs.handoff)
        fills = plan.task_fills(task.operands.get("row_count", 0)) if plan is not None else 0
        if plan is not None and plan.grouped:
            # the routed experts grouped by expert: the distinct experts of requests routed independently (the task
            # table's bytes count one expert per (request, slot))
            share = grouped_share(plan, task.operands.get("slot", 0))
            weight_bytes *= share
            fills = max(1, round(fills * share))
        fill_bytes = weight_bytes / fills if fills else 0.0
        # the consumers' work per fill: a grouped fill serves 1 / share requests, one pass each, except the MXFP4 gated
        # expert's (its requests are the MMA's columns: one pass)
        passes = 1.0 / share if plan is not None and plan.grouped and not (plan.op == "expert_gated" and any(st.mma_rows for st in plan.streams)) else 1.0
        # the consumers take the task once its record is there and the previous task is done (the profile's
        # start stamp), then wait for its events (its wait_done)
        start = max(p, free)
        ready = max([event_done[e] + costs.handoff for e in task.wait] + [start])
        wait_s += ready - start
        if fills:
            # each fill is one consumer warp's (ir/streaming.py FillPlan.owners), taken at the warp's share of the
            # CTA's consume rate; the task ends with its last warp (the CTA barrier before its release)
            rate = costs.consume["mxfp4" if getattr(variant.params, "weight_format", "") == "mxfp4" else "bfloat16"] / ring.warps
            owners = plan.owners(task.operands.get("row_count", 0), ring.warps)
            warp_free = [ready + costs.prologue] * ring.warps
            for i, f in enumerate(range(len(landed[s]), len(landed[s]) + fills)):
                slot_free = released[s][f - ring.slots] if f >= ring.slots else 0.0  # an earlier fill, maybe of this task
                if slot_free > p:
                    blocked_s += slot_free - p
                    p = slot_free
                stream = landed[s][-1] + fill_bytes / costs.sm_stream if landed[s] else 0.0
                landed[s].append(max(p + costs.fill_latency, stream))
                p += costs.fill_issue
                w = owners[i]
                warp_free[w] = max(warp_free[w], landed[s][f]) + fill_bytes * passes / rate
                released[s].append(warp_free[w])
            end = max(warp_free)
        else:
            end = ready + costs.direct_time(variant.op, weight_bytes + other_bytes)
            if chunk_rows[task.opcode]:
                end += chunk_rows[task.opcode][task.operands.get("chunk", 0)] * task.operands.get("head_count", 0) * costs.mla_head_row
        producer[s] = p
        times[s][k] = (start, ready, end, produce_start, p, blocked_s - blocked_before)
        body_s += end - ready
        by_op[variant.op] = by_op.get(variant.op, 0.0) + end - ready
        # the release follows the body at once (the profile's body_end stamp); taking the next record is
        # the CTA's own overhead
        ends[s].append(end + costs.task_overhead)
        step = max(step, end)
        if task.signal is not None:
            # a router GEMV's tiles: the last to arrive selects before its signal (gemv.py.j2 "router"); the
            # selection is the router_topk task's body without its own hand-off
            select = costs.direct_time("router_topk", 0) if table.is_router_tile(task) else 0.0
            event_done[task.signal] = max(event_done[task.signal], end + select)
    return Replay(step, wait_s, body_s, blocked_s, by_op, n, times)
