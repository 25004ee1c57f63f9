"""schedule: every task on one SM, lists consistent with one topological order (the static checks
prove it deadlock-free and hazard-free), balanced loads, weight prefetch during waits, and the
predicted step time next to the nominal roofline."""

from __future__ import annotations

import math

import networkx as nx
import pytest
import torch

from k3mk.compiler.capture import capture
from k3mk.compiler.config import load_config
from k3mk.ir.graph import Graph, Node, Role, Tensor
from k3mk.ir.ops import Linear
from k3mk.ir.tasks import Event, TaskGraph
from k3mk.passes.check_deadlock import check_deadlock
from k3mk.passes.check_events import check_events
from k3mk.passes.manager import Target, run_pipeline, until
from k3mk.passes.schedule import (
    CostModel,
    ScheduleError,
    expected_distinct_experts,
    predecessors,
    roofline_bytes,
    schedule,
    timeline,
)

BF16 = torch.bfloat16


def linears(*shapes: tuple[int, int], batch: int = 1) -> Graph:
    """x -> linear -> ... -> y: one linear per (out, in) shape, bf16."""
    g = Graph(meta={"max_context": 1, "tp": 1})
    names = ["x"] + [f"a{i}" for i in range(len(shapes) - 1)] + ["y"]
    g.add_tensor(Tensor("x", (batch, shapes[0][1]), BF16, Role.INPUT))
    for i, (out, inp) in enumerate(shapes):
        g.add_tensor(Tensor(f"w{i}", (out, inp), BF16, Role.WEIGHT))
        g.add_tensor(Tensor(names[i + 1], (batch, out), BF16, Role.OUTPUT if i == len(shapes) - 1 else Role.ACTIVATION))
        g.add_node(Node(f"lin{i}", Linear(False), (names[i], f"w{i}"), (names[i + 1],)))
    g.verify()
    return g


def tasks_of(graph: Graph, num_sms: int, first: str = "tile") -> tuple[TaskGraph, Target]:
    target = Target.for_arch(load_config("k3-tiny"), num_sms=num_sms, max_tokens=graph.tensors["x"].shape[0] if "x" in graph.tensors else 1)
    passes = until("schedule")
    return run_pipeline(graph, target, passes[[p.name for p in passes].index(first) :]).output, target


def check_lists(tg: TaskGraph) -> None:
    """Every task exactly once; (sm, order) as listed; events + program order acyclic."""
    listed = [(t, s, i) for s, ts in enumerate(tg.sm_lists) for i, t in enumerate(ts)]
    assert sorted(t for t, _, _ in listed) == list(range(len(tg.tasks)))
    assert all((tg.tasks[t].sm, tg.tasks[t].order) == (s, i) for t, s, i in listed)
    order = nx.DiGraph()
    order.add_nodes_from(range(len(tg.tasks)))
    order.add_edges_from((p, t) for t, ps in enumerate(predecessors(tg)) for p in ps)
    order.add_edges_from((a, b) for ts in tg.sm_lists for a, b in zip(ts, ts[1:]))
    assert nx.is_directed_acyclic_graph(order)  # so some topological order contains every SM's order
    check_deadlock(tg)
    check_events(tg)  # with the lists: every hazard ordered by events + program order


@pytest.mark.parametrize("batch", [1, 4])
def test_k3_tiny_schedule_is_complete_ordered_and_predicted(batch):
    config = load_config("k3-tiny")
    graph = capture(config, batch, 16, BF16)
    target = Target.for_arch(config, num_sms=132, max_tokens=batch, max_context=16)
    tg = run_pipeline(graph, target, until("schedule")).output
    check_lists(tg)
    meta = tg.meta
    assert len(meta["sm_tasks"]) == len(tg.sm_lists) == 132 and sum(meta["sm_tasks"]) == len(tg.tasks)
    assert sum(meta["sm_bytes"]) > meta["roofline_bytes"] > 0
    assert meta["predicted_step_s"] == pytest.approx(max(timeline(tg, CostModel.for_target(target))))
    # no schedule beats the dependency chain, nor moves the step's bytes faster than the nominal bandwidth
    assert meta["predicted_step_s"] >= meta["critical_path_s"] > 0
    assert meta["predicted_step_s"] >= meta["roofline_nominal_s"] == meta["roofline_bytes"] / 4.8e12


