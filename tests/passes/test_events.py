"""passes/build_events.py, check_events.py, check_deadlock.py: the static check accepts the events the
passes build (k3-tiny and a small Kimi Linear, batch 1 and 4, TP1 and TP2), rejects a table missing
any one dependency that is not redundant, lets program order stand in for events once tasks are on SM
lists, catches a bad memory plan and in-place state hazards, and finds deadlocks."""

from __future__ import annotations

import copy
import dataclasses
import functools
import random

import pytest
import torch

from k3mk.compiler.capture import capture
from k3mk.compiler.config import load_config
from k3mk.ir.graph import Graph, Node, Role, Tensor
from k3mk.ir.ops import Linear, MLAAttention, MLACacheWrite
from k3mk.ir.tasks import Event, Task, TaskGraph, buffer_name, byte_runs
from k3mk.passes.build_events import MAX_WAITS, EventError, build_events
from k3mk.passes.check_deadlock import DeadlockError, check_deadlock
from k3mk.passes.check_events import EventCheckError, check_events
from k3mk.passes.fuse import fuse
from k3mk.passes.manager import Target
from k3mk.passes.plan_memory import plan_memory
from k3mk.passes.tile import tile
from k3mk.passes.tp_shard import tp_shard


CONFIGS = {"k3-tiny": lambda: load_config("k3-tiny"), "kimi-linear-small": lambda: load_config("kimi-linear-tiny")}
TARGET = Target.for_arch(load_config("k3-tiny"), num_sms=8)


@functools.cache
def with_events(name: str, batch: int, tp: int, fused_: bool) -> TaskGraph:
    config = CONFIGS[name]()
    target = Target.for_arch(config, num_sms=8, tp=tp, max_tokens=batch, max_context=8, dtype=torch.float32)
    graph = capture(config, batch, 8, torch.float32)
    if tp > 1:
        graph = tp_shard(graph, target)
    if fused_:
        graph = fuse(graph, target)
    tg = build_events(plan_memory(tile(graph, target), target), target)
    tg.verify()
    return tg


def fresh(tg: TaskGraph) -> TaskGraph:
    """A copy whose synchronisation (events, waits, signals, SM lists) can be changed freely."""
    out = copy.copy(tg)
    out.tasks = [dataclasses.replace(t, waits=list(t.waits), signals=list(t.signals)) for t in tg.tasks]
    out.events = list(tg.events)
    out.sm_lists = [list(ts) for ts in tg.sm_lists]
    return out


def round_robin(tg: TaskGraph, sms: int) -> TaskGraph:
    """Task i on SM i % sms, every list in id order (a stand-in for the schedule pass)."""
    tg = fresh(tg)
    tg.sm_lists = [[t.id for t in tg.tasks[s::sms]] for s in range(sms)]
    for s, ts in enumerate(tg.sm_lists):
        for i, t in enumerate(ts):
            tg.tasks[t].sm, tg.tasks[t].order = s, i
    return tg


CASES = [
    ("k3-tiny", 1, 1, False),
    ("k3-tiny", 1, 1, True),
    ("k3-tiny", 4, 1, True),
    ("k3-tiny", 2, 2, True),
    ("kimi-linear-small", 1, 1, False),
    ("kimi-linear-small", 1, 1, True),
    ("kimi-linear-small", 4, 1, True),
]


@pytest.mark.parametrize("name, batch, tp, fused_", CASES)
def test_the_check_accepts_the_events_the_passes_build(name, batch, tp, fused_):
    tg = with_events(name, batch, tp, fused_)
    check_events(tg)
    for t in tg.tasks:  # the task table's limits (docs/task_table.md) and counts derived from producers
        assert len(t.waits) <= MAX_WAITS and len(t.signals) <= 1
        for e, count in t.waits:
            assert count == len(tg.events[e].producers) and max(tg.events[e].producers) < t.id
    assert {p for e in tg.events for p in e.producers} == {t.id for t in tg.tasks if t.signals}
    scheduled = round_robin(tg, 4)
    check_deadlock(scheduled)
    check_events(scheduled)


# --- removing one dependency -------------------------------------------------------------------------


