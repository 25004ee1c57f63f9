"""The tiled task graph: what the passes after `tile` work on (tile -> memory plan -> events -> check ->
schedule -> task table) and what the CPU task simulator executes.

A Task is one SM-sized piece of one IR node: the node, its tile (op-specific coordinates), the regions
of activation/state/input/output tensors it reads and writes (boxes: a half-open [lo, hi) range per
dimension), its weight bytes and flops for the cost model. Later passes fill in the arena plan, the
events (each task waits on and signals events; expected counts are derived from the producers), and
the per-SM order.

How a task computes its tile (`op`, `args`, `results`, filled by passes/tile.py): the node's op, with
tile-specific attributes where the tile changes them (e.g. `num_heads` of a head group), evaluated on
`args` (one Operand per node input: the boxes of that input the tile needs, weights included) gives
one value per op result; `results` says which part of each value is stored where. `reads` are exactly
the non-weight args' regions and `writes` exactly the results' regions, in order. `evaluate` /
`execute` below run a task that way on the CPU (the task simulator's per-task semantics).

A STATE tensor and the STATE_OUT that replaces it are ONE buffer (the state is updated in place):
`buffer_name` maps both to the state's name, and byte-level analyses treat them as one byte space.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from k3mk.ir.collectives import Collective
from k3mk.ir.graph import Graph, Role
from k3mk.ir.ops import Op

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


def index(box: Box) -> tuple[slice, ...]:
    """The torch index of a box."""
    return tuple(slice(lo, hi) for lo, hi in box)


def byte_runs(box: Box, shape: tuple[int, ...], itemsize: int) -> list[tuple[int, int]]:
    """The bytes of a box of a row-major tensor as sorted, disjoint, maximal [lo, hi) runs, relative to
    the tensor's first byte. The trailing dimensions the box covers fully join the run of the first
    dimension it does not; every combination of the dimensions before that starts one run."""
    strides = [itemsize] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    inner = len(shape) - 1
    while inner >= 0 and box[inner] == (0, shape[inner]):
        inner -= 1
    if inner < 0:
        return [(0, strides[0] * shape[0] if shape else itemsize)]
    lo, hi = box[inner]
    starts = [lo * strides[inner]]
    for d in range(inner - 1, -1, -1):
        starts = [a * strides[d] + s for a in range(*box[d]) for s in starts]
    length = (hi - lo) * strides[inner]
    return [(s, s + length) for s in sorted(starts)]


def buffer_name(graph: Graph, tensor: str) -> str:
    """The buffer a tensor lives in: a STATE_OUT lives in the STATE it overwrites in place."""
    t = graph.tensors[tensor]
    return t.alias if t.role == Role.STATE_OUT else tensor


@dataclass(frozen=True)
class Operand:
    """One argument or result of a task's op: the `boxes` of graph tensor `tensor`, joined along `axis`
    (one box almost always; the KDA conv state's q|k|v channel pieces are three). For a result, `part`
    is the box of the op's value that is stored (None: all of it), e.g. one KV chunk of an op that
    computes every chunk of its request."""

    tensor: str
    boxes: tuple[Box, ...]
    axis: int = 0
    part: Box | None = None

    def regions(self) -> tuple[Region, ...]:
        return tuple(Region(self.tensor, b) for b in self.boxes)

    def text(self) -> str:
        return "+".join(r.text() for r in self.regions())


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
    # (event id, expected count) the producer warp waits for before streaming the task's weights: the
    # writers of the input that picks them (Op.weight_index_input: a routed expert's ids); [] for weights
    # known at compile time, which never wait
    weight_waits: list[tuple[int, int]] = field(default_factory=list)
    sm: int = -1  # assigned by the schedule
    order: int = -1  # position in its SM's list
    op: Op | None = None  # what the task evaluates: the node's op with its tile's attributes (module doc)
    args: tuple[Operand, ...] = ()  # one per node input, weights included
    results: tuple[Operand, ...] = ()  # one per op result
    # non-weight bytes the task really moves, where its regions overstate them because run-time values
    # pick the bytes (the latent cache row a cache write stores, the KV chunk an attention split reads:
    # the regions must cover every byte it MAY touch); None: the bytes of its regions (cost model only)
    activation_bytes: int | None = None

    def text(self) -> str:
        tile = ",".join(f"{k}={v}" for k, v in sorted(self.tile.items()))
        waits = " ".join(f"wait(e{e}>={c})" for e, c in self.waits)
        sigs = " ".join(f"signal(e{e})" for e in self.signals)
        weight_waits = " ".join(f"weights_wait(e{e}>={c})" for e, c in self.weight_waits)
        return (
            f"t{self.id} {self.node}[{tile}] sm={self.sm}#{self.order} "
            f"R={[r.text() for r in self.reads]} W={[r.text() for r in self.writes]} {waits} {weight_waits} {sigs}".replace("  ", " ").rstrip()
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
            if t.args or t.results:
                _verify_recipe(t, self.graph)
        for name, (offset, nbytes) in self.arena.items():
            t = self.graph.tensors.get(name)
            if t is None or t.role != Role.ACTIVATION or nbytes != t.nbytes or offset < 0 or offset + nbytes > self.arena_bytes:
                raise ValueError(f"arena slot of '{name}' [{offset}, +{nbytes}) is not an activation's size inside {self.arena_bytes} bytes")
        signalled: list[list[int]] = [[] for _ in self.events]
        for t in self.tasks:
            for e in t.signals:
                if not 0 <= e < len(self.events):
                    raise ValueError(f"task t{t.id} signals unknown event e{e}")
                signalled[e].append(t.id)
        for i, e in enumerate(self.events):
            if e.id != i or sorted(e.producers) != signalled[i]:
                raise ValueError(f"event e{e.id} (position {i}): producers {list(e.producers)[:6]} are not the tasks that signal it {signalled[i][:6]}")
        for t in self.tasks:
            for e, count in t.waits:
                if not 0 <= e < len(self.events) or count != self.events[e].expected:
                    raise ValueError(f"task t{t.id} waits for {count} signals of e{e}; expected counts are the producer counts")

    def text(self) -> str:
        lines = [f"# k3mk tasks {' '.join(f'{k}={self.meta[k]}' for k in sorted(self.meta))}"]
        lines += [f"arena {name} @{off} +{size}" for name, (off, size) in sorted(self.arena.items(), key=lambda kv: kv[1])]
        lines += [f"e{e.id} expected={e.expected} producers={list(e.producers)}" for e in self.events]
        lines += [f"sm{i}: {' '.join(f't{t}' for t in ts)}" for i, ts in enumerate(self.sm_lists)]
        lines += [t.text() for t in self.tasks]
        return "\n".join(lines) + "\n"


def _verify_recipe(t: Task, graph: Graph) -> None:
    """A task's declared regions are exactly what its recipe touches (module doc)."""
    reads = tuple(r for a in t.args if graph.tensors[a.tensor].role != Role.WEIGHT for r in a.regions())
    writes = tuple(r for a in t.results for r in a.regions())
    if t.op is None or reads != t.reads or writes != t.writes:
        raise ValueError(
            f"task t{t.id} ({t.node}): reads/writes {[r.text() for r in t.reads]} / {[r.text() for r in t.writes]} "
            f"differ from its args/results {[r.text() for r in reads]} / {[r.text() for r in writes]}"
        )


# --- per-task semantics (the CPU task simulator) -------------------------------------------------------


def evaluate(task: Task, fetch: Callable[[str, Box], torch.Tensor]) -> list[torch.Tensor]:
    """The values of the task's write regions, in `task.writes` order: `task.op` evaluated on its args,
    where `fetch(tensor, box)` returns that box of a graph tensor (a weight, or a region the task reads).
    Only declared regions are fetched, so data outside them cannot change what the task writes."""
    if task.op is None:
        raise ValueError(f"task t{task.id} ({task.node}) has no recipe (run passes/tile.py)")
    if isinstance(task.op, Collective):
        raise ValueError(f"task t{task.id} ({task.node}) is a collective: use execute_collective")
    values = task.op.evaluate(*(_gather(a, fetch) for a in task.args))
    return [piece for a, v in zip(task.results, values) for piece in _pieces(a, v)]


def execute(task: Task, graph: Graph, env: dict[str, torch.Tensor]) -> None:
    """Run one task on `env` (buffer name -> tensor: every weight, input, state, output and activation;
    a STATE_OUT is written into its state's buffer, see `buffer_name`), storing only its write regions."""
    _store(task, graph, env, evaluate(task, lambda name, box: env[buffer_name(graph, name)][index(box)]))


def execute_collective(task: Task, graph: Graph, envs: list[dict[str, torch.Tensor]]) -> None:
    """Run one collective task on every rank at once (`envs[r]` is rank r's env, as in `execute`): each
    rank's tile of the result from every rank's tile of the operand (`Collective.exchange`)."""
    if not isinstance(task.op, Collective):
        raise ValueError(f"task t{task.id} ({task.node}) is not a collective: use execute")
    inputs = [tuple(_gather(a, lambda name, box: env[buffer_name(graph, name)][index(box)]) for a in task.args) for env in envs]
    for env, values in zip(envs, task.op.exchange(inputs)):
        _store(task, graph, env, [piece for a, v in zip(task.results, values) for piece in _pieces(a, v)])


def _gather(a: Operand, fetch: Callable[[str, Box], torch.Tensor]) -> torch.Tensor:
    pieces = [fetch(a.tensor, b) for b in a.boxes]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=a.axis)