def test_independent_tiles_are_balanced():
    """128 equal tiles, all ready at once, on 8 SMs: list scheduling gives each SM 16. In general the
    busiest SM carries at most the mean plus one task (Graham's bound for greedy list scheduling of
    independent tasks: the last task placed on the busiest SM started when it was the least loaded)."""
    tg, target = tasks_of(linears((8192, 8192)), num_sms=8)  # 128 MB: 128 tiles of 1 MB
    assert len(tg.tasks) == 128
    check_lists(tg)
    busy = tg.meta["sm_busy_s"]
    model = CostModel.for_target(target)
    largest = max(model.times(t, tg.graph)[0] + model.task_overhead for t in tg.tasks)
    assert max(busy) <= sum(busy) / len(busy) + largest
    assert tg.meta["sm_tasks"] == [16] * 8


def test_weights_stream_while_the_inputs_are_computed():
    """A large GEMV after a small one: its first tiles sit on SMs that are free early, stream their
    weights while the small GEMV runs and the hand-off completes, and finish one tail after the data."""
    tg, target = tasks_of(linears((256, 256), (8192, 256)), num_sms=8)
    model = CostModel.for_target(target)
    finish = timeline(tg, model)
    small = [t.id for t in tg.tasks if t.node == "lin0"]
    big = [t for t in tg.tasks if t.node == "lin1"]
    data = max(finish[t] for t in small) + model.event_latency
    body, tail = model.times(big[0], tg.graph)
    assert body > 10 * tail  # weight streaming dominates these tiles
    first_round = [t for t in big if all(tg.tasks[o].node == "lin0" for o in tg.sm_lists[t.sm][: t.order])]
    assert len(first_round) == 8  # every SM holds one big tile right after its small ones (or first)
    for t in first_round:
        assert finish[t.id] == pytest.approx(data + tail + model.task_overhead)
    # with no prefetch, every SM would need data + 2 full bodies for its two big tiles
    assert tg.meta["predicted_step_s"] < data + 2 * (body + model.task_overhead)


def test_target_latencies_are_used():
    graph = linears((256, 256), (256, 256))
    config = load_config("k3-tiny")
    fast = schedule(tasks_of(graph, 8)[0], Target.for_arch(config, num_sms=8)).meta["predicted_step_s"]

    class Slow:  # a target with its own hand-off latency and task overhead
        num_sms, bandwidth, flop_rate = 8, 4.8e12, 0.989e15
        event_latency, task_overhead = 5e-6, 3e-6

    slow = schedule(tasks_of(graph, 8)[0], Slow()).meta
    assert (slow["event_latency_s"], slow["task_overhead_s"]) == (5e-6, 3e-6)
    assert slow["predicted_step_s"] > fast + 4e-6


def test_a_cycle_is_refused():
    tg, target = tasks_of(linears((256, 256)), num_sms=8)
    a, b = tg.tasks[0], tg.tasks[1]
    tg.events = [Event(0, (a.id,)), Event(1, (b.id,))]
    for t in tg.tasks:
        t.waits, t.signals = [], []
    a.signals, b.signals = [0], [1]
    a.waits, b.waits = [(1, 1)], [(0, 1)]
    with pytest.raises(ScheduleError, match=r"cycle through t0 \(lin0\), t1 \(lin0\)"):
        schedule(tg, target)


def test_distinct_experts():
    assert expected_distinct_experts(896, 16, 1) == pytest.approx(16)
    assert expected_distinct_experts(896, 16, 64) == pytest.approx(610, rel=0.01)  # spec 11: "≈ 610"
    assert expected_distinct_experts(8, 2, 1000) == pytest.approx(8)


def test_roofline_matches_the_spec_for_the_k3_twin():
    """Spec 11: the K3-0.40B twin streams 0.41 GB of bf16 weights per token at batch 1."""
    config = load_config("kimi-k3-0.40b")
    graph = capture(config, 1, 64, BF16)
    roof = roofline_bytes(graph)
    assert roof["weights"] + roof["experts"] == pytest.approx(0.41e9, rel=0.02)
    # each of the 2 selected of 8 experts per MoE layer, once
    experts = sum(t.nbytes for t in graph.by_role(Role.WEIGHT) if ".experts." in t.name)
    assert roof["experts"] == pytest.approx(experts * 2 / 8)
    state = sum(t.nbytes for t in graph.by_role(Role.STATE))
    assert state < roof["state"] < 2 * state  # read all, write all but the latent cache (one row)
    assert math.isclose(roof["total"], roof["weights"] + roof["experts"] + roof["state"])
