"""The task simulator (ir/simulate.py) on the real pipeline (capture -> tp_shard -> fuse -> tile ->
plan_memory -> build_events -> check_events -> schedule): random event-respecting orders and
SM-ordered runs on a real byte arena reproduce the reference, and a missing dependency is caught.
"""

from __future__ import annotations

import random
import re

import pytest
import torch

from k3mk.compiler.capture import capture
from k3mk.compiler.config import load_config
from k3mk.compiler.random_weights import random_weights
from k3mk.compiler.reference import DecodeStep
from k3mk.ir import interpreter, ranks
from k3mk.ir.graph import Graph, Node, Role, Tensor
from k3mk.ir.ops import Add, Linear, RMSNorm
from k3mk.ir.simulate import DeadlockError, HazardError, Simulator, event_order, sm_order
from k3mk.ir.tasks import TaskGraph
from k3mk.passes.manager import PIPELINE, Target, run_pipeline, until

ORDERS = 50


def tasks_of(graph: Graph, target: Target, first: str = "tp_shard") -> TaskGraph:
    """`graph` through the pipeline from pass `first` through schedule."""
    passes = until("schedule")
    names = [p.name for p in passes]
    return run_pipeline(graph, target, passes[names.index(first) :]).output


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def step_values(graph: Graph, seed: int, vocab: int = 1) -> dict[str, torch.Tensor]:
    """Random step inputs and a random (non-zero) decode state for `graph`."""
    gen = torch.Generator().manual_seed(seed)
    values = {}
    for t in graph.tensors.values():
        if t.name == "token_ids":
            values[t.name] = torch.randint(0, vocab, t.shape, generator=gen)
        elif t.name == "positions":
            values[t.name] = torch.randint(0, graph.meta["max_context"], t.shape, generator=gen)
        elif t.role in (Role.INPUT, Role.STATE):
            values[t.name] = (0.5 * torch.randn(t.shape, generator=gen)).to(t.dtype)
    return values


