"""schedule: a static per-SM task order from a cost model (DESIGN.md, "The megakernel execution model").

Input: an event-annotated TaskGraph (build_events, check_events). Output, guaranteed to emit_task_table:
- every task sits on exactly one SM (`task.sm`, `task.order`; `tg.sm_lists[s]` = SM s's tasks in order,
  one list per SM of the target);
- every SM's order is a subsequence of ONE global topological order of the event dependencies, so the
  schedule cannot deadlock with all CTAs resident (the first unfinished task of that global order has
  all its producers done and nothing unfinished ahead of it on its SM, so it can always run);
- `tg.meta` holds the cost model's predicted step time (`predicted_step_s`; `timeline` recomputes it
  for any SM lists), the critical path with every weight prefetched (`critical_path_s`: no schedule
  beats it), the roofline at the target's NOMINAL bandwidth (`roofline_nominal_s`, `roofline_bytes`)
  and per SM the task count, bytes and busy time.

Cost model (prior art 5.1, 5.4; cutedsl_notes: ~2.5 us per dependent hand-off measured for a naive
chain on an H200, ~1 us assumed tuned). Per task, with B = the per-SM share of the nominal bandwidth
and F = the per-SM share of the flop rate:
    body = max((weight bytes + activation bytes) / B, flops / F)     the task alone, data at hand
    tail = max(activation bytes / B, flops / F)                      what is left once weights are in
An SM that reaches a task issues its weight prefetch at once (weights are immutable, they never
wait), then waits for the task's events, so
    finish = max(sm free + body, data ready + tail) + task overhead
    data ready = max over waited events of (last producer's finish) + hand-off latency.
Activation bytes are every read and written region (state included) at its tensor's width, or the
task's own `activation_bytes` where run-time positions make its regions overstate the traffic (a
latent cache write stores one row; an attention split reads its chunk); they count as HBM traffic
although the arena mostly lives in L2: the model errs on the slow side.

Algorithm: list scheduling over the event DAG. Tasks are taken in order of priority (bottom level:
the longest cost + latency path to the end of the step, i.e. critical path first) as soon as all their
producers are placed, which keeps the order topological. Each task goes to the SM where it finishes
earliest; among the SMs that all give that finish (typically: every SM that is free early enough to
prefetch the task's weights before its data arrives) it takes the one that becomes free LATEST (best
fit), so SMs that free early stay available for tasks that need a longer prefetch. A task whose inputs
come late therefore still sits on an SM early enough to stream its weights during the wait.
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass

import torch

from k3mk.ir.graph import Graph, Role
from k3mk.ir.streaming import expected_distinct_experts
from k3mk.ir.tasks import Region, Task, TaskGraph
from k3mk.passes.check_deadlock import execution_order

# Defaults for the two latencies when the target does not carry them (see CostModel).
DEFAULT_EVENT_LATENCY_S = 1.0e-6  # tuned cross-SM hand-off (cutedsl_notes: 2.5 us naive on H200)
DEFAULT_TASK_OVERHEAD_S = 1.5e-6  # a small task's fixed part on the engine (passes/manager.py Target.task_overhead)


class ScheduleError(ValueError):
    """The task graph cannot be scheduled (e.g. its events form a cycle)."""


@dataclass(frozen=True)
class CostModel:
    """Seconds per task on one SM. Bandwidth and flop rate are the target's NOMINAL figures split
    evenly over its SMs: when few SMs stream at once each may get more, so the model errs slow."""

    sm_bandwidth: float  # bytes/s per SM
    sm_flop_rate: float  # flop/s per SM
    event_latency: float  # s from a producer's signal to a waiting SM seeing it
    task_overhead: float  # s per task, not overlapped

    @staticmethod
    def for_target(target) -> "CostModel":
        """The target's nominal figures; `event_latency` / `task_overhead` when the target has them."""
        return CostModel(
            sm_bandwidth=target.bandwidth / target.num_sms,
            sm_flop_rate=target.flop_rate / target.num_sms,
            event_latency=getattr(target, "event_latency", DEFAULT_EVENT_LATENCY_S),
            task_overhead=getattr(target, "task_overhead", DEFAULT_TASK_OVERHEAD_S),
        )

    def times(self, task: Task, graph: Graph) -> tuple[float, float]:
        """(body, tail) of `task`: its time with the data at hand, and what remains once its weights
        are in (module docstring)."""
        act = activation_bytes(task, graph)
        compute = task.flops / self.sm_flop_rate
        return max((task.weight_bytes + act) / self.sm_bandwidth, compute), max(act / self.sm_bandwidth, compute)

    def finish(self, sm_free: float, data_ready: float, body: float, tail: float) -> float:
        """When a task ends that its SM reaches at `sm_free` and whose data is there at `data_ready`."""
        return max(sm_free + body, data_ready + tail) + self.task_overhead

    def data_ready(self, producers_finish: list[float]) -> float:
        return max(producers_finish) + self.event_latency if producers_finish else 0.0


