"""The per-SM timeline of one decode step of a profile build (`k3mk compile --profile`, docs/megakernel.md
"Profile builds"): a Chrome / Perfetto trace, a summary of where the time goes per op kind, and the
hand-off latency of the events.

    mk.step()
    tl = Timeline.of(mk)                                   # the last completed step
    json.dump(chrome_trace(tl), open("trace.json", "w"))   # ui.perfetto.dev or chrome://tracing
    print(format_summary(summarize(tl)))

The consumer warps' thread 0 stamps %globaltimer (ns; one clock for the whole GPU, so stamps of
different SMs compare) at three points of every task, the producer warp's lane 0 at two more:

* wait (start -> wait_done): the consumers waiting for the task's `ready` barrier, which the waiter warp
  completes once its polls of the waited event counters (ld.acquire.gpu) reach this step's target:
  consumer time blocked on events. The waiter runs ahead, so a task whose events were signalled while
  the consumers ran the one before waits for nothing.
* body (wait_done -> body_end): the op body (its ring fills waited
  for and read, activations and state loaded, compute, stores) and the consumer barrier after it. An
  op kind's bytes / body time is the bandwidth ONE CTA achieves running it. An op that waits inside its
  body (the collectives, which wait for the other ranks) shows that wait in its body.
* between (body_end -> the next task's start): the arrive on `done` (the signaller warp releases the
  task's event from there) and the profile record's stores.
* produce (produce_start -> produce_end, the producer's own track): forwarding the record and issuing
  the task's fills (or its L2 prefetches), ahead of the consumers; `ring_wait` of it is the time the
  producer waited for a free ring slot (producer time blocked on a full ring), `issued_bytes` the bytes
  its bulk copies brought: what the producer actually streamed, not the cost model's count.
* inside a streaming op's body, thread 0 (consumer warp 0's lane 0) stamps when the op's input was staged
  (`staged`: its prologue done, gemv and expert_gated), when its first ring fill was there (`first_fill`: its
  first acquire returned) and when it released its last fill (`last_release`); 0 where not taken. Per op
  variant the summary splits such bodies into prologue (wait_done -> staged), first-fill wait (staged, or
  wait_done, -> first_fill: the ring was behind the consumers) and tail (last_release -> body_end: warp 0's
  last epilogue, the other warps' last fills and epilogues, the consumer barrier). The tail starts at WARP 0's last
  release, so body - prologue - tail is not the time the fills took: give warp 0 fewer fills and the tail grows
  while the body may not move (2026-12-04 evening, BENCHMARKS.md); compare bodies, or staged -> body_end. Thread 0
  also sums the ns warp 0 waited in its acquires for fills to land (`fill_wait`, every fill it took, the first
  included): near the body's time between its first acquire and last release, the fills came late (HBM, the
  producer); near 0, warp 0 found them landed (its own work, or the barrier, bound it).
Step wall = last body_end - first start: the launch, the CTAs' set-up and the last CTA's exit are outside
it. %globaltimer advances in steps (about 32 ns on H100 / H200 by reports): an interval shorter than a
step reads as 0 or one step, so per-task values of a few steps are noise, sums over many tasks are not.
The summary reports the step seen in the records (`timer_step_ns`).

Hand-off latency of an event = the waiting task's wait_done - the event's LAST signaller's body_end stamp
(just before its `done` arrive). It covers the signaller warp's wake-up and release add, the add's trip to
L2, the waiter warp's poll loop (up to one poll round trip late), its acquire load and the consumers' wake-up. Only blocking waits measure it: the waiter was already waiting (it started
before that signal) and this event was its last to be signalled.

Bytes per task: `issued_bytes` as recorded; the cost model's (passes/tile.py `weight_bytes`: a routed
expert task counts ONE expert's rows per request; `other_bytes`: activations, state and KV cache read and
written, from passes/schedule.py) from task_bytes.json in profile artifacts. An op's body bandwidth counts
its issued bytes where the producer streams them, else the cost model's weight bytes, plus other bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from k3mk.runtime import abi
from k3mk.runtime.table import LoadedTable, TaskHeader

TASK_BYTES_FILE = "task_bytes.json"  # artifact file: {"weight_bytes": [...], "other_bytes": [...]} per global task
INTERVALS = ("wait", "body")  # a task's consecutive consumer intervals, in order
_STAMPS = ("start", "wait_done", "body_end")  # their bounds
INSIDE_STAMPS = ("staged", "first_fill", "last_release")  # inside a streaming body, in order (0 = not taken)
INSIDE = ("prologue", "first_fill", "tail", "fill_wait")  # the body's parts they bound, and warp 0's fill wait (TaskTimes.inside)
PRODUCER_TRACK = 1 << 16  # Chrome trace: CTA c's producer is thread PRODUCER_TRACK + c
TIMER_NOTE = "%globaltimer ns, one clock for the GPU; it advances in steps (~32 ns reported on H100/H200): per-task intervals of a few steps are not resolved"


@dataclass(frozen=True)
class TaskTimes:
    """One task's stamps (ns of %globaltimer), the SM it ran on, and its producer's record."""

    start: int
    wait_done: int
    body_end: int
    smid: int
    produce_start: int
    produce_end: int
    ring_wait: int  # ns
    issued_bytes: int
    staged: int = 0  # inside a streaming body (module docstring); 0 = not taken
    first_fill: int = 0
    last_release: int = 0
    fill_wait: int = 0  # ns consumer warp 0 waited for its fills to land (module docstring)

    def interval(self, name: str) -> int:
        i = INTERVALS.index(name)
        return getattr(self, _STAMPS[i + 1]) - getattr(self, _STAMPS[i])

    @property
    def signal(self) -> int:
        """When the task signalled: its release add follows the body_end stamp."""
        return self.body_end

    @property
    def produce(self) -> int:
        return self.produce_end - self.produce_start

    def inside(self) -> dict[str, int]:
        """The body's parts that its stamps bound (module docstring): prologue, first_fill (wait), tail; only
        those whose stamps were taken."""
        parts = {}
        if self.staged:
            parts["prologue"] = self.staged - self.wait_done
        if self.first_fill:
            parts["first_fill"] = self.first_fill - (self.staged or self.wait_done)
        if self.last_release:
            parts["tail"] = self.body_end - self.last_release
        if self.first_fill:
            parts["fill_wait"] = self.fill_wait
        return parts


@dataclass(frozen=True)
class Handoff:
    """One (waiter, waited event) pair of a step."""

    event: int
    waiter: int  # global task index
    signaller: int  # the event's last signaller in this step
    latency: int  # ns: waiter's wait_done - signaller's body_end stamp
    blocking: bool  # the waiter was waiting for exactly this signal (module docstring)


@dataclass(frozen=True)
class Timeline:
    step: int
    headers: list[TaskHeader]  # global task index order
    times: list[TaskTimes]
    ops: list[str]  # op kind per task
    labels: list[str]
    event_names: list[str]
    weight_bytes: list[int] | None  # cost model, per task (None: unknown)
    other_bytes: list[int] | None

    @staticmethod
    def from_records(table: LoadedTable, records: Sequence[Sequence[int]], step: int, task_bytes: dict | None = None) -> Timeline:
        """`records`: int64 [num_tasks, abi.PROFILE_WORDS] of step `step` (Megakernel.profile_records)."""
        headers = table.task_headers()
        if len(records) != len(headers):
            raise ValueError(f"{len(records)} records for {len(headers)} tasks")
        field = {name: i for i, name in enumerate(abi.PROFILE_FIELDS)}
        for h, r in zip(headers, records):
            if r[field["epoch"]] != step:
                raise ValueError(f"task {h.index} (CTA {h.cta} #{h.position}) has a record of step {r[field['epoch']]}, not {step}")
        times = [TaskTimes(*(int(r[field[name]]) for name in (*_STAMPS, "smid", "produce_start", "produce_end", "ring_wait",
                                                               "issued_bytes", *INSIDE_STAMPS, "fill_wait"))) for r in records]  # fmt: skip
        variants = table.meta["variants"]
        ops = [variants[h.opcode]["op"] for h in headers]
        labels = [table.label(h.cta, h.position) for h in headers]
        events = list(table.meta.get("events", []))
        weight_bytes = other_bytes = None
        if task_bytes is not None:
            weight_bytes, other_bytes = list(task_bytes["weight_bytes"]), list(task_bytes["other_bytes"])
            if len(weight_bytes) != len(headers) or len(other_bytes) != len(headers):
                raise ValueError(f"{TASK_BYTES_FILE} lists {len(weight_bytes)} tasks, the table has {len(headers)}")
        return Timeline(step, headers, times, ops, labels, events, weight_bytes, other_bytes)

    @staticmethod
    def of(mk, step: int | None = None) -> Timeline:
        """The timeline of a Megakernel's completed step `step` (default: the last one)."""
        import json

        step = mk.epoch if step is None else step
        records = mk.profile_records(step).tolist()
        task_bytes = json.loads(mk.manifest.read_file(TASK_BYTES_FILE)) if TASK_BYTES_FILE in mk.manifest["files"] else None
        return Timeline.from_records(mk.table, records, step, task_bytes)

    def event_name(self, event: int) -> str:
        return self.event_names[event] if 0 <= event < len(self.event_names) else f"e{event}"

    @property
    def t0(self) -> int:
        return min(t.start for t in self.times)

    @property
    def t1(self) -> int:
        return max(t.signal for t in self.times)

    def lists(self) -> dict[int, list[int]]:
        """CTA -> its tasks' global indices in list order (CTAs with tasks only)."""
        out: dict[int, list[int]] = {}
        for h in self.headers:
            out.setdefault(h.cta, []).append(h.index)
        return out

    def last_signallers(self) -> dict[int, int]:
        """Event -> global index of the task that signalled it last in this step."""
        last: dict[int, int] = {}
        for h, t in zip(self.headers, self.times):
            if h.signal is not None and (h.signal not in last or t.signal > self.times[last[h.signal]].signal):
                last[h.signal] = h.index
        return last

    def handoffs(self) -> list[Handoff]:
        """Every (waiter, waited event) pair, against the event's last signaller of this step."""
        last = self.last_signallers()
        out = []
        for h, t in zip(self.headers, self.times):
            if not h.waits:
                continue
            binding = max(self.times[last[e]].signal for e in h.waits)
            for e in h.waits:
                s = self.times[last[e]].signal
                out.append(Handoff(e, h.index, last[e], t.wait_done - s, s == binding and t.start < s))
        return out

    def critical_path(self) -> list[int]:
        """The step's critical path, first task first: from the task that signalled last, each task's binding
        predecessor in turn: the last signaller of its latest waited event when the task started before that
        signal (it waited for it), else the task before it in its CTA's list."""
        last = self.last_signallers()
        before = {b: a for tasks in self.lists().values() for a, b in zip(tasks, tasks[1:])}
        i, path = max(range(len(self.times)), key=lambda k: self.times[k].signal), []
        while i is not None:
            path.append(i)
            h, t = self.headers[i], self.times[i]
            signaller = max((last[e] for e in h.waits), key=lambda k: self.times[k].signal, default=None)
            i = signaller if signaller is not None and t.start < self.times[signaller].signal else before.get(i)
        return path[::-1]

    def violations(self) -> list[str]:
        """What contradicts the execution model: stamps out of order within a task, list order broken (for
        the consumers or the producer), a ring wait longer than the produce interval, or a waiter done
        waiting before a signaller of its event signalled. Empty for a sound record."""
        problems = []
        for h, t in zip(self.headers, self.times):
            names = ("start", "wait_done", *(s for s in INSIDE_STAMPS if getattr(t, s)), "body_end")
            stamps = [getattr(t, s) for s in names]
            if stamps != sorted(stamps):
                problems.append(f"task {h.index} ({self.labels[h.index]}): stamps out of order {dict(zip(names, stamps))}")
            if not 0 <= t.ring_wait <= t.produce or t.issued_bytes < 0:
                problems.append(f"task {h.index} ({self.labels[h.index]}): producer record {t.produce_start}..{t.produce_end}, "
                                f"ring wait {t.ring_wait} ns, {t.issued_bytes} bytes")  # fmt: skip
        for tasks in self.lists().values():
            for a, b in zip(tasks, tasks[1:]):
                if self.times[b].start < self.times[a].signal:
                    problems.append(f"task {b} ({self.labels[b]}) started before task {a} of its list ended")
                if self.times[b].produce_start < self.times[a].produce_end:
                    problems.append(f"task {b} ({self.labels[b]}): its producer began before task {a}'s was done")
        last = self.last_signallers()
        for h, t in zip(self.headers, self.times):
            for e in h.waits:
                if self.times[last[e]].signal > t.wait_done:
                    problems.append(f"task {h.index} ({self.labels[h.index]}) finished waiting on event {e} before task {last[e]} signalled it")
        return problems