def happens_before(tg: TaskGraph) -> list[int]:
    """Per task, the bitset of tasks that happen before it through the events (id order is topological)."""
    before = [0] * len(tg.tasks)
    done = [0] * len(tg.events)
    for t in tg.tasks:
        for e, _ in t.waits:
            before[t.id] |= done[e]
        for e in t.signals:
            done[e] |= before[t.id] | (1 << t.id)
    for t in tg.tasks:  # waits on events whose producers come later (none here) would need a second pass
        assert all(max(tg.events[e].producers, default=-1) < t.id for e, _ in t.waits)
    return before


def conflicts(tg: TaskGraph) -> list[int]:
    """Per task d, the bitset of earlier tasks that touch a byte d touches, one of them writing it:
    brute force over byte runs of every region (arena slots; a state and its STATE_OUT are one buffer)."""
    accesses: dict[str, list[tuple[int, int, int, bool]]] = {}
    for t in tg.tasks:
        for regions, writes in ((t.reads, False), (t.writes, True)):
            for r in regions:
                tensor = tg.graph.tensors[r.tensor]
                base = tg.arena[r.tensor][0] if r.tensor in tg.arena else 0
                buffer = "arena" if r.tensor in tg.arena else buffer_name(tg.graph, r.tensor)
                for lo, hi in byte_runs(r.box, tensor.shape, tensor.dtype.itemsize):
                    accesses.setdefault(buffer, []).append((base + lo, base + hi, t.id, writes))
    out = [0] * len(tg.tasks)
    for runs in accesses.values():
        runs.sort()
        active: list[tuple[int, int, int, bool]] = []
        for run in runs:
            active = [a for a in active if a[1] > run[0]]
            for a in active:
                if a[2] != run[2] and (a[3] or run[3]):
                    first, second = sorted((a[2], run[2]))
                    out[second] |= 1 << first
            active.append(run)
    return out


def remove_wait(tg: TaskGraph, waiter: int, event: int) -> TaskGraph:
    tg = fresh(tg)
    tg.tasks[waiter].waits = [(e, c) for e, c in tg.tasks[waiter].waits if e != event]
    return tg


def remove_producer(tg: TaskGraph, producer: int, event: int) -> TaskGraph:
    """`producer` no longer signals `event`; the expected counts follow from the remaining producers."""
    tg = fresh(tg)
    tg.tasks[producer].signals = [e for e in tg.tasks[producer].signals if e != event]
    tg.events[event] = Event(event, tuple(p for p in tg.events[event].producers if p != producer))
    for t in tg.tasks:
        t.waits = [(e, tg.events[e].expected) for e, _ in t.waits]
    return tg


def with_redundant_waits(tg: TaskGraph, count: int, rng: random.Random) -> tuple[TaskGraph, list[tuple[int, int]]]:
    """`tg` plus `count` waits that are implied: task w waits on e, a producer of e waits on e2, so
    adding "w waits on e2" changes nothing."""
    tg = fresh(tg)
    added = []
    candidates = [t for t in tg.tasks if t.waits]
    while len(added) < count:
        w = rng.choice(candidates)
        e = rng.choice(w.waits)[0]
        producer = tg.tasks[rng.choice(tg.events[e].producers)]
        implied = [e2 for e2, _ in producer.waits if e2 not in {x for x, _ in w.waits}]
        if implied:
            w.waits.append((implied[0], tg.events[implied[0]].expected))
            added.append((w.id, implied[0]))
    return tg, added


@pytest.mark.parametrize("name, fused_", [("k3-tiny", True), ("kimi-linear-small", False)])
def test_removing_one_dependency_is_caught_unless_it_is_redundant(name, fused_):
    """Redundant: the happens-before relation is unchanged (every lost edge is implied through another
    path). The check must reject exactly when some pair of tasks that touch a common byte, one of them
    writing, loses its order; build_events leaves no redundant wait, so every removal from its table
    is caught, and removing a redundant wait added to it is accepted."""
    rng = random.Random(0)
    tg, added = with_redundant_waits(with_events(name, 1, 1, fused_), 5, rng)
    check_events(tg)
    before, touching = happens_before(tg), conflicts(tg)
    waits = [(t.id, e) for t in tg.tasks for e, _ in t.waits]
    signals = [(p, e.id) for e in tg.events for p in e.producers]
    removals = [("wait", w, e) for w, e in added]
    removals += [("wait", *rng.choice(waits)) for _ in range(15)] + [("producer", *rng.choice(signals)) for _ in range(10)]
    for kind, task, event in removals:
        broken = remove_wait(tg, task, event) if kind == "wait" else remove_producer(tg, task, event)
        after = happens_before(broken)
        lost = [b & ~a for b, a in zip(before, after)]
        redundant = not any(lost)
        harmful = any(x & c for x, c in zip(lost, touching))
        assert harmful == (not redundant) and redundant == ((task, event) in added), (kind, task, event)
        if harmful:
            with pytest.raises(EventCheckError, match="is not ordered after"):
                check_events(broken)
        else:
            check_events(broken)


