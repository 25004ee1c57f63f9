"""The task simulator: executes a scheduled, event-annotated TaskGraph on the CPU with reference
semantics, in any order the events allow (DESIGN.md testing layer 3; STYLE.md, "the CPU simulator
executes the SAME table the GPU executes").

What it models, so that every hazard the GPU could hit shows up here:
- the activation arena is ONE flat byte buffer, every arena tensor a typed view at its planned offset,
  so two tensors that share bytes really overwrite each other; it starts poisoned (0xFF bytes: NaN in
  every float format, -1 in every integer one);
- decode state is updated in place: a STATE tensor and the STATE_OUT that replaces it are one buffer;
- weights, step inputs, state and outputs that the plan keeps outside the arena are separate tensors;
- orders: `event_order` runs any task whose waited events reached their expected counts (SM assignment
  ignored), `sm_order` runs each SM's list in order with the SMs interleaved at random and reports a
  deadlock by SM, task and event; `from_table` takes lists, waits and signals from an emitted (or
  decoded) task table, so the synchronisation simulated is the table's own.

Every byte of memory carries a shadow tag: the tensor that last wrote it (or "never written" / the
state's old value). A task may read a region only if every byte still holds the tensor it names, so a
read that the events leave unordered against its writer (read-after-write), or against a later writer
of the same bytes (arena reuse: write-after-read / write-after-write), is reported as a hazard naming
the task, the region and what the bytes hold instead, even when the values happen to agree.

Per-task semantics: the task's recipe (`ir.tasks.evaluate`: its op on exactly the regions it
declares, weights included), of which only its write regions are stored; a NaN written is reported
(the task computed with poison). A tensor-parallel graph runs on `tp` simulated ranks in lockstep,
each with its own memory; a collective task runs on all of them at once. Results are memoized on
(task, bytes read), so further orders of the same step cost little more than the copies and checks.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from k3mk.ir.collectives import Collective
from k3mk.ir.graph import Role
from k3mk.ir.ranks import rank_inputs
from k3mk.ir.tasks import Box, Event, Task, TaskGraph, buffer_name, evaluate, execute_collective, index

POISON_BYTE = 0xFF
NEVER_WRITTEN = -1  # shadow tag of arena and output bytes no task wrote yet


class SimulationError(RuntimeError):
    """The task graph cannot be executed as declared."""


class HazardError(SimulationError):
    """A task read bytes that do not hold the tensor it names, or wrote NaN (it used poison)."""


class DeadlockError(SimulationError):
    """No task can run, yet some have not run."""


# --------------------------------------------------------------------------------------------
# orders


def _waiters(tg: TaskGraph) -> tuple[dict[int, list[tuple[int, int]]], list[int]]:
    """event -> [(task, count it waits for)], and per task the number of waits not yet satisfied."""
    known = {e.id for e in tg.events}
    waiters: dict[int, list[tuple[int, int]]] = {e: [] for e in known}
    missing = [0] * len(tg.tasks)
    for t in tg.tasks:
        for e, count in t.waits:
            if e not in known:
                raise SimulationError(f"task t{t.id} ({t.node}) waits on unknown event e{e}")
            if count > 0:
                waiters[e].append((t.id, count))
                missing[t.id] += 1
    return waiters, missing


def event_order(tg: TaskGraph, rng: random.Random) -> list[int]:
    """A uniformly random choice, at each point, among the tasks whose every waited event has reached
    its expected count (one decode step; SM assignment ignored)."""
    waiters, missing = _waiters(tg)
    signals = {e.id: 0 for e in tg.events}
    ready = [t for t, m in enumerate(missing) if m == 0]
    order: list[int] = []
    while ready:
        i = rng.randrange(len(ready))
        ready[i], ready[-1] = ready[-1], ready[i]
        t = ready.pop()
        order.append(t)
        for e in tg.tasks[t].signals:
            signals[e] += 1
            for w, count in waiters[e]:
                if signals[e] == count:
                    missing[w] -= 1
                    if missing[w] == 0:
                        ready.append(w)
    if len(order) != len(tg.tasks):
        stuck = [tg.tasks[t] for t, m in enumerate(missing) if m > 0][:3]
        raise DeadlockError(
            f"the events never let {len(tg.tasks) - len(order)} tasks run, e.g. "
            + "; ".join(_blocked(t, signals, set(order), tg) for t in stuck)
        )
    return order


def sm_order(tg: TaskGraph, rng: random.Random) -> list[int]:
    """The GPU's order: SM s runs `tg.sm_lists[s]` in order, waiting for its events; at each point a
    random SM whose next task can run goes. Raises DeadlockError naming every stuck SM."""
    listed = sorted(t for ts in tg.sm_lists for t in ts)
    if listed != list(range(len(tg.tasks))):
        raise SimulationError("the SM lists must hold every task exactly once (run the schedule pass)")
    signals = {e.id: 0 for e in tg.events}
    position = [0] * len(tg.sm_lists)
    order: list[int] = []

    def can_run(s: int) -> bool:
        ts = tg.sm_lists[s]
        return position[s] < len(ts) and all(signals[e] >= c for e, c in tg.tasks[ts[position[s]]].waits)

    while True:
        runnable = [s for s in range(len(tg.sm_lists)) if can_run(s)]
        if not runnable:
            break
        s = rng.choice(runnable)
        t = tg.sm_lists[s][position[s]]
        position[s] += 1
        order.append(t)
        for e in tg.tasks[t].signals:
            signals[e] += 1
    if len(order) != len(tg.tasks):
        stuck = [(s, ts[position[s]]) for s, ts in enumerate(tg.sm_lists) if position[s] < len(ts)]
        raise DeadlockError(
            f"deadlock: {len(stuck)} SMs stuck after {len(order)} of {len(tg.tasks)} tasks: "
            + " | ".join(f"sm{s} #{position[s]} {_blocked(tg.tasks[t], signals, set(order), tg)}" for s, t in stuck[:4])
        )
    return order


def _blocked(task: Task, signals: dict[int, int], done: set[int], tg: TaskGraph) -> str:
    """What `task` waits for: each unsatisfied event with its count and (some of) the producers not run."""
    producers = {e.id: e.producers for e in tg.events}
    waits = []
    for e, c in task.waits:
        if signals[e] < c:
            pending = [f"t{p}@sm{tg.tasks[p].sm}" for p in producers[e] if p not in done]
            more = f" and {len(pending) - 4} more" if len(pending) > 4 else ""
            waits.append(f"e{e} ({signals[e]}/{c} signals; not run: {', '.join(pending[:4])}{more})")
    return f"t{task.id} ({task.node}) waits on {'; '.join(waits)}"


# --------------------------------------------------------------------------------------------
# memory


@dataclass
class _Slot:
    """Where one tensor (or a box of it) lives: its typed torch view (what tasks compute on), the same
    bytes as a numpy uint8 array [*shape, element size], their shadow tags as a numpy int32 array
    ([*shape, element size] in the arena, where tensors of different widths share bytes; [*shape, 1]
    in a buffer of its own) and the tag that means "these bytes hold this tensor". The per-task
    bookkeeping runs on the numpy views: a few microseconds per small operation, not tens."""

    data: torch.Tensor
    raw: np.ndarray
    shadow: np.ndarray
    tag: int

    def region(self, box: Box) -> "_Slot":
        i = index(box)
        return _Slot(self.data[i], self.raw[i], self.shadow[i], self.tag)


def _typed(buffer: np.ndarray, shadow: np.ndarray, offset: int, shape: tuple[int, ...], dtype: torch.dtype, tag: int) -> _Slot:
    size = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for s in shape:
        numel *= s
    raw = buffer[offset : offset + numel * size]
    data = torch.from_numpy(raw).view(dtype).view(shape)
    tags = shadow[offset : offset + numel * size] if shadow.size == buffer.size else shadow
    return _Slot(data, raw.reshape(*shape, size), tags.reshape(*shape, -1), tag)


class _Memory:
    """One rank's memory, allocated once: the arena (one byte buffer) and a buffer per step input, per
    state (shared with the STATE_OUT that replaces it in place) and per output. `reset(values)` poisons
    the arena and the outputs and loads the inputs and the state."""

    def __init__(self, tg: TaskGraph, tags: dict[str, int]):
        graph = tg.graph
        self.arena = np.empty(tg.arena_bytes, dtype=np.uint8)
        self.arena_shadow = np.empty(tg.arena_bytes, dtype=np.int32)
        self.slots: dict[str, _Slot] = {}
        self.loaded: list[str] = []  # inputs and states
        self.poisoned: list[str] = []  # outputs kept outside the arena
        for name, tag in tags.items():
            t = graph.tensors[name]
            if name in tg.arena:
                self.slots[name] = _typed(self.arena, self.arena_shadow, tg.arena[name][0], t.shape, t.dtype, tag)
            elif t.role == Role.ACTIVATION:
                raise SimulationError(f"activation '{name}' has no place in the arena (run plan_memory)")
            elif t.role != Role.STATE_OUT:
                buffer, shadow = np.empty(t.nbytes, dtype=np.uint8), np.empty(t.numel, dtype=np.int32)
                self.slots[name] = _typed(buffer, shadow, 0, t.shape, t.dtype, tag)
                (self.loaded if t.role in (Role.INPUT, Role.STATE) else self.poisoned).append(name)
        for t in graph.by_role(Role.STATE_OUT):
            if t.name not in self.slots:
                state = self.slots[buffer_name(graph, t.name)]
                self.slots[t.name] = _Slot(state.data, state.raw, state.shadow, tags[t.name])

    def reset(self, values: dict[str, torch.Tensor]) -> None:
        self.arena.fill(POISON_BYTE)
        self.arena_shadow.fill(NEVER_WRITTEN)
        for name in self.poisoned:
            slot = self.slots[name]
            slot.raw.fill(POISON_BYTE)
            slot.shadow.fill(NEVER_WRITTEN)
        for name in self.loaded:
            slot = self.slots[name]
            slot.data.copy_(values[name])
            slot.shadow.fill(slot.tag)


@dataclass
class Run:
    """One simulated step: the outputs and the new state (under the STATE names, whole, as
    `ir.interpreter.run` / `ir.ranks.run` return them), the order run and, when not strict, the
    hazards seen."""

    values: dict[str, torch.Tensor]
    order: list[int]
    hazards: list[str] = field(default_factory=list)


def _raw(value: torch.Tensor) -> np.ndarray:
    """A value's bytes as uint8 [*shape, element size], the layout of `_Slot.raw`."""
    return value.contiguous().view(torch.uint8).numpy().reshape(*value.shape, value.element_size())