def percentile(values: Sequence[int], p: float) -> int | None:
    """Nearest-rank percentile (p in (0, 100]): the smallest value with at least p% of the values at or
    below it (the median of an even count is the lower middle value). None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(math.ceil(p / 100 * len(ordered)), 1) - 1]


def timer_step(tl: Timeline) -> int | None:
    """The smallest gap between two distinct stamps of the step: the timer's resolution, as observed."""
    stamps = sorted({getattr(t, s) for t in tl.times for s in (*_STAMPS, "produce_start", "produce_end")})
    return min((b - a for a, b in zip(stamps, stamps[1:])), default=None)


def _by_key(tl: Timeline, keys: list[str]) -> dict[str, dict]:
    """Per key (one per task): tasks, totals and means of each interval, producer time, bytes issued and
    modelled, bytes / body time; most time (wait + body) first."""
    groups: dict[str, dict] = {}
    for i, key in enumerate(keys):
        s = groups.setdefault(key, {"count": 0, **{f"{name}_ns": 0 for name in INTERVALS}, "produce_ns": 0, "ring_wait_ns": 0,
                                    "issued_bytes": 0, "weight_bytes": 0, "other_bytes": 0,
                                    **{f"{name}_ns": 0 for name in INSIDE}, **{f"{name}_tasks": 0 for name in INSIDE}})  # fmt: skip
        t = tl.times[i]
        s["count"] += 1
        for name in INTERVALS:
            s[f"{name}_ns"] += t.interval(name)
        for name, ns in t.inside().items():
            s[f"{name}_ns"] += ns
            s[f"{name}_tasks"] += 1
        s["produce_ns"] += t.produce
        s["ring_wait_ns"] += t.ring_wait
        s["issued_bytes"] += t.issued_bytes
        if tl.weight_bytes is not None:
            s["weight_bytes"] += tl.weight_bytes[i]
            s["other_bytes"] += tl.other_bytes[i]
    for s in groups.values():
        for name in (*INTERVALS, "produce"):
            s[f"{name}_mean_ns"] = s[f"{name}_ns"] / s["count"]
        for name in INSIDE:  # over the tasks that took the stamps
            s[f"{name}_mean_ns"] = s[f"{name}_ns"] / s[f"{name}_tasks"] if s[f"{name}_tasks"] else None
        streamed = s["issued_bytes"] or s["weight_bytes"]
        moved = streamed + s["other_bytes"]
        s["body_GBps"] = moved / s["body_ns"] if (s["issued_bytes"] or tl.weight_bytes is not None) and s["body_ns"] > 0 else None  # bytes / ns = GB/s
        if tl.weight_bytes is None:
            s["weight_bytes"] = s["other_bytes"] = None
    return dict(sorted(groups.items(), key=lambda kv: -(kv[1]["wait_ns"] + kv[1]["body_ns"])))