def check_against(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    """Logits within float32 rounding (tiles may sum in another order), tokens and state equal up to it."""
    assert set(got) == set(expected)
    for name, ref in expected.items():
        if ref.is_floating_point():
            assert rel(got[name], ref) < 1e-5, name
        else:
            assert torch.equal(got[name], ref), name


# --------------------------------------------------------------------------------------------
# a hand-built diamond: a = x W_a; b = a W_b; c = x W_c; d = b + c; y = rmsnorm(d).
# Its arena is planned by hand so that c takes the bytes of a (a is dead once lin_b ran, but lin_c
# does not depend on lin_b): only the write-after-read events lin_b -> lin_c that build_events adds
# keep lin_c from overwriting a before every lin_b tile has read it.

WIDTH = 256


def diamond(batch: int = 2) -> tuple[Graph, dict[str, torch.Tensor]]:
    g = Graph(meta={"max_context": 1, "tp": 1})
    gen = torch.Generator().manual_seed(7)
    weights = {}
    for name, shape in (("w_a", (WIDTH, WIDTH)), ("w_b", (WIDTH, WIDTH)), ("w_c", (WIDTH, WIDTH)), ("gain", (WIDTH,))):
        g.add_tensor(Tensor(name, shape, torch.float32, Role.WEIGHT))
        weights[name] = torch.randn(shape, generator=gen) / (WIDTH**0.5 if len(shape) == 2 else 1.0)
    g.add_tensor(Tensor("x", (batch, WIDTH), torch.float32, Role.INPUT))
    for name in ("a", "b", "c", "d"):
        g.add_tensor(Tensor(name, (batch, WIDTH), torch.float32, Role.ACTIVATION))
    g.add_tensor(Tensor("y", (batch, WIDTH), torch.float32, Role.OUTPUT))
    g.add_node(Node("lin_a", Linear(False), ("x", "w_a"), ("a",)))
    g.add_node(Node("lin_b", Linear(False), ("a", "w_b"), ("b",)))
    g.add_node(Node("lin_c", Linear(False), ("x", "w_c"), ("c",)))
    g.add_node(Node("add", Add(), ("b", "c"), ("d",)))
    g.add_node(Node("norm", RMSNorm(1e-5), ("d", "gain"), ("y",)))
    g.verify()
    return g, weights


def diamond_tasks(graph: Graph) -> TaskGraph:
    passes = {p.name: p for p in PIPELINE}
    target = Target.for_arch(load_config("k3-tiny"), num_sms=8)
    tg = passes["tile"](graph, target)
    size = graph.tensors["a"].nbytes
    tg.arena = {"a": (0, size), "b": (size, size), "c": (0, size), "d": (2 * size, size)}
    tg.arena_bytes = 3 * size
    tg = run_pipeline(tg, target, [passes[p] for p in ("build_events", "check_events", "schedule")]).output
    assert len([t for t in tg.tasks if t.node == "lin_b"]) > 1
    return tg


def test_diamond_random_orders_match_the_interpreter():
    graph, weights = diamond()
    tg = diamond_tasks(graph)
    values = step_values(graph, 0)
    expected = interpreter.run(graph, {**weights, **values})
    sim = Simulator(tg, weights)
    rng = random.Random(0)
    orders = {tuple(event_order(tg, rng)) for _ in range(ORDERS)}
    assert len(orders) > 10  # the orders really differ
    for order in [*orders, *(sm_order(tg, rng) for _ in range(10))]:
        check_against(expected, sim.run(values, list(order)).values)


def _events_of(tg: TaskGraph, node: str) -> set[int]:
    return {e.id for e in tg.events if any(tg.tasks[p].node == node for p in e.producers)}


def _drop_waits(tg: TaskGraph, consumer_node: str, producer_node: str) -> None:
    """Remove the events that order `consumer_node`'s tasks after `producer_node`'s."""
    dropped = _events_of(tg, producer_node)
    for t in tg.tasks:
        if t.node == consumer_node:
            t.waits = [(e, c) for e, c in t.waits if e not in dropped]


def _add_waits(tg: TaskGraph, consumer_node: str, producer_node: str) -> None:
    for t in tg.tasks:
        if t.node == consumer_node:
            t.waits += [(e, tg.events[e].expected) for e in sorted(_events_of(tg, producer_node))]


@pytest.mark.parametrize(
    "consumer, producer, reroute, hazard",
    [
        # read-after-write (build_events leaves add only its wait on lin_c, which orders lin_b too)
        ("add", "lin_c", None, r"t\d+ \(add\) reads (c\[.*hold 'a'|b\[.*poison)"),
        # write-after-read on a's reused bytes: lin_c no longer waits for lin_b (add waits for it itself)
        ("lin_c", "lin_b", ("add", "lin_b"), r"t\d+ \(lin_b\) reads a\[.*hold 'c'"),
    ],
)
def test_missing_dependency_is_caught(consumer, producer, reroute, hazard):
    graph, weights = diamond()
    tg = diamond_tasks(graph)
    values = step_values(graph, 1)
    expected = interpreter.run(graph, {**weights, **values})
    _drop_waits(tg, consumer, producer)
    if reroute:
        _add_waits(tg, *reroute)
    sim = Simulator(tg, weights)
    rng = random.Random(1)
    caught = 0
    for _ in range(ORDERS):
        order = event_order(tg, rng)
        try:
            check_against(expected, sim.run(values, order).values)
        except HazardError as e:
            assert re.search(hazard, str(e)), str(e)
            caught += 1
            run = sim.run(values, order, strict=False)  # the same order with the values let through
            assert run.hazards and not rel(run.values["y"], expected["y"]) < 1e-3  # wrong, or NaN from poison
    assert caught > 0


def test_sm_order_reports_a_deadlock():
    graph, weights = diamond()
    tg = diamond_tasks(graph)
    norm = next(t for t in tg.tasks if t.node == "norm")
    first = next(t for t in tg.tasks if t.node == "lin_a")
    # move the last task to the front of the list of an SM that runs one of its producers' producers
    tg.sm_lists[norm.sm].remove(norm.id)
    tg.sm_lists[first.sm].insert(0, norm.id)
    with pytest.raises(DeadlockError, match=rf"sm{first.sm} #0 t{norm.id} \(norm\) waits on e\d+ \(0/\d+ signals"):
        sm_order(tg, random.Random(0))


# --------------------------------------------------------------------------------------------
# whole decode steps


CONFIGS = {"k3-tiny": lambda: load_config("k3-tiny"), "kimi-linear-small": lambda: load_config("kimi-linear-tiny")}


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_decode_step_in_random_orders_matches_the_reference(name, batch):
    config = CONFIGS[name]()
    max_context = 8
    graph = capture(config, batch, max_context, torch.float32)
    target = Target.for_arch(config, num_sms=16, max_tokens=batch, max_context=max_context, dtype=torch.float32)
    tg = tasks_of(graph, target)
    weights = random_weights(config, 0, torch.float32)
    values = step_values(graph, 3, config.vocab_size)
    expected = interpreter.run(graph, {**weights, **values})  # the unsplit, unfused graph
    step = DecodeStep(config, torch.float32)
    step.load_state_dict(weights)
    state = {k: values[k].clone() for k in step.new_state(batch, max_context)}
    logits, new_state = step(values["token_ids"], values["positions"], state)
    check_against(expected, {"logits": logits, "next_tokens": expected["next_tokens"], **new_state})
    sim = Simulator(tg, weights)
    rng = random.Random(batch)
    orders = [event_order(tg, rng) for _ in range(ORDERS)] + [sm_order(tg, rng) for _ in range(5)]
    assert len({tuple(o) for o in orders}) == len(orders)
    for order in orders:
        check_against(expected, sim.run(values, order).values)


def test_tensor_parallel_step_runs_on_simulated_ranks():
    """TP2: every rank's memory, collectives across ranks, the result assembled like ir.ranks.run."""
    config = load_config("k3-tiny")
    graph = capture(config, 2, 8, torch.float32)
    target = Target.for_arch(config, num_sms=16, tp=2, max_tokens=2, max_context=8, dtype=torch.float32)
    tg = tasks_of(graph, target)
    assert tg.graph.meta["tp"] == 2
    weights = random_weights(config, 0, torch.float32)
    values = step_values(graph, 4, config.vocab_size)
    expected = interpreter.run(graph, {**weights, **values})
    sharded = ranks.run(tg.graph, {**weights, **values})
    check_against(expected, sharded)
    sim = Simulator(tg, weights)
    rng = random.Random(5)
    for order in [event_order(tg, rng) for _ in range(5)] + [sm_order(tg, rng)]:
        check_against(expected, sim.run(values, order).values)