class Simulator:
    """Executes `tg` with fixed `weights` (name -> FULL tensor; under TP every rank binds its piece).
    A tensor-parallel graph runs on `graph.meta['tp']` simulated ranks in lockstep: each task runs on
    every rank's memory, a collective task on all of them at once (`ir.tasks.execute_collective`'s
    model). Reuse one Simulator for many orders: memory is allocated once and task results are
    memoized on the bytes each task read (per rank)."""

    def __init__(self, tg: TaskGraph, weights: dict[str, torch.Tensor]):
        self.tg = tg
        graph = tg.graph
        missing = [t.name for t in graph.by_role(Role.WEIGHT) if t.name not in weights]
        if missing:
            raise SimulationError(f"no value for weights {missing[:5]}")
        self.weights = weights
        self.num_ranks = graph.meta.get("tp", 1)
        self.names = sorted(n for n, t in graph.tensors.items() if t.role != Role.WEIGHT)
        for name, (_, nbytes) in tg.arena.items():
            if nbytes != graph.tensors[name].nbytes:
                raise SimulationError(f"arena slot of '{name}' holds {nbytes} bytes, the tensor {graph.tensors[name].nbytes}")
        for task in tg.tasks:
            if task.op is None:
                raise SimulationError(f"task t{task.id} ({task.node}) has no recipe (run passes/tile.py)")
        tags = {n: i for i, n in enumerate(self.names)}
        self.memories = [_Memory(tg, tags) for _ in range(self.num_ranks)]
        # per rank, per task: the views of its read and write regions, in declared order
        self.reads = [[[m.slots[r.tensor].region(r.box) for r in t.reads] for t in tg.tasks] for m in self.memories]
        self.writes = [[[m.slots[r.tensor].region(r.box) for r in t.writes] for t in tg.tasks] for m in self.memories]
        self.envs: list[dict[str, torch.Tensor]] = []
        self._memo: dict[tuple, tuple[list[list[np.ndarray]], list[str]]] = {}

    def _holder(self, tag: int) -> str:
        return "poison (never written)" if tag == NEVER_WRITTEN else f"'{self.names[tag]}'"

    def _check(self, slot: _Slot, what: Callable[[], str], hazards: list[str] | None) -> None:
        """Every byte of `slot` holds its tensor; else a hazard naming what the bytes hold."""
        wrong = slot.shadow != slot.tag
        if not wrong.any():
            return
        held = sorted({self._holder(int(v)) for v in np.unique(slot.shadow[wrong])})
        self._report(f"{what()}, but its bytes hold {', '.join(held)}", hazards)

    @staticmethod
    def _report(message: str, hazards: list[str] | None) -> None:
        if hazards is None:
            raise HazardError(message)
        hazards.append(message)

    # ---- one task ---------------------------------------------------------------------------
    def execute_task(self, task: Task, hazards: list[str] | None = None) -> None:
        """On every rank: check that every byte the task reads holds the tensor it names, evaluate the
        task's recipe on those bytes (`ir.tasks.evaluate`; a collective on all ranks at once,
        `ir.tasks.execute_collective`), store its write regions. With `hazards`, problems are
        collected there instead of raised."""
        digests = []
        for rank in range(self.num_ranks):
            where = f" on rank {rank}" if self.num_ranks > 1 else ""
            for r, slot in zip(task.reads, self.reads[rank][task.id]):
                self._check(slot, lambda: f"task t{task.id} ({task.node}) reads {r.text()}{where}", hazards)
                digests.append(hash(slot.raw.tobytes()))
        key = (task.id, tuple(digests))
        memo = self._memo.get(key)
        if memo is None:
            values = self._evaluate(task)
            poisoned = [
                f"task t{task.id} ({task.node}) wrote NaN into {r.text()}: it computed with poison"
                for per_rank in values
                for r, value in zip(task.writes, per_rank)
                if value.is_floating_point() and bool(value.isnan().any())
            ]
            raw = [[_raw(v) for v in per_rank] for per_rank in values]
            memo = self._memo[key] = (raw, poisoned)
        raw, poisoned = memo
        for message in poisoned:
            self._report(message, hazards)
        for rank, per_rank in enumerate(raw):
            for slot, value in zip(self.writes[rank][task.id], per_rank):
                slot.raw[...] = value
                slot.shadow[...] = slot.tag

    def _evaluate(self, task: Task) -> list[list[torch.Tensor]]:
        """Per rank, the values of the task's write regions (copies: memory is not touched)."""
        try:
            if isinstance(task.op, Collective):
                scratch = [dict(env) for env in self.envs]  # the collective stores into these copies
                for env in scratch:
                    for r in task.writes:
                        env[buffer_name(self.tg.graph, r.tensor)] = env[buffer_name(self.tg.graph, r.tensor)].clone()
                execute_collective(task, self.tg.graph, scratch)
                return [[env[buffer_name(self.tg.graph, r.tensor)][index(r.box)].clone() for r in task.writes] for env in scratch]
            return [
                [v.clone() for v in evaluate(task, lambda name, box, env=env: env[buffer_name(self.tg.graph, name)][index(box)])]
                for env in self.envs
            ]
        except Exception as e:
            raise SimulationError(f"task t{task.id} ({task.node}, {task.op.describe()}) failed: {e}") from e

    # ---- one step ---------------------------------------------------------------------------
    def run(self, values: dict[str, torch.Tensor], order: list[int], strict: bool = True) -> Run:
        """Execute the tasks in `order` on fresh memory holding `values` (every INPUT and STATE, whole).
        Strict: the first hazard raises HazardError; otherwise hazards are collected in the Run."""
        if sorted(order) != list(range(len(self.tg.tasks))):
            raise SimulationError("an order must run every task exactly once")
        graph = self.tg.graph
        envs = [rank_inputs(graph, {**self.weights, **values}, rank) for rank in range(self.num_ranks)]
        for memory, env in zip(self.memories, envs):
            memory.reset(env)
        # what a task fetches from, per rank: every buffer (a STATE_OUT lives in its state's) and weight
        self.envs = [
            {**{t.name: env[t.name] for t in graph.by_role(Role.WEIGHT)}, **{n: s.data for n, s in m.slots.items() if buffer_name(graph, n) == n}}
            for m, env in zip(self.memories, envs)
        ]
        hazards: list[str] | None = None if strict else []
        for t in order:
            self.execute_task(self.tg.tasks[t], hazards)
        result: dict[str, torch.Tensor] = {}
        for t in graph.tensors.values():
            if t.role not in (Role.OUTPUT, Role.STATE_OUT):
                continue
            slots = [m.slots[t.name] for m in self.memories]
            for slot in slots:
                self._check(slot, lambda: f"after the step, {t.role.value} '{t.name}' is read", hazards)
            result[buffer_name(graph, t.name)] = self._whole(t, [slot.data.clone() for slot in slots])
        return Run(result, list(order), hazards or [])

    @staticmethod
    def _whole(t, pieces: list[torch.Tensor]) -> torch.Tensor:
        if t.shard is not None:
            return t.shard.assemble(pieces)
        if any(not torch.equal(p, pieces[0]) for p in pieces[1:]):
            raise SimulationError(f"replicated {t.role.value} '{t.name}' differs between ranks")
        return pieces[0]


