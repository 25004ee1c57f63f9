"""check_deadlock: prove that the per-SM task lists complete (DESIGN.md, "Deadlock freedom is checked at
compile time"; prior art 6: residency assumptions and miscounted arrivals).

The model is the megakernel's: every SM runs its list in order and stays resident; a task starts once
every event it waits on has been signalled by all of the event's producers in this step. Simulate
one step: an SM advances past its next task when that task's waits are satisfied by signals of
completed tasks. If no SM can advance while tasks remain, the table deadlocks: the error names each
stuck SM's next task, the events it waits on with their counts and the producers not yet done.

Guarantees: nothing changes; `execution_order` (one order in which the tasks can complete) is what
check_events walks to compute happens-before with program order.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from k3mk.ir.tasks import TaskGraph


class DeadlockError(ValueError):
    """The task lists cannot all complete: names the stuck tasks and what they wait for."""


def sm_lists_or_singletons(tg: TaskGraph) -> list[list[int]]:
    """The schedule's per-SM lists; before scheduling, every task alone on its own list (events only)."""
    return tg.sm_lists if tg.sm_lists else [[t.id] for t in tg.tasks]


def _check_assignment(tg: TaskGraph, lists: list[list[int]]) -> None:
    seen = [0] * len(tg.tasks)
    for s, ts in enumerate(lists):
        for i, t in enumerate(ts):
            if not 0 <= t < len(tg.tasks):
                raise DeadlockError(f"SM {s} lists unknown task {t}")
            seen[t] += 1
            task = tg.tasks[t]
            if tg.sm_lists and (task.sm, task.order) != (s, i):
                raise DeadlockError(f"task t{t} is at SM {s} #{i} but says sm={task.sm} order={task.order}")
    missing = [t for t, n in enumerate(seen) if n != 1]
    if missing:
        raise DeadlockError(f"{len(missing)} tasks are not on exactly one SM list, e.g. t{missing[0]} ({tg.tasks[missing[0]].node})")


def execution_order(tg: TaskGraph) -> list[int]:
    """Simulate one step (module docstring); the tasks in an order in which they can complete."""
    lists = sm_lists_or_singletons(tg)
    _check_assignment(tg, lists)
    expected = [e.expected for e in tg.events]
    signalled = [0] * len(tg.events)
    position = [0] * len(lists)
    blocked: dict[int, list[int]] = {}  # event -> SMs whose next task waits on it
    ready = deque(range(len(lists)))
    order: list[int] = []
    while ready:
        s = ready.popleft()
        ts = lists[s]
        while position[s] < len(ts):
            task = tg.tasks[ts[position[s]]]
            missing = next((e for e, _ in task.waits if signalled[e] < expected[e]), None)
            if missing is not None:
                blocked.setdefault(missing, []).append(s)
                break
            order.append(task.id)
            position[s] += 1
            for e in task.signals:
                signalled[e] += 1
                if signalled[e] == expected[e]:
                    ready.extend(blocked.pop(e, []))
    if len(order) < len(tg.tasks):
        raise DeadlockError(_stuck_report(tg, lists, position, signalled, set(order)))
    return order


def _stuck_report(tg: TaskGraph, lists: list[list[int]], position: list[int], signalled: list[int], done: set[int]) -> str:
    stuck = [s for s in range(len(lists)) if position[s] < len(lists[s])]
    lines = [f"deadlock: {len(stuck)} SM lists cannot advance, {len(tg.tasks) - len(done)} tasks never run"]
    for s in stuck[:8]:
        task = tg.tasks[lists[s][position[s]]]
        waits = []
        for e, _ in task.waits:
            event = tg.events[e]
            if signalled[e] < event.expected:
                pending = [f"t{p} ({tg.tasks[p].node})" for p in event.producers if p not in done][:3]
                waits.append(f"e{e} {signalled[e]}/{event.expected}, waiting for {', '.join(pending)}")
        where = f"SM {s} #{position[s]}: " if tg.sm_lists else ""
        lines.append(f"  {where}t{task.id} ({task.node}) waits on {'; '.join(waits)}")
    return "\n".join(lines)


def check_deadlock(tg: TaskGraph, target: Any = None) -> TaskGraph:
    """Raise DeadlockError unless every SM list completes (module docstring); returns `tg` unchanged."""
    execution_order(tg)
    return tg