def summarize(tl: Timeline, slowest: int = 10) -> dict:
    """Where the step's time goes (module docstring for what each interval holds): the consumers' CTA time
    by interval, the producers' time and ring waits, per op kind and per variant (tasks, totals and means,
    bytes issued and modelled, bytes / body time), the critical path (Timeline.critical_path: per op kind its tasks' bodies and
    hand-offs, which add up to the path's span), and event hand-off latency."""
    t0, t1 = tl.t0, tl.t1
    wall = t1 - t0
    lists = tl.lists()
    cta_time = {name: sum(t.interval(name) for t in tl.times) for name in INTERVALS}
    cta_time["between"] = sum(tl.times[b].start - tl.times[a].signal for ts in lists.values() for a, b in zip(ts, ts[1:]))
    cta_time["outside"] = sum((tl.times[ts[0]].start - t0) + (t1 - tl.times[ts[-1]].signal) for ts in lists.values())
    window = len(lists) * wall
    producer = {"produce": sum(t.produce for t in tl.times), "ring_wait": sum(t.ring_wait for t in tl.times)}
    by_op = _by_key(tl, tl.ops)
    # the same per variant (an op kind's variants differ in shapes, prologue, epilogue and batch)
    by_variant = _by_key(tl, [f"{op} #{h.opcode}" for op, h in zip(tl.ops, tl.headers)])
    handoffs = tl.handoffs()
    blocking = [h for h in handoffs if h.blocking]
    latencies = [h.latency for h in blocking]
    issued = sum(t.issued_bytes for t in tl.times)
    modelled = sum(tl.weight_bytes) + sum(tl.other_bytes) if tl.weight_bytes is not None else None
    path = tl.critical_path()
    on_path: dict[str, dict] = {}
    reached = tl.t0  # a path task's hand-off: from its predecessor's signal (the step's start) to its wait done
    for i in path:
        t = tl.times[i]
        o = on_path.setdefault(tl.ops[i], {"count": 0, "body_ns": 0, "handoff_ns": 0, **{f"{name}_ns": 0 for name in INSIDE}})
        o["count"] += 1
        o["body_ns"] += t.interval("body")
        for name, ns in t.inside().items():
            o[f"{name}_ns"] += ns
        o["handoff_ns"] += t.wait_done - reached
        reached = t.signal
    critical = {"tasks": len(path), "span_ns": reached - tl.t0, "handoff_ns": sum(o["handoff_ns"] for o in on_path.values()),
                "by_op": dict(sorted(on_path.items(), key=lambda kv: -kv[1]["body_ns"]))}  # fmt: skip
    return {
        "step": tl.step,
        "tasks": len(tl.times),
        "ctas": len(lists),  # CTAs whose lists hold tasks
        "wall_ns": wall,
        "timer": TIMER_NOTE,
        "timer_step_ns": timer_step(tl),
        "cta_time_ns": cta_time,
        "cta_time_fraction": {k: (v / window if window else 0.0) for k, v in cta_time.items()},
        "producer_ns": producer,
        "producer_fraction": {k: (v / window if window else 0.0) for k, v in producer.items()},
        "by_op": by_op,
        "by_variant": by_variant,
        "critical_path": critical,
        "handoff": {
            "waits": len(handoffs),
            "blocking": len(blocking),
            "median_ns": percentile(latencies, 50),
            "p90_ns": percentile(latencies, 90),
            "max_ns": max(latencies) if latencies else None,
            "slowest": [
                {"event": tl.event_name(h.event), "latency_ns": h.latency,
                 "waiter": tl.labels[h.waiter], "waiter_cta": tl.headers[h.waiter].cta,
                 "signaller": tl.labels[h.signaller], "signaller_cta": tl.headers[h.signaller].cta}
                for h in sorted(blocking, key=lambda h: -h.latency)[:slowest]
            ],  # fmt: skip
        },
        "issued_bytes": issued,
        "weight_bytes": sum(tl.weight_bytes) if tl.weight_bytes is not None else None,
        "other_bytes": sum(tl.other_bytes) if tl.other_bytes is not None else None,
        "step_GBps": modelled / wall if modelled is not None and wall > 0 else None,
    }