def test_program_order_stands_in_for_events_on_one_sm():
    tg = with_events("k3-tiny", 1, 1, True)
    bare = fresh(tg)
    for t in bare.tasks:
        t.waits, t.signals = [], []
    bare.events = []
    with pytest.raises(EventCheckError, match="is not ordered after"):
        check_events(bare)
    check_events(round_robin(bare, 1))  # one SM runs everything in id order
    with pytest.raises(EventCheckError, match="via program order"):
        check_events(round_robin(bare, 2))


def test_a_missing_wait_across_sms_is_caught_after_scheduling():
    tg = round_robin(with_events("k3-tiny", 1, 1, True), 4)
    waiter = next(t for t in tg.tasks if t.waits and any(tg.tasks[p].sm != t.sm for p in tg.events[t.waits[0][0]].producers))
    with pytest.raises(EventCheckError, match=rf"task t{waiter.id} "):
        check_events(remove_wait(tg, waiter.id, waiter.waits[0][0]))


# --- memory and state hazards ------------------------------------------------------------------------


def test_a_plan_that_overlaps_live_tensors_is_caught():
    tg = fresh(with_events("k3-tiny", 1, 1, True))
    linear = next(n for n in tg.graph.nodes if n.op.name == "rmsnorm_linear")
    other = next(n for n in tg.graph.nodes if n.op.name == "rmsnorm_linear" and n is not linear and n.inputs[0] == linear.inputs[0])
    a, b = linear.outputs[0], other.outputs[0]  # both live until the KDA conv reads them
    tg.arena = {**tg.arena, b: (tg.arena[a][0], tg.arena[b][1])}
    with pytest.raises(EventCheckError, match=rf"reads {a}\[.*hold '{b}'"):
        check_events(tg)


def test_arena_reuse_is_ordered_by_write_after_read_events():
    """x -> lin_a -> a -> lin_b -> b and x -> lin_c -> c, with c planned over a's bytes by hand (the
    planner would not: lin_c does not depend on lin_b). Only write-after-read events from lin_b's tasks
    to lin_c's keep lin_c from overwriting a before lin_b has read it."""
    g = Graph(meta={"tp": 1})
    width = 256
    for name in ("w_a", "w_b", "w_c"):
        g.add_tensor(Tensor(name, (width, width), torch.float32, Role.WEIGHT))
    g.add_tensor(Tensor("x", (1, width), torch.float32, Role.INPUT))
    g.add_tensor(Tensor("a", (1, width), torch.float32, Role.ACTIVATION))
    g.add_tensor(Tensor("b", (1, width), torch.float32, Role.OUTPUT))
    g.add_tensor(Tensor("c", (1, width), torch.float32, Role.ACTIVATION))
    g.add_node(Node("lin_a", Linear(False), ("x", "w_a"), ("a",)))
    g.add_node(Node("lin_b", Linear(False), ("a", "w_b"), ("b",)))
    g.add_node(Node("lin_c", Linear(False), ("x", "w_c"), ("c",)))
    g.verify()
    tg = tile(g, TARGET)
    tg.arena, tg.arena_bytes = {"a": (0, 1024), "c": (0, 1024)}, 1024
    build_events(tg)
    check_events(tg)
    lin_b = {t.id for t in tg.tasks if t.node == "lin_b"}
    lin_c = [t for t in tg.tasks if t.node == "lin_c"]
    assert len(lin_b) > 1 and all(lin_b <= {p for e, _ in t.waits for p in tg.events[e].producers} for t in lin_c)
    with pytest.raises(EventCheckError, match=rf"task t{lin_c[0].id} \(lin_c\) writes c\[.*not ordered after task t\d+ \(lin_b\)"):
        check_events(remove_wait(tg, lin_c[0].id, lin_c[0].waits[0][0]))