def region_bytes(region: Region, graph: Graph) -> int:
    t = graph.tensors[region.tensor]
    n = torch.empty((), dtype=t.dtype).element_size()
    for lo, hi in region.box:
        n *= hi - lo
    return n


def activation_bytes(task: Task, graph: Graph) -> int:
    """Non-weight bytes the task moves: `task.activation_bytes` where tile knows better than the
    regions (run-time positions), else every region read and written."""
    if task.activation_bytes is not None:
        return task.activation_bytes
    return sum(region_bytes(r, graph) for r in (*task.reads, *task.writes))


# --------------------------------------------------------------------------------------------
# dependencies


def predecessors(tg: TaskGraph) -> list[list[int]]:
    """Per task, the tasks it depends on: the producers of every event it waits on."""
    producers = {e.id: e.producers for e in tg.events}
    preds = []
    for t in tg.tasks:
        ids: set[int] = set()
        for e, _ in t.waits:
            if e not in producers:
                raise ScheduleError(f"task t{t.id} ({t.node}) waits on unknown event e{e}")
            ids.update(producers[e])
        preds.append(sorted(ids))
    return preds


def _successors(preds: list[list[int]]) -> list[list[int]]:
    succs: list[list[int]] = [[] for _ in preds]
    for t, ps in enumerate(preds):
        for p in ps:
            succs[p].append(t)
    return succs


def _topological_order(preds: list[list[int]], succs: list[list[int]], tg: TaskGraph) -> list[int]:
    indegree = [len(p) for p in preds]
    order = [t for t, d in enumerate(indegree) if d == 0]
    for t in order:  # grows while iterating (Kahn)
        for s in succs[t]:
            indegree[s] -= 1
            if indegree[s] == 0:
                order.append(s)
    if len(order) != len(preds):
        stuck = [tg.tasks[t] for t, d in enumerate(indegree) if d > 0][:5]
        raise ScheduleError(f"the events form a cycle through {', '.join(f't{t.id} ({t.node})' for t in stuck)}")
    return order


# --------------------------------------------------------------------------------------------
# the roofline


def roofline_bytes(graph: Graph) -> dict[str, float]:
    """Bytes one decode step must move (DESIGN.md, "Benchmark method"): every weight byte once at its
    stored width, but only the rows the step selects, and decode state read and written. Activations
    are excluded. Selected rows, recognised by operand shapes so that fused kinds count alike:
    - a routed expert weight [E, out, in] (3-d, next to an integer [tokens, k] ids operand): each
      distinct selected expert once, in expectation (`expected_distinct_experts`);
    - the embedding table: one row per token;
    - the latent cache: read at its full (max-context) length, one row per token written."""
    consumers = graph.consumers()
    producers = graph.producers()
    weights = experts = 0.0
    for w in graph.by_role(Role.WEIGHT):
        users = consumers.get(w.name, [])
        if not users:
            continue
        node = users[0]
        ids = [graph.tensors[i] for i in node.inputs if graph.tensors[i].role != Role.WEIGHT and not graph.tensors[i].dtype.is_floating_point]
        if node.op.name == "embedding":
            tokens = ids[0].shape[0]
            weights += w.nbytes * min(tokens, w.shape[0]) / w.shape[0]
        elif len(w.shape) == 3 and ids and len(ids[0].shape) == 2:
            tokens, top_k = ids[0].shape
            experts += w.nbytes * expected_distinct_experts(w.shape[0], top_k, tokens) / w.shape[0]
        else:
            weights += w.nbytes
    state = 0.0
    for s in graph.by_role(Role.STATE_OUT):
        state += graph.tensors[s.alias].nbytes  # read
        node = producers[s.name]
        # the latent cache write stores one row per token; every other state is rewritten whole
        state += graph.tensors[node.inputs[1]].nbytes if node.op.name == "mla_cache_write" else s.nbytes
    return {"weights": weights, "experts": experts, "state": state, "total": weights + experts + state}


