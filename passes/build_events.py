"""build_events: the events that order the tasks (DESIGN.md, "The megakernel execution model"; prior
art 5.2 fine-grained dataflow counters, 6 miscounted arrivals).

A task waits until every event it names has been signalled by all of that event's producers in this
step, and signals its own event once when done. What must be ordered, from the regions tasks declare:
- read-after-write: a reader waits for every task that writes an overlapping region of the tensor it
  reads (activations, outputs, and the STATE_OUT a later node reads);
- arena reuse (plan_memory): a task writing bytes that held an earlier tensor waits for that tensor's
  readers of those bytes (write-after-read), and for its writers where no reader orders them already
  (write-after-write); bytes are compared as runs of the row-major boxes at their arena offsets;
- in-place state: a STATE and its STATE_OUT are one buffer, so a task overwriting state bytes waits for
  every other task that read the old bytes; a node that would read old state after another node
  overwrote it, or two tasks of one node racing on state bytes, is an error.

Which tasks signal which event (each task signals at most one: docs/task_table.md): the tasks of a node
are grouped so that every reader's read-after-write needs from that node fall within one group
(union-find over each need set); a group that somebody waits on is an event, its producers signal it,
and its expected count per step is the number of producers, derived here and never written by hand.
Tasks that need the same producers thus share one event.

Which events a task waits on: those holding its needs, minus every event already complete before
another event it waits on (transitively, through what that event's producers waited on: a bitset per
event, exact for event-only happens-before), plus the reuse needs that are not complete already. The
task table has `MAX_WAITS` wait slots per task; a task needing more has two of its events merged into
one when that is safe (every waiter of either comes after every producer of both in node order, so no
cycle can form) - events of one node first, else the pair whose producers are closest. An unresolvable
excess is an error naming the task and its events.

Weight waits: a task whose streamed weights depend on an input's run-time values (Op.weight_index_input,
a routed expert's ids) gets `weight_waits`, the one event of that input's writers (the router), for the
producer warp that streams its weights ahead of the consumers: it waits for the ids only, not for the
task's other inputs (a combine's gated activations). That event exists even where the task's own waits
leave it implied by another (the combine waits on the gated stage, which waited on the router).

Guarantees to check_events and schedule: `tg.events` (ids in order of first producer), each task's
`waits` [(event, expected)] and `signals` [event] filled; every event's producers come before every
waiter in task id order (so id order stays a topological order); `tg.meta` counts events and waits.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from k3mk.ir.graph import Role
from k3mk.ir.tasks import Box, Event, Region, SegmentMap, TaskGraph, byte_runs

MAX_WAITS = 2  # wait slots per task in the task table (docs/task_table.md, format 1)


class EventError(ValueError):
    """A hazard the events cannot order (a race inside one node, state read after its overwrite) or a
    task that needs more events than the table allows."""


# --- who touches what ------------------------------------------------------------------------------


class Overlaps:
    """Items (each a list of boxes or of byte runs, with its tasks) of one tensor or buffer, indexed for
    "which items overlap this box / these runs" queries, vectorized over the items."""

    def __init__(self, items: list[tuple[list[tuple[tuple[int, int], ...]], list[int]]]):
        self.tasks = [ts for _, ts in items]
        pieces = [(i, piece) for i, (ps, _) in enumerate(items) for piece in ps]
        dims = len(pieces[0][1]) if pieces else 1
        self.item = np.array([i for i, _ in pieces], dtype=np.int64)
        self.lo = np.array([[lo for lo, _ in piece] for _, piece in pieces], dtype=np.int64).reshape(len(pieces), dims)
        self.hi = np.array([[hi for _, hi in piece] for _, piece in pieces], dtype=np.int64).reshape(len(pieces), dims)

    def hits(self, pieces: list[tuple[tuple[int, int], ...]]) -> list[int]:
        """Indices of the items overlapping any of `pieces`, ascending."""
        found = np.zeros(len(self.tasks), dtype=bool)
        for piece in pieces:
            lo = np.array([a for a, _ in piece])
            hi = np.array([b for _, b in piece])
            found[self.item[((self.lo < hi) & (lo < self.hi)).all(axis=1)]] = True
        return np.flatnonzero(found).tolist()

    def tasks_of(self, hits: list[int]) -> list[int]:
        return [p for i in hits for p in self.tasks[i]]


class Accesses:
    """Per tensor: its writer tasks with their boxes, and its readers grouped by the box they read."""

    def __init__(self, tg: TaskGraph):
        self.tg = tg
        self.writers: dict[str, list[tuple[Box, int]]] = {}
        self.readers: dict[str, dict[Box, list[int]]] = {}
        for t in tg.tasks:
            for r in t.writes:
                self.writers.setdefault(r.tensor, []).append((r.box, t.id))
            for r in t.reads:
                self.readers.setdefault(r.tensor, {}).setdefault(r.box, []).append(t.id)
        self._runs: dict[tuple[str, Box], list[tuple[int, int]]] = {}
        self._writer_boxes: dict[str, Overlaps] = {}
        self._reader_boxes: dict[str, Overlaps] = {}

    def writer_boxes(self, tensor: str) -> Overlaps:
        if tensor not in self._writer_boxes:
            self._writer_boxes[tensor] = Overlaps([([box], [p]) for box, p in self.writers.get(tensor, [])])
        return self._writer_boxes[tensor]

    def reader_boxes(self, tensor: str) -> Overlaps:
        if tensor not in self._reader_boxes:
            self._reader_boxes[tensor] = Overlaps([([box], ps) for box, ps in self.readers.get(tensor, {}).items()])
        return self._reader_boxes[tensor]

    def arena_runs(self, tensor: str, box: Box) -> list[tuple[int, int]]:
        """The arena bytes of a box of an activation."""
        key = (tensor, box)
        runs = self._runs.get(key)
        if runs is None:
            t = self.tg.graph.tensors[tensor]
            base = self.tg.arena[tensor][0]
            runs = self._runs[key] = [(lo + base, hi + base) for lo, hi in byte_runs(box, t.shape, t.dtype.itemsize)]
        return runs

    def unread(self, tensor: str) -> bool:
        """Whether some byte of `tensor` is read by no task (then its writers need explicit WAW order)."""
        offset, nbytes = self.tg.arena[tensor]
        covered = SegmentMap(offset + nbytes, False)
        for box in self.readers.get(tensor, {}):
            for lo, hi in self.arena_runs(tensor, box):
                covered.update(lo, hi, lambda _: True)
        return any(not v for _, _, v in covered.items(offset, offset + nbytes))


def _clip(runs: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    return [(max(a, lo), min(b, hi)) for a, b in runs if a < hi and lo < b]


def previous_tenants(tg: TaskGraph, node_of_tensor: dict[str, int]) -> dict[str, list[tuple[str, int, int]]]:
    """Activation -> the tensors that last held each of its arena bytes before it: [(tensor, lo, hi)]
    with absolute byte ranges. Only the last tenant of a byte matters: its writers waited for the one
    before it when they overwrote those bytes (transitively ordered)."""
    arena = SegmentMap(max(tg.arena_bytes, 1), None)
    tenants: dict[str, list[tuple[str, int, int]]] = {}
    for name in sorted(tg.arena, key=lambda n: (node_of_tensor[n], n)):
        offset, nbytes = tg.arena[name]
        tenants[name] = [(held, lo, hi) for lo, hi, held in arena.items(offset, offset + nbytes) if held is not None]
        arena.update(offset, offset + nbytes, lambda _, name=name: name)
    return tenants


# --- the needs of every task --------------------------------------------------------------------------


class Needs:
    """Per task, the groups of earlier tasks it must come after: `raw[t]` (read-after-write: these groups
    shape the events) and `reuse[t]` (arena and state reuse: ordered by events that exist anyway when
    possible). Groups are interned tuples of task ids, shared by all tasks that need the same ones."""

    def __init__(self, tg: TaskGraph):
        self.tg = tg
        graph = tg.graph
        self.node_index = {n.name: i for i, n in enumerate(graph.nodes)}
        self.node_of = [self.node_index[t.node] for t in tg.tasks]
        self.acc = Accesses(tg)
        self.groups: dict[tuple[int, ...], tuple[int, ...]] = {}
        self.raw: list[list[tuple[int, ...]]] = [[] for _ in tg.tasks]
        self.reuse: list[list[tuple[int, ...]]] = [[] for _ in tg.tasks]
        self.raw_groups: set[tuple[int, ...]] = set()
        self.last_node: dict[tuple[int, ...], int] = {}
        writer_node = {r.tensor: self.node_of[t.id] for t in tg.tasks for r in t.writes}
        self.tenants = previous_tenants(tg, writer_node)
        self._held: dict[str, Overlaps] = {}
        self._reuse_groups: dict[tuple[str, tuple[int, ...]], tuple[int, ...]] = {}
        raw_cache: dict[tuple[str, Box], tuple[int, ...]] = {}
        for t in tg.tasks:
            for r in t.reads:
                role = graph.tensors[r.tensor].role
                if role in (Role.STATE, Role.INPUT):
                    continue  # not produced in the step; overwrites of state are ordered from the writer's side
                key = (r.tensor, r.box)
                if key not in raw_cache:
                    writers = self.acc.writer_boxes(r.tensor)
                    raw_cache[key] = self._group(writers.tasks_of(writers.hits([r.box])))
                group = raw_cache[key]
                if not group:
                    raise EventError(f"task t{t.id} ({t.node}) reads {r.text()}, which no task writes")
                self._check_earlier(t.id, group, lambda: f"reads {r.text()}")
                self.raw[t.id].append(group)
                self.raw_groups.add(group)
            for r in t.writes:
                role = graph.tensors[r.tensor].role
                if role == Role.ACTIVATION:
                    self.reuse[t.id] += self._arena_reuse(t.id, r)
                elif role == Role.STATE_OUT:
                    self.reuse[t.id] += self._state_reuse(t.id, r)

    def _group(self, tasks: list[int]) -> tuple[int, ...]:
        key = tuple(sorted(set(tasks)))
        group = self.groups.setdefault(key, key)
        if group and group not in self.last_node:
            self.last_node[group] = self.node_of[group[-1]]  # tasks come in node order
        return group

    def _check_earlier(self, t: int, group: tuple[int, ...], what: Callable[[], str]) -> None:
        """Every task of a need group must be in an earlier node than `t` (else: a race or a cycle);
        `what()` says what t does, for the error."""
        if self.last_node[group] < self.node_of[t]:
            return
        task = self.tg.tasks[t]
        other = self.tg.tasks[next(p for p in group if self.node_of[p] >= self.node_of[t])]
        where = "the same node" if other.node == task.node else f"the later node '{other.node}'"
        raise EventError(f"task t{t} ({task.node}) {what()}, which task t{other.id} of {where} also touches: unordered")

    def _arena_reuse(self, t: int, region: Region) -> list[tuple[int, ...]]:
        """Readers (and writers of never-read bytes) of the tensors whose arena bytes `region` overwrites."""
        mine = self.acc.arena_runs(region.tensor, region.box)
        groups = []
        for held, lo, hi in self.tenants[region.tensor]:
            runs = _clip(mine, lo, hi)
            if not runs:
                continue
            accesses = self._held_accesses(held)
            hit = tuple(accesses.hits([(run,) for run in runs]))
            if hit:
                key = (held, hit)
                if key not in self._reuse_groups:
                    self._reuse_groups[key] = self._group(accesses.tasks_of(list(hit)))
                group = self._reuse_groups[key]
                self._check_earlier(t, group, lambda: f"writes {region.text()} over the arena bytes of '{held}'")
                groups.append(group)
        return groups

    def _held_accesses(self, held: str) -> Overlaps:
        """The accesses of an earlier tenant a reuse must come after, by arena bytes: its readers, and its
        writers when some of its bytes are never read (nothing else orders those writes)."""
        if held not in self._held:
            items = [([(run,) for run in self.acc.arena_runs(held, box)], ps) for box, ps in self.acc.readers.get(held, {}).items()]
            if self.acc.unread(held):
                items += [([(run,) for run in self.acc.arena_runs(held, box)], [p]) for box, p in self.acc.writers[held]]
            self._held[held] = Overlaps(items)
        return self._held[held]

    def _state_reuse(self, t: int, region: Region) -> list[tuple[int, ...]]:
        """Other readers of the old state bytes that `region` (a STATE_OUT box) overwrites in place. A
        STATE_OUT has its state's shape, so overlapping boxes are overlapping bytes."""
        state = self.tg.graph.tensors[region.tensor].alias
        old = self.acc.reader_boxes(state)
        readers = [p for p in old.tasks_of(old.hits([region.box])) if p != t]
        if not readers:
            return []
        group = self._group(readers)
        self._check_earlier(t, group, lambda: f"overwrites the state bytes of {region.text()} that '{state}' readers read")
        return [group]