def _pieces(a: Operand, value: torch.Tensor) -> list[torch.Tensor]:
    if a.part is not None:
        value = value[index(a.part)]
    if len(a.boxes) == 1:
        return [value]
    return list(value.split([b[a.axis][1] - b[a.axis][0] for b in a.boxes], dim=a.axis))


def _store(task: Task, graph: Graph, env: dict[str, torch.Tensor], values: list[torch.Tensor]) -> None:
    for r, v in zip(task.writes, values):
        target = env[buffer_name(graph, r.tensor)][index(r.box)]
        if target.shape != v.shape:
            raise ValueError(f"task t{task.id} ({task.node}): computed {list(v.shape)} for {r.text()} of shape {list(target.shape)}")
        target.copy_(v)


# --- byte-range bookkeeping (build_events, check_events) -----------------------------------------------


class SegmentMap:
    """A value per byte of [0, size), stored as maximal runs of equal values: `starts[i]` begins run i,
    which ends where run i+1 begins (the last at `size`). Values are compared with ==."""

    def __init__(self, size: int, value: Any):
        self.size = size
        self.starts: list[int] = [0]
        self.values: list[Any] = [value]

    def _cut(self, x: int) -> int:
        """Index of the run that begins at x, splitting the run that contains x if needed."""
        if x >= self.size:
            return len(self.starts)
        i = bisect.bisect_right(self.starts, x) - 1
        if self.starts[i] != x:
            i += 1
            self.starts.insert(i, x)
            self.values.insert(i, self.values[i - 1])
        return i

    def items(self, lo: int, hi: int) -> list[tuple[int, int, Any]]:
        """The runs overlapping [lo, hi), clipped to it."""
        i = bisect.bisect_right(self.starts, lo) - 1
        out = []
        while i < len(self.starts) and self.starts[i] < hi:
            end = self.starts[i + 1] if i + 1 < len(self.starts) else self.size
            out.append((max(lo, self.starts[i]), min(hi, end), self.values[i]))
            i += 1
        return out

    def update(self, lo: int, hi: int, fn: Callable[[Any], Any]) -> None:
        """Replace the value v of every byte in [lo, hi) by fn(v), then re-join equal neighbours."""
        if lo >= hi:
            return
        i, j = self._cut(lo), self._cut(hi)
        for k in range(i, j):
            self.values[k] = fn(self.values[k])
        k = max(i, 1)
        while k <= min(j, len(self.starts) - 1):  # runs i..j-1 and their outer neighbours
            if self.values[k] == self.values[k - 1]:
                del self.starts[k], self.values[k]
                j -= 1
            else:
                k += 1