def from_table(tg: TaskGraph, table) -> TaskGraph:
    """`tg` with the synchronisation of an emitted task table (`ir.task_table.TaskTable`, e.g. decoded
    from the bytes the GPU loads): its per-SM lists, waits, signals and counts, matched to `tg`'s tasks
    by label (`t<id> ...`, passes/emit_task_table.py). Run it with `sm_order` / `event_order` to
    execute the SAME table the GPU executes, each task with its recipe's reference semantics."""
    out = TaskGraph(tg.graph, arena=tg.arena, arena_bytes=tg.arena_bytes, meta=dict(tg.meta))
    counts = table.event_counts()
    producers: list[list[int]] = [[] for _ in table.events]
    out.sm_lists = []
    tasks: dict[int, Task] = {}
    for s, entries in enumerate(table.lists):
        ids = []
        for position, entry in enumerate(entries):
            i = int(entry.label.split()[0].removeprefix("t"))
            if i in tasks or not 0 <= i < len(tg.tasks):
                raise SimulationError(f"table list {s} #{position}: label '{entry.label}' names no task or one listed twice")
            signals = [] if entry.signal is None else [entry.signal]
            tasks[i] = dataclasses.replace(
                tg.tasks[i], waits=[(e, counts[e]) for e in entry.wait], signals=signals, sm=s, order=position
            )
            for e in signals:
                producers[e].append(i)
            ids.append(i)
        out.sm_lists.append(ids)
    if len(tasks) != len(tg.tasks):
        raise SimulationError(f"the table holds {len(tasks)} of the {len(tg.tasks)} tasks")
    out.tasks = [tasks[i] for i in range(len(tg.tasks))]
    out.events = [Event(e, tuple(p)) for e, p in enumerate(producers)]
    return out