def _us(ns: float | None) -> str:
    return "-" if ns is None else f"{ns / 1e3:.2f}"


VARIANT_ROWS = 20  # variants format_summary lists (most wait + body first; summary.json has them all)


def _group_table(title: str, groups) -> list[str]:
    """Lines of summarize()'s per-group figures (by_op or by_variant items), a blank line first."""
    lines = ["", f"{title:20s} {'tasks':>6s} {'wait us':>10s} {'wait mean':>10s} {'body us':>10s} {'body mean':>10s} "
                 f"{'ring wait us':>12s} {'issued MB':>9s} {'model MB':>9s} {'body GB/s':>9s}  in a body (mean us): "
                 "prologue / first fill / tail / warp 0's fill wait"]  # fmt: skip
    for name, o in groups:
        model = "-" if o["weight_bytes"] is None else f"{(o['weight_bytes'] + o['other_bytes']) / 1e6:.2f}"
        gbps = "-" if o["body_GBps"] is None else f"{o['body_GBps']:.1f}"
        inside = " / ".join(_us(o[f"{part}_mean_ns"]) for part in INSIDE)
        lines.append(
            f"{name:20s} {o['count']:6d} {_us(o['wait_ns']):>10s} {_us(o['wait_mean_ns']):>10s} {_us(o['body_ns']):>10s} "
            f"{_us(o['body_mean_ns']):>10s} {_us(o['ring_wait_ns']):>12s} {o['issued_bytes'] / 1e6:9.2f} {model:>9s} {gbps:>9s}  {inside}"
        )
    return lines