def state_graph() -> Graph:
    """The MLA cache written in place, then read as the OLD state by a later node: not implementable."""
    g = Graph(meta={"tp": 1})
    heads, nope, rope, v, rank, batch, t_max = 2, 16, 8, 16, 32, 1, 4
    g.add_tensor(Tensor("kv_b", (heads * (nope + v), rank), torch.float32, Role.WEIGHT))
    g.add_tensor(Tensor("q", (batch, heads * (nope + rope)), torch.float32, Role.INPUT))
    g.add_tensor(Tensor("row", (batch, rank + rope), torch.float32, Role.INPUT))
    g.add_tensor(Tensor("positions", (batch,), torch.int64, Role.INPUT))
    g.add_tensor(Tensor("cache", (batch, t_max, rank + rope), torch.float32, Role.STATE))
    g.add_tensor(Tensor("cache.next", (batch, t_max, rank + rope), torch.float32, Role.STATE_OUT, alias="cache"))
    g.add_tensor(Tensor("o", (batch, heads * v), torch.float32, Role.OUTPUT))
    g.add_node(Node("write", MLACacheWrite(), ("cache", "row", "positions"), ("cache.next",)))
    g.add_node(Node("attend", MLAAttention(heads, nope, rope, v, rank), ("q", "cache", "positions", "kv_b"), ("o",)))
    g.verify()
    return g


def test_reading_state_after_its_in_place_overwrite_is_an_error():
    tg = plan_memory(tile(state_graph(), TARGET))
    with pytest.raises(EventError, match=r"overwrites the state bytes of cache.next.* 'attend'"):
        build_events(tg)


def test_the_check_catches_old_state_read_after_the_overwrite():
    g = state_graph()
    tg = plan_memory(tile(g, TARGET))
    write = next(t for t in tg.tasks if t.node == "write")
    tg.events = [Event(0, (write.id,))]
    write.signals = [0]
    for t in tg.tasks:
        if t.node == "attend":
            t.waits = [(0, 1)]
    with pytest.raises(EventCheckError, match=r"reads cache\[.*hold 'cache.next'"):
        check_events(tg)


# --- deadlock ----------------------------------------------------------------------------------------


def two_sm_lists(crossed: bool) -> TaskGraph:
    """t0 waits on e1 (signalled by t3), t2 waits on e0 (signalled by t1). SM 0 runs [t0, t1]; SM 1 runs
    [t2, t3] when `crossed` (each SM's head waits on the other's tail: deadlock), else [t3, t2]."""
    tasks = [
        Task(0, "n", {}, (), (), waits=[(1, 1)]),
        Task(1, "n", {}, (), (), signals=[0]),
        Task(2, "n", {}, (), (), waits=[(0, 1)]),
        Task(3, "n", {}, (), (), signals=[1]),
    ]
    tg = TaskGraph(Graph(), tasks, events=[Event(0, (1,)), Event(1, (3,))])
    tg.sm_lists = [[0, 1], [2, 3] if crossed else [3, 2]]
    for s, ts in enumerate(tg.sm_lists):
        for i, t in enumerate(ts):
            tg.tasks[t].sm, tg.tasks[t].order = s, i
    return tg


def test_two_sms_waiting_on_each_other_deadlock():
    check_deadlock(two_sm_lists(crossed=False))
    with pytest.raises(DeadlockError, match=r"(?s)2 SM lists cannot advance.*SM 0 #0: t0 \(n\) waits on e1 0/1, waiting for t3.*SM 1 #0: t2 \(n\) waits on e0 0/1, waiting for t1"):
        check_deadlock(two_sm_lists(crossed=True))


def test_an_event_cycle_deadlocks_before_scheduling_too():
    tg = two_sm_lists(crossed=False)
    tg.tasks[1].waits = [(1, 1)]  # t1 now needs t3, and t3 ...
    tg.tasks[3].waits = [(0, 1)]  # ... needs t1
    tg.sm_lists = []
    with pytest.raises(DeadlockError, match=r"t1 \(n\) waits on e1 0/1, waiting for t3"):
        check_deadlock(tg)