# --- events -------------------------------------------------------------------------------------------


class UnionFind:
    def __init__(self, n: int):
        self.parent = list(range(n))

    def find(self, x: int) -> int:
        root = x
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[x] != root:
            self.parent[x], x = root, self.parent[x]
        return root


class EventBuilder:
    """Classes of producer tasks (future events), numbered by union-find roots, with per class: `mask`
    (the bits of every class merged into it; a class gets its bit when first needed), `done` (the bits
    of classes complete before some producer of it starts, so before it is complete: the union of its
    producers' `before`), its latest producer node and its earliest waiter node."""

    def __init__(self, tg: TaskGraph, needs: Needs, max_waits: int):
        self.tg, self.needs, self.max_waits = tg, needs, max_waits
        n = len(tg.tasks)
        self.classes = UnionFind(n)
        for group in needs.raw_groups:
            self._union_per_node(group)
        find = self.classes.find
        self.reps = {g: {find(p) for p in g} for g in needs.groups.values()}  # the classes a group spans
        self.bits = 0  # bits handed out
        self.mask: dict[int, int] = {}
        self.done: dict[int, int] = {}
        self.last_producer: dict[int, int] = {}
        self.first_waiter: dict[int, int] = {}
        for t in range(n):
            r = self.classes.find(t)
            self.last_producer[r] = max(self.last_producer.get(r, -1), needs.node_of[t])
        self.waits: list[list[int]] = [[] for _ in range(n)]
        self.merges = 0

    def _union_per_node(self, group: tuple[int, ...]) -> None:
        first: dict[int, int] = {}
        for p in group:
            q = first.setdefault(self.needs.node_of[p], p)
            a, b = self.classes.find(p), self.classes.find(q)
            if a != b:
                self.classes.parent[a] = b

    def _root(self, c: int) -> int:
        r = self.classes.find(c)
        if r not in self.mask:
            self.mask[r] = 1 << self.bits
            self.bits += 1
            self.done[r] = 0
            self.first_waiter[r] = len(self.tg.graph.nodes)
        return r

    def _merge(self, a: int, b: int) -> int:
        """Merge event class b into a (both roots); returns the root."""
        self.classes.parent[b] = a
        self.mask[a] |= self.mask.pop(b)
        self.done[a] |= self.done.pop(b)
        self.last_producer[a] = max(self.last_producer[a], self.last_producer.pop(b))
        self.first_waiter[a] = min(self.first_waiter[a], self.first_waiter.pop(b))
        self.merges += 1
        return a

    def _reduce(self, need: set[int]) -> list[int]:
        """The classes of `need` not already complete before another one of them."""
        implied = 0
        for c in need:
            implied |= self.done[c]
        return sorted(c for c in need if not implied & self.mask[c])

    def _fit(self, t: int, need: list[int]) -> list[int]:
        """Merge events of `need` until at most `max_waits` remain (module docstring): first all of them
        that share their latest producer node, then the safe pair with the closest producers."""
        node = self.needs.node_of[t]
        if len(need) > self.max_waits:
            by_node: dict[int, list[int]] = {}
            for c in need:
                by_node.setdefault(self.last_producer[c], []).append(c)
            for cs in by_node.values():
                if len(cs) > 1 and self._safe(cs, node):
                    for c in cs[1:]:
                        self._merge(cs[0], c)
            need = self._reduce({self.classes.find(c) for c in need})
        while len(need) > self.max_waits:
            pairs = [
                (abs(self.last_producer[a] - self.last_producer[b]), a, b)
                for i, a in enumerate(need)
                for b in need[i + 1 :]
                if self._safe((a, b), node)
            ]
            if not pairs:
                nodes = sorted({self.tg.tasks[c].node for c in need})
                raise EventError(
                    f"task t{t} ({self.tg.tasks[t].node}) needs {len(need)} events (of nodes {nodes}), the task "
                    f"table allows {self.max_waits} waits, and no two can be merged safely"
                )
            _, a, b = min(pairs)
            self._merge(a, b)
            need = self._reduce({self.classes.find(c) for c in need})
        return need

    def _safe(self, classes, node: int) -> bool:
        """Merging `classes` adds no cycle: all their producers precede all their waiters (and `node`)."""
        return max(self.last_producer[c] for c in classes) < min(min(self.first_waiter[c] for c in classes), node)

    def run(self) -> None:
        for t in range(len(self.tg.tasks)):
            need = {self._root(c) for group in self.needs.raw[t] for c in self.reps[group]}
            need = set(self._reduce(need))
            before = self._before(need)
            for group in self.needs.reuse[t]:
                for p in self.reps[group]:
                    c = self._root(p)
                    if not before & self.mask[c]:
                        need.add(c)
                        before |= self.mask[c] | self.done[c]
            need = self._fit(t, self._reduce(need))
            for c in need:
                self.first_waiter[c] = min(self.first_waiter[c], self.needs.node_of[t])
            self.waits[t] = need
            mine = self._root(t)
            self.done[mine] |= self._before(need)

    def _before(self, need) -> int:
        bits = 0
        for c in need:
            bits |= self.mask[c] | self.done[c]
        return bits