def format_summary(s: dict) -> str:
    """summarize()'s dict as text."""
    frac, pfrac = s["cta_time_fraction"], s["producer_fraction"]
    lines = [
        f"k3mk profile: step {s['step']}, {s['tasks']} tasks on {s['ctas']} CTAs (lists with tasks), wall {_us(s['wall_ns'])} us "
        "(first task start -> last task end; launch and CTA exit outside)",
        f"timer: {s['timer']}; smallest gap between distinct stamps of this step: {s['timer_step_ns']} ns",
        f"consumer CTA time ({s['ctas']} CTAs x wall): " + ", ".join(f"{name} {frac[name] * 100:.1f}%" for name in (*INTERVALS, "between", "outside"))
        + " (wait = blocked on events)",
        f"producer time: producing {pfrac['produce'] * 100:.1f}%, of which blocked on a full ring {pfrac['ring_wait'] * 100:.1f}% "
        f"of CTA time; issued {s['issued_bytes'] / 1e6:.2f} MB",
    ]
    lines += _group_table("op kind", s["by_op"].items())
    lines += _group_table("op #variant", list(s["by_variant"].items())[:VARIANT_ROWS])
    c = s["critical_path"]
    lines += ["", f"critical path ({c['tasks']} tasks, {_us(c['span_ns'])} us): bodies and hand-offs (predecessor's signal -> wait done) per op kind:"]
    for op, o in c["by_op"].items():
        inside = ", ".join(f"{name} {_us(o[f'{name}_ns'])}" for name in INSIDE if o[f"{name}_ns"])
        lines.append(f"  {op:16s} {o['count']:6d} tasks  body {_us(o['body_ns']):>10s} us  hand-off {_us(o['handoff_ns']):>9s} us"
                     + (f"  (in the bodies: {inside} us)" if inside else ""))
    h = s["handoff"]
    lines += ["", f"hand-off (last signal -> waiter's wait done) over the {h['blocking']} blocking of {h['waits']} waits: "
                  f"median {_us(h['median_ns'])} us, p90 {_us(h['p90_ns'])} us, max {_us(h['max_ns'])} us; slowest:"]  # fmt: skip
    for x in h["slowest"]:
        lines.append(f"  {_us(x['latency_ns'])} us  {x['event']}: CTA {x['signaller_cta']} {x['signaller']} -> CTA {x['waiter_cta']} {x['waiter']}")
    if s["weight_bytes"] is not None:
        lines += ["", f"bytes (cost model): weights {s['weight_bytes'] / 1e6:.2f} MB, other {s['other_bytes'] / 1e6:.2f} MB; "
                      f"over the wall: {s['step_GBps']:.1f} GB/s"]  # fmt: skip
    return "\n".join(lines) + "\n"