# --------------------------------------------------------------------------------------------
# the pass


def timeline(tg: TaskGraph, model: CostModel) -> list[float]:
    """Per task, when the cost model says it finishes under `tg`'s SM lists and events."""
    preds = predecessors(tg)
    finish = [0.0] * len(tg.tasks)
    for t in execution_order(tg):
        task = tg.tasks[t]
        sm_free = finish[tg.sm_lists[task.sm][task.order - 1]] if task.order > 0 else 0.0
        finish[t] = model.finish(sm_free, model.data_ready([finish[p] for p in preds[t]]), *model.times(task, tg.graph))
    return finish


def schedule(tg: TaskGraph, target) -> TaskGraph:
    """Fill task.sm / task.order / tg.sm_lists / tg.meta (module docstring)."""
    model = CostModel.for_target(target)
    num_sms = target.num_sms
    preds = predecessors(tg)
    succs = _successors(preds)
    topo = _topological_order(preds, succs, tg)
    times = [model.times(t, tg.graph) for t in tg.tasks]

    # priority, the bottom level: the longest (cost + hand-off) path from a task to the end of the step
    # with every task taking its full body; and the same path with tails only (weights all prefetched),
    # whose maximum no schedule can beat
    rank = [0.0] * len(tg.tasks)
    lower = [0.0] * len(tg.tasks)
    for t in reversed(topo):
        after = [model.event_latency + rank[s] for s in succs[t]]
        rank[t] = times[t][0] + model.task_overhead + max(after, default=0.0)
        lower[t] = times[t][1] + model.task_overhead + max((model.event_latency + lower[s] for s in succs[t]), default=0.0)

    finish = [0.0] * len(tg.tasks)
    free = [(0.0, s) for s in range(num_sms)]  # sorted (time the SM becomes free, SM)
    sm_lists: list[list[int]] = [[] for _ in range(num_sms)]
    busy = [0.0] * num_sms
    indegree = [len(p) for p in preds]
    ready = [(-rank[t], t) for t in range(len(tg.tasks)) if indegree[t] == 0]
    heapq.heapify(ready)
    while ready:
        _, t = heapq.heappop(ready)
        body, tail = times[t]
        data = model.data_ready([finish[p] for p in preds[t]])
        # SMs free by `fits` finish the task as early as any: take the latest-free of them (lowest
        # index among equals); if none, the first SM to become free
        fits = data + tail - body
        i = bisect.bisect_right(free, (fits, num_sms)) - 1
        i = bisect.bisect_left(free, (free[i][0], -1)) if i >= 0 else 0
        sm_free, sm = free.pop(i)
        finish[t] = model.finish(sm_free, data, body, tail)
        bisect.insort(free, (finish[t], sm))
        busy[sm] += body + model.task_overhead
        task = tg.tasks[t]
        task.sm, task.order = sm, len(sm_lists[sm])
        sm_lists[sm].append(t)
        for s in succs[t]:
            indegree[s] -= 1
            if indegree[s] == 0:
                heapq.heappush(ready, (-rank[s], s))

    tg.sm_lists = sm_lists
    roof = roofline_bytes(tg.graph)
    tg.meta.update(
        num_sms=num_sms,
        predicted_step_s=max(finish, default=0.0),
        critical_path_s=max(lower, default=0.0),
        roofline_bytes=roof["total"],
        roofline_nominal_s=roof["total"] / target.bandwidth,
        nominal_bandwidth=target.bandwidth,
        event_latency_s=model.event_latency,
        task_overhead_s=model.task_overhead,
        sm_tasks=[len(ts) for ts in sm_lists],
        sm_bytes=[sum(tg.tasks[t].weight_bytes + activation_bytes(tg.tasks[t], tg.graph) for t in ts) for ts in sm_lists],
        sm_busy_s=busy,
    )
    return tg
