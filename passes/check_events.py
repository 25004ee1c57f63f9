"""check_events: the static proof that the events order every hazard (DESIGN.md, "Data flow": after
memory planning and events, a static check proves that every read of every region is ordered after
its writer and every write after the earlier readers of that region).

It re-derives, independently of build_events, what must be ordered, at the level of BYTES:
- buffers: the arena (every activation at its planned offset), each state buffer (a STATE and its
  STATE_OUT are one), each step input and each output;
- walking the tasks in id order (the sequential order the graph defines), a byte map records for every
  byte the tensor it holds, the tasks that wrote it last and the tasks that read it since;
- a task that reads a region needs the bytes to hold that tensor (its producer's value: not overwritten
  by a tensor sharing the arena bytes, not state already overwritten in place, not never written), and
  needs their last writers to happen before it (read-after-write); a task that writes a region needs
  the bytes' earlier readers and writers to happen before it (write-after-read, write-after-write).
Then it proves each need: happens-before is the transitive closure of the event edges (producer ->
waiter) plus, once the schedule has filled `tg.sm_lists`, each SM's program order.

Needs are recorded per EVENT (the byte maps stay small: a node's tiles share one token): first test
whether all of e's producers happen before t, which with events only is exact, since a task reaches
other tasks only through the one event it signals; if not (program order may order just some of them),
test the producers of e that touch the region one by one. With events only, "complete before t" is a
bitset over events per task (the events t waits on, plus what was complete before their producers);
with the schedule, a vector clock over SMs per task (the last position of every SM's list that happens
before t), which covers program order exactly. Both walk one step's execution order
(check_deadlock.execution_order), so the check also proves the lists cannot deadlock. Expected counts
are checked against the producers ("miscounted arrivals", prior art 6).

Guarantees: nothing changes; an EventCheckError names the task, the region, and the event or task it
is not ordered after.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from k3mk.ir.graph import Role
from k3mk.ir.tasks import Region, SegmentMap, TaskGraph, byte_runs
from k3mk.passes.check_deadlock import execution_order

EMPTY: frozenset[int] = frozenset()
MAX_REPORTED = 8


class EventCheckError(ValueError):
    """Some hazard is not ordered by the events (and program order): names what and where."""


# --- what must be ordered ----------------------------------------------------------------------------


class Memory:
    """The byte maps of every buffer. A byte's value: (tensor it holds or None, writer tokens, reader
    tokens); a token is an event id (>= 0, for a task that signals exactly that event) or -1 - task id
    (a task that signals no event, or several: it can only be ordered by program order)."""

    def __init__(self, tg: TaskGraph):
        self.tg = tg
        graph = tg.graph
        self.place: dict[str, tuple[str, int]] = {}  # tensor -> (buffer, byte offset in it)
        self._runs: dict[Region, tuple[SegmentMap, list[tuple[int, int]]]] = {}
        self.maps: dict[str, SegmentMap] = {"arena": SegmentMap(max(tg.arena_bytes, 1), (None, EMPTY, EMPTY))}
        for t in graph.tensors.values():
            if t.role == Role.WEIGHT:
                continue
            if t.role == Role.ACTIVATION:
                if t.name not in tg.arena:
                    raise EventCheckError(f"activation '{t.name}' has no arena slot (run plan_memory)")
                offset, nbytes = tg.arena[t.name]
                if nbytes != t.nbytes or offset < 0 or offset + nbytes > tg.arena_bytes:
                    raise EventCheckError(f"arena slot of '{t.name}' [{offset}, +{nbytes}) does not fit the tensor or the arena")
                self.place[t.name] = ("arena", offset)
            else:
                buffer = t.alias if t.role == Role.STATE_OUT else t.name
                self.place[t.name] = (buffer, 0)
                if buffer not in self.maps:
                    initial = buffer if t.role != Role.OUTPUT else None  # inputs and state hold themselves
                    self.maps[buffer] = SegmentMap(t.nbytes, (initial, EMPTY, EMPTY))

    def runs(self, region: Region) -> tuple[SegmentMap, list[tuple[int, int]]]:
        """The byte map a region lives in and its bytes there."""
        found = self._runs.get(region)
        if found is None:
            t = self.tg.graph.tensors[region.tensor]
            buffer, offset = self.place[region.tensor]
            runs = [(lo + offset, hi + offset) for lo, hi in byte_runs(region.box, t.shape, t.dtype.itemsize)]
            found = self._runs[region] = (self.maps[buffer], runs)
        return found


def token_of(task) -> int:
    return task.signals[0] if len(task.signals) == 1 else -1 - task.id


def needs(tg: TaskGraph, memory: Memory) -> list[list[tuple[int, str, Region]]]:
    """Per task, [(token, "read" / "write", region)]: the earlier accesses it must happen after."""
    out: list[list[tuple[int, str, Region]]] = []
    for task in tg.tasks:
        mine = token_of(task)
        found: dict[int, tuple[str, Region]] = {}
        for r in task.reads:
            space, runs = memory.runs(r)
            for lo, hi in runs:
                for a, b, (held, writers, _) in space.items(lo, hi):
                    if held != r.tensor:
                        what = "were never written" if held is None else f"hold '{held}'"
                        raise EventCheckError(f"task t{task.id} ({task.node}) reads {r.text()}, but in the sequential order its bytes [{a}, {b}) {what}")
                    for w in writers:
                        found.setdefault(w, ("read", r))
        for r in task.writes:
            space, runs = memory.runs(r)
            for lo, hi in runs:
                for _, _, (_, writers, readers) in space.items(lo, hi):
                    for w in writers | readers:
                        found.setdefault(w, ("write", r))
        for r in task.reads:
            space, runs = memory.runs(r)
            for lo, hi in runs:
                space.update(lo, hi, lambda v: v if mine in v[2] else (v[0], v[1], v[2] | {mine}))
        for r in task.writes:
            space, runs = memory.runs(r)
            mine_only = frozenset((mine,))
            for lo, hi in runs:
                space.update(lo, hi, lambda v, name=r.tensor: (name, mine_only, EMPTY))
        out.append([(tok, kind, region) for tok, (kind, region) in found.items()])
    _check_final(tg, memory)
    return out


def _check_final(tg: TaskGraph, memory: Memory) -> None:
    """After the step every output and every state output holds its own value in all of its bytes."""
    for t in tg.graph.tensors.values():
        if t.role in (Role.OUTPUT, Role.STATE_OUT):
            space, runs = memory.runs(Region(t.name, tuple((0, s) for s in t.shape)))
            for lo, hi in runs:
                for a, b, (held, _, _) in space.items(lo, hi):
                    if held != t.name:
                        raise EventCheckError(f"{t.role.value} '{t.name}': bytes [{a}, {b}) are not written by the step")


# --- what is ordered ---------------------------------------------------------------------------------


class EventClock:
    """Events only: `before[t]` = the events complete before task t starts, as a bitset."""

    def __init__(self, tg: TaskGraph):
        self.tg = tg
        self.done = [0] * len(tg.events)  # per event: complete before any of its producers starts
        self.current = 0
        self.current_task = -1

    def visit(self, t: int) -> None:
        before = 0
        for e, _ in self.tg.tasks[t].waits:
            before |= (1 << e) | self.done[e]
        for e in self.tg.tasks[t].signals:
            self.done[e] |= before
        self.current, self.current_task = before, t

    def ordered(self, token: int) -> bool:
        """Whether the accesses recorded as `token` happen before the task visited last."""
        if token < 0:
            return False
        return bool((self.current >> token) & 1)

    def ordered_task(self, p: int) -> bool:
        return self.ordered(token_of(self.tg.tasks[p]))


class VectorClock:
    """With the schedule: per task the last position of each SM's list that happens before it (-1: none),
    from its SM predecessor and the producers of the events it waits on."""

    def __init__(self, tg: TaskGraph):
        self.tg = tg
        sms = len(tg.sm_lists)
        self.event = np.full((len(tg.events), sms), -1, dtype=np.int32)  # max over producers, own position included
        self.last = np.full((len(tg.events), sms), -1, dtype=np.int32)  # per event: its producers' last position per SM
        for ev in tg.events:
            for p in ev.producers:
                task = tg.tasks[p]
                self.last[ev.id, task.sm] = max(self.last[ev.id, task.sm], task.order)
        self.sm_clock = np.full((sms, sms), -1, dtype=np.int32)  # clock of each SM's last visited task, itself included
        self.current = np.full(sms, -1, dtype=np.int32)

    def visit(self, t: int) -> None:
        task = self.tg.tasks[t]
        clock = self.sm_clock[task.sm].copy()
        for e, _ in task.waits:
            np.maximum(clock, self.event[e], out=clock)
        self.current = clock
        own = clock.copy()
        own[task.sm] = task.order
        self.sm_clock[task.sm] = own
        for e in task.signals:
            np.maximum(self.event[e], own, out=self.event[e])

    def ordered(self, token: int) -> bool:
        if token < 0:
            return self.ordered_task(-1 - token)
        return bool((self.current >= self.last[token]).all())

    def ordered_task(self, p: int) -> bool:
        task = self.tg.tasks[p]
        return bool(self.current[task.sm] >= task.order)


def _check_counts(tg: TaskGraph) -> None:
    """Every event's expected count is its number of producers, and its producers are the tasks that
    signal it; every wait names a known event with that count."""
    signallers: list[list[int]] = [[] for _ in tg.events]
    for t in tg.tasks:
        for e in t.signals:
            if not 0 <= e < len(tg.events):
                raise EventCheckError(f"task t{t.id} ({t.node}) signals unknown event e{e}")
            signallers[e].append(t.id)
    for ev in tg.events:
        if sorted(ev.producers) != signallers[ev.id]:
            raise EventCheckError(f"event e{ev.id}: producers {list(ev.producers)[:6]} but signalled by {signallers[ev.id][:6]}")
    for t in tg.tasks:
        for e, count in t.waits:
            if not 0 <= e < len(tg.events):
                raise EventCheckError(f"task t{t.id} ({t.node}) waits on unknown event e{e}")
            if count != tg.events[e].expected:
                raise EventCheckError(f"task t{t.id} ({t.node}) waits for {count} signals of e{e}, which has {tg.events[e].expected} producers")


def check_events(tg: TaskGraph, target: Any = None) -> TaskGraph:
    """Raise EventCheckError unless every hazard is ordered (module docstring); returns `tg` unchanged."""
    _check_counts(tg)
    memory = Memory(tg)
    required = needs(tg, memory)
    clock = VectorClock(tg) if tg.sm_lists else EventClock(tg)
    failures = []
    for t in execution_order(tg):
        clock.visit(t)
        for token, kind, region in required[t]:
            if clock.ordered(token):
                continue
            late = [p for p in _accessors(tg, memory, token, t, kind, region) if not clock.ordered_task(p)]
            if late:
                failures.append(_describe(tg, t, late[0], kind, region))
        if len(failures) >= MAX_REPORTED:
            break
    if failures:
        raise EventCheckError("unordered accesses:\n  " + "\n  ".join(failures))
    return tg


def _accessors(tg: TaskGraph, memory: Memory, token: int, t: int, kind: str, region: Region) -> list[int]:
    """The earlier tasks behind `token` that touch `region`'s bytes in a way `t`'s access conflicts with:
    an event is not complete before t, but t may need only some of its producers (which program order
    can still order)."""
    if token < 0:
        return [-1 - token]
    space, runs = memory.runs(region)
    found = []
    for p in tg.events[token].producers:
        if p >= t:
            continue
        task = tg.tasks[p]
        for other in task.writes if kind == "read" else (*task.reads, *task.writes):
            other_space, other_runs = memory.runs(other)
            if other_space is space and any(a < d and c < b for a, b in runs for c, d in other_runs):
                found.append(p)
                break
    return found


def _describe(tg: TaskGraph, t: int, p: int, kind: str, region: Region) -> str:
    task, other = tg.tasks[t], tg.tasks[p]
    how = f"its event e{other.signals[0]}" if len(other.signals) == 1 else "program order"
    hazard = "which writes those bytes" if kind == "read" else "which accessed those bytes earlier"
    return f"task t{t} ({task.node}) {kind}s {region.text()} but is not ordered after task t{p} ({other.node}), {hazard} (via {how})"