def chrome_trace(tl: Timeline) -> dict:
    """Chrome trace event JSON (Perfetto loads it): process = the step, one track per CTA (named with its
    SM), one slice per task named by op kind with the intervals nested in it, and a flow arrow per blocking
    hand-off. Times in us from the step's first task start."""
    t0, pid = min(tl.t0, min(t.produce_start for t in tl.times)), tl.step  # producers start ahead of their consumers

    def us(ns: int) -> float:
        # 0.1 ns above the exact value: importers that truncate us * 1000 to integer ns (Perfetto's JSON
        # reader) then get the exact ns, so the nested slices' bounds stay equal to their parent's.
        return round(ns / 1e3 + 1e-4, 4)

    events: list[dict] = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"k3mk step {tl.step}"}}]
    for cta, tasks in tl.lists().items():
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": cta, "args": {"name": f"CTA {cta} (SM {tl.times[tasks[0]].smid})"}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": cta, "args": {"sort_index": 2 * cta}})
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": PRODUCER_TRACK + cta, "args": {"name": f"CTA {cta} producer"}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": PRODUCER_TRACK + cta, "args": {"sort_index": 2 * cta + 1}})
    for h, t in zip(tl.headers, tl.times):
        args = {"label": tl.labels[h.index], "task": h.index, "position": h.position, "opcode": h.opcode,
                "waits": [tl.event_name(e) for e in h.waits], "signal": None if h.signal is None else tl.event_name(h.signal),
                **{f"{iv}_ns": t.interval(iv) for iv in INTERVALS}}  # fmt: skip
        if tl.weight_bytes is not None:
            args.update(weight_bytes=tl.weight_bytes[h.index], other_bytes=tl.other_bytes[h.index])
        events.append({"ph": "X", "name": tl.ops[h.index], "cat": "task", "pid": pid, "tid": h.cta, "ts": us(t.start - t0),
                       "dur": us(t.signal - t.start), "args": args})  # fmt: skip
        for i, iv in enumerate(INTERVALS):
            a, b = getattr(t, _STAMPS[i]), getattr(t, _STAMPS[i + 1])
            if b > a:
                events.append({"ph": "X", "name": iv, "cat": "interval", "pid": pid, "tid": h.cta, "ts": us(a - t0), "dur": us(b - a)})
        if t.produce > 0:
            events.append({"ph": "X", "name": tl.ops[h.index], "cat": "produce", "pid": pid, "tid": PRODUCER_TRACK + h.cta,
                           "ts": us(t.produce_start - t0), "dur": us(t.produce),
                           "args": {"label": tl.labels[h.index], "ring_wait_ns": t.ring_wait, "issued_bytes": t.issued_bytes}})  # fmt: skip
    for n, x in enumerate(x for x in tl.handoffs() if x.blocking):
        src, dst = tl.headers[x.signaller], tl.headers[x.waiter]
        # The arrow leaves 1 ns before the signal stamp: inside the signaller's slice, which ends at it.
        flow = f"{(tl.step << 32) + n:#x}"  # unique across the steps of one trace file
        events.append({"ph": "s", "id": flow, "name": tl.event_name(x.event), "cat": "handoff", "pid": pid, "tid": src.cta,
                       "ts": us(tl.times[x.signaller].signal - 1 - t0)})  # fmt: skip
        events.append({"ph": "f", "bp": "e", "id": flow, "name": tl.event_name(x.event), "cat": "handoff", "pid": pid, "tid": dst.cta,
                       "ts": us(tl.times[x.waiter].wait_done - t0)})  # fmt: skip
    return {"traceEvents": events, "displayTimeUnit": "ns",
            "otherData": {"step": tl.step, "wall_ns": tl.t1 - tl.t0, "timer": TIMER_NOTE}}  # fmt: skip
