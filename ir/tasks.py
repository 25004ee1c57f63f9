"""The tiled task graph: what the passes after `tile` work on (tile -> memory plan -> events -> check ->
schedule -> task table) and what the CPU task simulator executes.

A Task is one SM-sized piece of one IR node: the node, its tile (op-specific coordinates), the regions
of activation/state/input/output tensors it reads and writes (boxes: a half-open [lo, hi) range per
dimension), its weight bytes and flops for the cost model. Later passes fill in the arena plan, the
events (each task waits on and signals events; expected counts are derived from the producers), and
the per-SM order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from k3mk.ir.graph import Graph

Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Region:
    tensor: str
    box: Box  # one half-open [lo, hi) per dimension of the tensor

    def overlaps(self, other: "Region") -> bool:
        return self.tensor == other.tensor and all(a0 < b1 and b0 < a1 for (a0, a1), (b0, b1) in zip(self.box, other.box))

    def text(self) -> str:
        return f"{self.tensor}[{', '.join(f'{lo}:{hi}' for lo, hi in self.box)}]"


def whole(tensor: str, shape: tuple[int, ...]) -> Region:
    return Region(tensor, tuple((0, s) for s in shape))


@dataclass
class Task:
    id: int
    node: str  # the IR node this task computes part of
    tile: dict[str, Any]  # op-specific coordinates, e.g. {"rows": (0, 64)} or {"head": 3}
    reads: tuple[Region, ...]  # activations, state, step inputs (never weights)
    writes: tuple[Region, ...]
    weight_bytes: int = 0  # bytes of weights this task streams (cost model; weights are read-only)
    flops: int = 0
    waits: list[tuple[int, int]] = field(default_factory=list)  # (event id, expected count per step)
    signals: list[int] = field(default_factory=list)  # event ids incremented once when done
    sm: int = -1  # assigned by the schedule
    order: int = -1  # position in its SM's list

    def text(self) -> str:
        tile = ",".join(f"{k}={v}" for k, v in sorted(self.tile.items()))
        waits = " ".join(f"wait(e{e}>={c})" for e, c in self.waits)
        sigs = " ".join(f"signal(e{e})" for e in self.signals)
        return (
            f"t{self.id} {self.node}[{tile}] sm={self.sm}#{self.order} "
            f"R={[r.text() for r in self.reads]} W={[r.text() for r in self.writes]} {waits} {sigs}".rstrip()
        )


@dataclass
class Event:
    id: int
    producers: tuple[int, ...]  # task ids that signal it; expected count per step = len(producers)

    @property
    def expected(self) -> int:
        return len(self.producers)


@dataclass
class TaskGraph:
    graph: Graph  # the (sharded, fused) IR the tasks implement
    tasks: list[Task] = field(default_factory=list)
    arena: dict[str, tuple[int, int]] = field(default_factory=dict)  # activation tensor -> (byte offset, nbytes)
    arena_bytes: int = 0
    events: list[Event] = field(default_factory=list)
    sm_lists: list[list[int]] = field(default_factory=list)  # per SM, task ids in execution order
    meta: dict = field(default_factory=dict)  # target: num_sms, bandwidth, predicted time, ...

    def verify(self) -> None:
        """Structural checks every stage keeps (each pass adds its own invariants' checks)."""
        ids = [t.id for t in self.tasks]
        if ids != list(range(len(self.tasks))):
            raise ValueError("task ids must be 0..n-1 in order")
        nodes = {n.name for n in self.graph.nodes}
        for t in self.tasks:
            if t.node not in nodes:
                raise ValueError(f"task t{t.id} names unknown node '{t.node}'")
            for r in (*t.reads, *t.writes):
                shape = self.graph.tensors[r.tensor].shape
                if len(r.box) != len(shape) or any(not 0 <= lo < hi <= s for (lo, hi), s in zip(r.box, shape)):
                    raise ValueError(f"task t{t.id}: region {r.text()} is outside tensor shape {list(shape)}")
        for e in self.events:
            if any(not 0 <= p < len(self.tasks) for p in e.producers):
                raise ValueError(f"event e{e.id} names an unknown producer task")

    def text(self) -> str:
        lines = [f"# k3mk tasks {' '.join(f'{k}={self.meta[k]}' for k in sorted(self.meta))}"]
        lines += [f"arena {name} @{off} +{size}" for name, (off, size) in sorted(self.arena.items(), key=lambda kv: kv[1])]
        lines += [f"e{e.id} expected={e.expected} producers={list(e.producers)}" for e in self.events]
        lines += [f"sm{i}: {' '.join(f't{t}' for t in ts)}" for i, ts in enumerate(self.sm_lists)]
        lines += [t.text() for t in self.tasks]
        return "\n".join(lines) + "\n"