def _weight_classes(tg: TaskGraph, needs: Needs, builder: EventBuilder) -> dict[int, int]:
    """Per task whose weights an input picks at run time, the event class of that input's writers
    (module docstring, "Weight waits")."""
    out: dict[int, int] = {}
    for t in tg.tasks:
        index = None if t.op is None else type(t.op).weight_index_input
        if index is None:
            continue
        arg = t.args[index]
        if tg.graph.tensors[arg.tensor].role in (Role.STATE, Role.INPUT):
            continue  # ids the step is given: known before the launch, the producer need not wait
        writers = needs.acc.writer_boxes(arg.tensor)
        group = set(writers.tasks_of(writers.hits(list(arg.boxes))))
        classes = {builder.classes.find(p) for p in group}
        if len(classes) != 1:
            raise EventError(f"task t{t.id} ({t.node}) streams weights picked by {arg.tensor}, written by "
                             f"{len(group)} tasks in {len(classes)} events: its producer can wait on one")  # fmt: skip
        out[t.id] = classes.pop()
    return out


def build_events(tg: TaskGraph, target: Any = None, max_waits: int = MAX_WAITS) -> TaskGraph:
    """Fill `tg.events` and every task's `waits` / `signals` (module docstring). Mutates and returns `tg`."""
    needs = Needs(tg)
    builder = EventBuilder(tg, needs, max_waits)
    builder.run()
    find = builder.classes.find
    weight_classes = _weight_classes(tg, needs, builder)
    waited = {find(c) for ws in builder.waits for c in ws} | {find(c) for c in weight_classes.values()}
    producers: dict[int, list[int]] = {}
    for t in range(len(tg.tasks)):
        r = find(t)
        if r in waited:
            producers.setdefault(r, []).append(t)
    order = sorted(producers, key=lambda r: producers[r][0])
    event_of = {r: i for i, r in enumerate(order)}
    tg.events = [Event(i, tuple(producers[r])) for i, r in enumerate(order)]
    for t in tg.tasks:
        r = find(t.id)
        t.signals = [event_of[r]] if r in event_of else []
        t.waits = [(e, len(producers[order[e]])) for e in sorted({event_of[find(c)] for c in builder.waits[t.id]})]
        if t.id in weight_classes:
            e = event_of[find(weight_classes[t.id])]
            t.weight_waits = [(e, len(producers[order[e]]))]
    tg.meta.update(
        events=len(tg.events),
        waits=sum(len(t.waits) for t in tg.tasks),
        max_waits_used=max((len(t.waits) for t in tg.tasks), default=0),
        event_merges=builder.merges,
    )
    return tg
