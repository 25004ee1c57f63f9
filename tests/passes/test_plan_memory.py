"""passes/plan_memory.py: tensors that the data flow does not order never share arena bytes (random
placement problems and real graphs, checked against networkx ancestry), and the arena reuses bytes."""

from __future__ import annotations

import functools
import random

import networkx as nx
import numpy as np
import pytest
import torch

from k3mk.compiler.capture import capture
from k3mk.compiler.config import load_config
from k3mk.ir.graph import Graph, Role
from k3mk.passes.fuse import fuse
from k3mk.passes.manager import Target
from k3mk.passes.plan_memory import ALIGN, place, plan_memory
from k3mk.passes.tile import tile
from k3mk.passes.tp_shard import tp_shard


CONFIGS = {"k3-tiny": lambda: load_config("k3-tiny"), "kimi-linear-small": lambda: load_config("kimi-linear-tiny")}


@functools.cache
def planned(name: str, batch: int, tp: int, fused_: bool):
    config = CONFIGS[name]()
    target = Target.for_arch(config, num_sms=8, tp=tp, max_tokens=batch, max_context=8, dtype=torch.float32)
    graph = capture(config, batch, 8, torch.float32)
    if tp > 1:
        graph = tp_shard(graph, target)
    if fused_:
        graph = fuse(graph, target)
    tg = plan_memory(tile(graph, target), target)
    tg.verify()
    return tg


def test_random_placements_never_overlap_incompatible_items():
    rng = random.Random(0)
    for trial in range(200):
        n = rng.randint(1, 40)
        sizes = [rng.choice((1, 100, 256, 300, 4096, 10_000)) for _ in range(n)]
        ok = np.triu(np.array([[rng.random() < 0.6 for _ in range(n)] for _ in range(n)]), 1)
        ok = ok | ok.T
        offsets, total = place(sizes, ok)
        assert all(o % ALIGN == 0 for o in offsets)
        assert max(o + s for o, s in zip(offsets, sizes)) <= total
        for i in range(n):
            for j in range(i + 1, n):
                disjoint = offsets[i] + sizes[i] <= offsets[j] or offsets[j] + sizes[j] <= offsets[i]
                assert disjoint or ok[i, j], (trial, i, j)


def touched_before(graph: Graph) -> dict[str, set[str]]:
    """Per activation, the nodes that must finish with it before another tensor may take its bytes:
    its producer and readers. Independent of plan_memory: networkx ancestry of the node graph."""
    users: dict[str, set[str]] = {}
    for node in graph.nodes:
        for name in (*node.inputs, *node.outputs):
            users.setdefault(name, set()).add(node.name)
    return users


@pytest.mark.parametrize("name, batch, tp, fused_", [("k3-tiny", 1, 1, False), ("k3-tiny", 4, 1, True), ("k3-tiny", 2, 2, True), ("kimi-linear-small", 2, 1, True)])
def test_bytes_are_shared_only_by_tensors_the_data_flow_orders(name, batch, tp, fused_):
    tg = planned(name, batch, tp, fused_)
    graph = tg.graph
    activations = {t.name for t in graph.by_role(Role.ACTIVATION)}
    assert set(tg.arena) == activations  # and nothing else: state, inputs, outputs are bound outside
    dag = graph.to_networkx()
    ancestors = {n: nx.ancestors(dag, n) for n in dag.nodes}
    producer = {o: node.name for node in graph.nodes for o in node.outputs}
    users = touched_before(graph)
    slots = sorted(tg.arena.items(), key=lambda kv: kv[1][0])
    shared = 0
    for i, (a, (oa, na)) in enumerate(slots):
        assert oa % ALIGN == 0 and oa + na <= tg.arena_bytes
        for b, (ob, nb) in slots[i + 1 :]:
            if ob >= oa + na:
                break
            shared += 1
            ordered = users[a] <= ancestors[producer[b]] or users[b] <= ancestors[producer[a]]
            assert ordered, f"'{a}' and '{b}' share bytes but the data flow does not order them"
    assert shared > 0


def test_the_arena_reuses_bytes():
    for key in [("k3-tiny", 1, 1, False), ("k3-tiny", 4, 1, True), ("kimi-linear-small", 2, 1, True)]:
        meta = planned(*key).meta
        # tensors live at the same node never share, so the peak is a lower bound
        assert meta["arena_peak_live_bytes"] <= meta["arena_bytes"] < meta["arena_no_reuse_bytes"] / 5, (key, meta)
