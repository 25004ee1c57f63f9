"""plan_memory: place every activation in ONE arena, reusing the bytes of dead tensors (DESIGN.md,
"Data flow": memory planning comes before events).

Guarantees to build_events and the runtime:
- `tg.arena[name] = (byte offset, nbytes)` for every ACTIVATION tensor and nothing else: weights, step
  inputs, state (with its in-place STATE_OUT) and outputs are bound by the runtime outside the arena;
- offsets are multiples of `ALIGN`; `tg.arena_bytes` covers every slot;
- two activations X, Z share bytes only if the data flow already orders them: every node that touches
  X (its producer and its readers) is an ancestor of the node that produces Z, or the other way round.
  So reuse never orders nodes that could otherwise run at once (e.g. the shared experts after the
  routed ones), and in graph node order (= task id order) X's live range [producer, last reader] ends
  before Z's begins, so all reuse hazards cross node boundaries;
- `tg.meta`: arena_bytes, arena_no_reuse_bytes (every slot separate), arena_peak_live_bytes (the most
  bytes live at one node in node order: no plan of that order does better).
Reuse turns into write-after-read / write-after-write hazards between tasks of the tensors that share
bytes; build_events orders them (mostly they are implied by the data flow already).

Placement: greedy by size (largest first, each at the lowest offset free of every placed tensor it is
not ordered with), the usual arena planner heuristic (TFLite's "greedy by size"); tensors number in
the thousands, so each placement is one vectorized scan of the placed ones.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from k3mk.ir.graph import Graph, Role
from k3mk.ir.tasks import TaskGraph

ALIGN = 256  # bytes: any vector or bulk (TMA) access of a slot starts aligned


def strict_ancestors(graph: Graph) -> np.ndarray:
    """anc[v, u]: node u is a strict ancestor of node v in the data flow (node indices in graph order)."""
    n = len(graph.nodes)
    producer = {o: i for i, node in enumerate(graph.nodes) for o in node.outputs}
    anc = np.zeros((n, n), dtype=bool)
    for v, node in enumerate(graph.nodes):
        for u in {producer[i] for i in node.inputs if i in producer}:
            anc[v] |= anc[u]
            anc[v, u] = True
    return anc


def ordered_pairs(graph: Graph, names: list[str]) -> np.ndarray:
    """ok[i, j]: every node touching tensor names[i] is a strict ancestor of names[j]'s producer, so
    names[j] may take names[i]'s bytes."""
    index = {node.name: i for i, node in enumerate(graph.nodes)}
    producer = {o: index[node.name] for node in graph.nodes for o in node.outputs}
    consumers = graph.consumers()
    anc = strict_ancestors(graph)
    after_all = np.ones((len(names), len(graph.nodes)), dtype=bool)  # [i, v]: v follows every user of names[i]
    for i, name in enumerate(names):
        users = [producer[name]] + [index[c.name] for c in consumers.get(name, [])]
        after_all[i] = anc[:, users].all(axis=1)
    return after_all[:, [producer[n] for n in names]]


def place(sizes: list[int], compatible: np.ndarray, align: int = ALIGN) -> tuple[list[int], int]:
    """Offsets for items of `sizes` bytes such that two items get overlapping byte ranges only if
    `compatible[i, j]` (symmetric); every offset a multiple of `align`. Returns (offsets, total bytes)."""
    n = len(sizes)
    size = np.array([-(-b // align) * align for b in sizes], dtype=np.int64)
    offsets = np.zeros(n, dtype=np.int64)
    placed = np.zeros(n, dtype=bool)
    for i in sorted(range(n), key=lambda i: (-size[i], i)):
        clash = placed & ~compatible[i]
        offset = 0
        for lo, hi in sorted(zip(offsets[clash].tolist(), (offsets[clash] + size[clash]).tolist())):
            if lo - offset >= size[i]:
                break
            offset = max(offset, hi)
        offsets[i] = offset
        placed[i] = True
    total = int((offsets + size).max()) if n else 0
    return offsets.tolist(), total


def plan_memory(tg: TaskGraph, target: Any = None) -> TaskGraph:
    """Fill `tg.arena` / `tg.arena_bytes` (module docstring). Mutates and returns `tg`."""
    graph = tg.graph
    names = sorted(t.name for t in graph.by_role(Role.ACTIVATION))
    ok = ordered_pairs(graph, names)
    sizes = [graph.tensors[n].nbytes for n in names]
    offsets, total = place(sizes, ok | ok.T)
    tg.arena = {n: (o, b) for n, o, b in zip(names, offsets, sizes)}
    tg.arena_bytes = total
    tg.meta.update(
        arena_bytes=total,
        arena_no_reuse_bytes=sum(-(-b // ALIGN) * ALIGN for b in sizes),
        arena_peak_live_bytes=_peak_live(graph, names, sizes),
    )
    return tg


def _peak_live(graph: Graph, names: list[str], sizes: list[int]) -> int:
    """The most activation bytes live at one node, live = [producer, last reader] in node order."""
    index = {node.name: i for i, node in enumerate(graph.nodes)}
    producer = {o: index[node.name] for node in graph.nodes for o in node.outputs}
    consumers = graph.consumers()
    live = np.zeros(len(graph.nodes) + 1, dtype=np.int64)
    for name, size in zip(names, sizes):
        start = producer[name]
        end = max([start] + [index[c.name] for c in consumers.get(name, [])])
        live[start] += size
        live[end + 1] -= size
    return int(live.cumsum().max()) if names else 0
