"""k3mk.runtime.profile on synthetic records (no GPU): the timeline, the summary, the hand-off latencies
and the Chrome trace, against values computed by hand (the comments show the arithmetic)."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch

from k3mk.ir.task_table import AddParams, Event, NopParams, OpVariant, Task, TaskTable
from k3mk.runtime import abi, table
from k3mk.runtime.manifest import Manifest
from k3mk.runtime.megakernel import Megakernel
from k3mk.runtime.profile import PRODUCER_TRACK, TASK_BYTES_FILE, Timeline, chrome_trace, format_summary, percentile, summarize

sys.path.insert(0, str(Path(__file__).parent))
from megakernel_cases import all_cases  # noqa: E402

STEP = 5
# Two CTAs. Global task index = list offset + position: A=0, B=1 (CTA 0), C=2, D=3 (CTA 1).
#   A add  signals e0            | C add  waits e0, signals e1
#   B nop  waits e1              | D nop  waits e0 (already signalled when D starts)
# Consumer stamps (ns): start, wait_done, body_end, smid; the producer's: produce_start, produce_end,
# ring_wait (ns), issued_bytes; then, where taken inside a streaming body, staged, first_fill, last_release (else 0)
# and warp 0's ns waiting for its fills (fill_wait)
STAMPS = {
    0: (1000, 1064, 2100, 7, 900, 950, 0, 4096),
    1: (2200, 4000, 4100, 7, 950, 960, 0, 0),
    # its producer waited 600 ns for free ring slots; in its body: prologue 100, first fill 200 later, tail 200; warp 0
    # waited 350 ns in all for its fills
    2: (1100, 2600, 3600, 9, 800, 1500, 600, 2048, 2700, 2900, 3400, 350),
    3: (3700, 3800, 3900, 9, 1500, 1510, 0, 0),
}
TASK_BYTES = {"weight_bytes": [4096, 0, 2048, 0], "other_bytes": [100, 10, 200, 20]}
FIELDS = ("start", "wait_done", "body_end", "smid", "produce_start", "produce_end", "ring_wait", "issued_bytes", "staged", "first_fill",
          "last_release", "fill_wait")  # fmt: skip


def loaded_table() -> table.LoadedTable:
    variants = [OpVariant("add", AddParams()), OpVariant("nop", NopParams())]
    ops = {"count": 8}
    lists = [
        [Task(0, ops, (), 0, "A"), Task(1, {}, (1,), None, "B")],
        [Task(0, ops, (0,), 1, "C"), Task(1, {}, (0,), None, "D")],
    ]
    tt = TaskTable(variants, lists, [Event("a_done"), Event("c_done")], arena_bytes=64)
    return table.read_table(tt.encode())


def records(stamps=STAMPS, step=STEP) -> list[list[int]]:
    """Rows in abi.PROFILE_FIELDS order, as Megakernel.profile_records returns them."""
    out = []
    for i in range(len(stamps)):
        row = {**dict(zip(FIELDS, stamps[i])), "epoch": step}
        out.append([row.get(f, 0) for f in abi.PROFILE_FIELDS])
    return out


@pytest.fixture()
def tl() -> Timeline:
    return Timeline.from_records(loaded_table(), records(), STEP, TASK_BYTES)


def test_task_headers_read_from_the_device_part():
    headers = loaded_table().task_headers()
    assert [(h.index, h.cta, h.position, h.opcode, h.waits, h.signal) for h in headers] == [
        (0, 0, 0, 0, (), 0), (1, 0, 1, 1, (1,), None), (2, 1, 0, 0, (0,), 1), (3, 1, 1, 1, (0,), None)]  # fmt: skip


def test_timeline(tl):
    assert tl.ops == ["add", "nop", "add", "nop"] and tl.labels == ["A", "B", "C", "D"]
    assert tl.event_names == ["a_done", "c_done"] and tl.lists() == {0: [0, 1], 1: [2, 3]}
    assert (tl.t0, tl.t1) == (1000, 4100)
    assert [tl.times[2].interval(i) for i in ("wait", "body")] == [1500, 1000]
    assert (tl.times[2].produce, tl.times[2].ring_wait, tl.times[2].issued_bytes) == (700, 600, 2048)
    assert tl.violations() == []


def test_handoffs(tl):
    got = [(h.event, h.waiter, h.signaller, h.latency, h.blocking) for h in tl.handoffs()]
    assert got == [
        (1, 1, 2, 400, True),  # B waited from 2200; C signalled e1 at 3600; B done at 4000
        (0, 2, 0, 500, True),  # C waited from 1100; A signalled e0 at 2100; C done at 2600
        (0, 3, 0, 1700, False),  # D began waiting at 3700, after A's 2100: D was late, not blocked
    ]


def test_summary(tl):
    s = summarize(tl)
    assert (s["step"], s["tasks"], s["ctas"], s["wall_ns"]) == (STEP, 4, 2, 3100)  # 4100 - 1000
    assert s["timer_step_ns"] == 10  # producers' 950 -> 960 and 1500 -> 1510, the closest distinct stamps
    # wait 64+1800+1500+100, body 1036+100+1000+100, between (2200-2100) + (3700-3600),
    # outside CTA 1: (1100-1000) + (4100-3900)
    assert s["cta_time_ns"] == {"wait": 3464, "body": 2236, "between": 200, "outside": 300}
    assert sum(s["cta_time_ns"].values()) == 2 * 3100  # every CTA's whole window is accounted for
    assert s["cta_time_fraction"]["wait"] == pytest.approx(3464 / 6200)
    assert s["producer_ns"] == {"produce": 50 + 10 + 700 + 10, "ring_wait": 600}
    assert s["producer_fraction"]["ring_wait"] == pytest.approx(600 / 6200)
    assert list(s["by_op"]) == ["add", "nop"]  # by wait + body: 1564 + 2036 > 1900 + 200
    add, nop = s["by_op"]["add"], s["by_op"]["nop"]
    assert (add["count"], add["wait_ns"], add["body_ns"], add["produce_ns"], add["ring_wait_ns"]) == (2, 1564, 2036, 750, 600)
    assert (add["wait_mean_ns"], add["body_mean_ns"], add["produce_mean_ns"]) == (782, 1018, 375)
    assert (add["issued_bytes"], add["weight_bytes"], add["other_bytes"]) == (6144, 6144, 300)
    assert add["body_GBps"] == pytest.approx(6444 / 2036)  # issued + other bytes / ns = GB/s
    assert (nop["wait_ns"], nop["body_ns"], nop["body_GBps"]) == (1900, 200, pytest.approx(30 / 200))
    assert s["by_variant"] == {"add #0": add, "nop #1": nop}  # the fixture's op kinds have one variant each
    assert (s["issued_bytes"], s["weight_bytes"], s["other_bytes"]) == (6144, 6144, 330)
    assert s["step_GBps"] == pytest.approx(6474 / 3100)
    h = s["handoff"]
    assert (h["waits"], h["blocking"], h["median_ns"], h["p90_ns"], h["max_ns"]) == (3, 2, 400, 500, 500)
    assert [(x["event"], x["latency_ns"], x["signaller"], x["waiter"]) for x in h["slowest"]] == [
        ("a_done", 500, "A", "C"), ("c_done", 400, "C", "B")]  # fmt: skip
    c = s["critical_path"]  # A -> C (C waited for e0) -> B (B waited for e1): 64 + 1036 + 500 + 1000 + 400 + 100 ns
    assert (c["tasks"], c["span_ns"], c["handoff_ns"]) == (3, 3100, 64 + 500 + 400)
    assert c["by_op"] == {"add": {"count": 2, "body_ns": 2036, "handoff_ns": 564, "prologue_ns": 100, "first_fill_ns": 200, "tail_ns": 200,
                                  "fill_wait_ns": 350},
                          "nop": {"count": 1, "body_ns": 100, "handoff_ns": 400, "prologue_ns": 0, "first_fill_ns": 0, "tail_ns": 0,
                                  "fill_wait_ns": 0}}  # fmt: skip
    # C's body parts: staged 2700 - wait_done 2600, first fill 2900 - 2700, body_end 3600 - last release 3400; A took none
    assert (add["prologue_tasks"], add["prologue_mean_ns"], add["first_fill_mean_ns"], add["tail_mean_ns"]) == (1, 100, 200, 200)
    assert (add["fill_wait_tasks"], add["fill_wait_mean_ns"], nop["fill_wait_mean_ns"]) == (1, 350, None)
    assert (nop["prologue_tasks"], nop["prologue_mean_ns"], nop["tail_mean_ns"]) == (0, None, None)
    text = format_summary(s)
    assert "critical path (3 tasks, 3.10 us)" in text and "add                   2 tasks  body       2.04 us" in text
    assert "op #variant" in text and "\nadd #0                    2" in text and "\nnop #1                    2" in text
    assert "wall 3.10 us" in text and "median 0.40 us, p90 0.50 us" in text
    assert "0.50 us  a_done: CTA 0 A -> CTA 1 C" in text
    assert "0.10 / 0.20 / 0.20 / 0.35" in text and "(in the bodies: prologue 0.10, first_fill 0.20, tail 0.20, fill_wait 0.35 us)" in text
    assert "blocked on a full ring 9.7%" in text and "wait 55.9%" in text


def test_critical_path_follows_binding_waits_and_lists(tl):
    """A -> C -> B on the fixture (module comment); with B's wait satisfied before B starts, B's list predecessor A
    binds it instead; a task late for its event is reached through its list."""
    assert tl.critical_path() == [0, 2, 1]
    late = {**STAMPS, 1: (3700, 3710, 4100, 7, 950, 960, 0, 0)}  # B starts after C signalled e1 (3600)
    assert Timeline.from_records(loaded_table(), records(late), STEP).critical_path() == [0, 1]
    d_last = {**STAMPS, 3: (3700, 3800, 4200, 9, 1500, 1510, 0, 0)}  # D ends last: D began after A's signal, so C binds it
    assert Timeline.from_records(loaded_table(), records(d_last), STEP).critical_path() == [0, 2, 3]


def test_summary_without_bytes():
    s = summarize(Timeline.from_records(loaded_table(), records(), STEP))
    assert s["weight_bytes"] is None and s["step_GBps"] is None and s["by_op"]["nop"]["body_GBps"] is None
    assert s["by_op"]["add"]["body_GBps"] == pytest.approx(6144 / 2036)  # the bytes its producer issued are known
    assert " - " in format_summary(s)


def test_percentile_is_nearest_rank():
    assert percentile([], 50) is None
    assert percentile([5], 90) == 5
    assert percentile([4, 1, 3, 2], 50) == 2  # ceil(0.5 * 4) = 2nd smallest
    assert percentile(list(range(1, 11)), 90) == 9  # ceil(0.9 * 10) = 9th
    assert percentile(list(range(1, 12)), 90) == 10  # ceil(9.9) = 10th


def perfetto_ns(us: float) -> int:
    """What Perfetto's JSON reader makes of a time in us: int64(us * 1000.0), truncated."""
    return int(us * 1000.0)


def test_chrome_trace(tl):
    trace = json.loads(json.dumps(chrome_trace(tl)))
    events = trace["traceEvents"]
    names = {(e["tid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
    assert names == {(0, "CTA 0 (SM 7)"), (1, "CTA 1 (SM 9)"), (PRODUCER_TRACK, "CTA 0 producer"), (PRODUCER_TRACK + 1, "CTA 1 producer")}
    tasks = [e for e in events if e["ph"] == "X" and e["cat"] == "task"]
    # ns from the first stamp (C's producer at 800): A 200 + 1100, B 1400 + 1900, C 300 + 2500, D 2900 + 200
    assert [(e["name"], e["tid"], perfetto_ns(e["ts"]), perfetto_ns(e["dur"])) for e in tasks] == [
        ("add", 0, 200, 1100), ("nop", 0, 1400, 1900), ("add", 1, 300, 2500), ("nop", 1, 2900, 200)]  # fmt: skip
    assert tasks[2]["args"]["label"] == "C" and tasks[2]["args"]["waits"] == ["a_done"] and tasks[2]["args"]["signal"] == "c_done"
    assert tasks[2]["args"]["weight_bytes"] == 2048 and tasks[2]["args"]["wait_ns"] == 1500
    parts = [(e["name"], perfetto_ns(e["ts"]), perfetto_ns(e["dur"])) for e in events if e.get("cat") == "interval" and e["tid"] == 1]
    # C: 1100 / 2600 / 3600; D: 3700 / 3800 / 3900
    assert parts == [("wait", 300, 1500), ("body", 1800, 1000), ("wait", 2900, 100), ("body", 3000, 100)]
    produced = [(e["tid"] - PRODUCER_TRACK, perfetto_ns(e["ts"]), perfetto_ns(e["dur"]), e["args"]["ring_wait_ns"])
                for e in events if e.get("cat") == "produce"]  # fmt: skip
    assert produced == [(0, 100, 50, 0), (0, 150, 10, 0), (1, 0, 700, 600), (1, 700, 10, 0)]
    flows = [(e["ph"], e["id"], e["tid"], perfetto_ns(e["ts"])) for e in events if e.get("cat") == "handoff"]
    # the two blocking hand-offs: C -> B (e1: 3600 -> 4000), A -> C (e0: 2100 -> 2600); arrows leave 1 ns early;
    # ids (step << 32) + n, unique across the steps of a trace file
    assert flows == [("s", "0x500000000", 1, 2799), ("f", "0x500000000", 0, 3200),
                     ("s", "0x500000001", 0, 1299), ("f", "0x500000001", 1, 1800)]  # fmt: skip
    assert trace["otherData"]["wall_ns"] == 3100


def test_trace_times_survive_truncating_importers():
    """Perfetto truncates us * 1000 to ns: the emitted times come back exact (ns up to 100 s)."""
    from k3mk.runtime import profile

    stamps = {i: (0, 0, ns, 0, 0, 0, 0, 0) for i, ns in enumerate((1, 999, 1234, 123_456_789, 99_999_999_999))}
    loaded = table.read_table(TaskTable([OpVariant("nop", NopParams())], [[Task(0)] * 5], []).encode())
    events = profile.chrome_trace(Timeline.from_records(loaded, records(stamps), STEP))["traceEvents"]
    durs = [perfetto_ns(e["dur"]) for e in events if e.get("cat") == "task"]
    assert durs == [1, 999, 1234, 123_456_789, 99_999_999_999]


def test_violations_and_bad_records():
    bad = dict(STAMPS)
    bad[1] = (2200, 3500, 4100, 7, 950, 960, 20, 0)  # B done waiting at 3500, before C signalled e1 at 3600; a 20 ns ring wait in 10
    bad[3] = (3700, 3800, 3790, 9, 1400, 1510, 0, 0)  # D's body ends before its wait; its producer began before C's ended
    problems = Timeline.from_records(loaded_table(), records(bad), STEP).violations()
    assert len(problems) == 4, problems
    assert "task 1 (B): producer record 950..960, ring wait 20 ns" in problems[0]
    assert "task 3 (D): stamps out of order" in problems[1]
    assert "task 3 (D): its producer began before task 2's was done" in problems[2]
    assert "task 1 (B) finished waiting on event 1 before task 2 signalled it" in problems[3]
    late = {**STAMPS, 2: STAMPS[2][:8] + (2700, 2900, 3650)}  # C's last release after its body_end
    assert Timeline.from_records(loaded_table(), records(late), STEP).violations() == [
        "task 2 (C): stamps out of order {'start': 1100, 'wait_done': 2600, 'staged': 2700, 'first_fill': 2900, 'last_release': 3650, 'body_end': 3600}"]  # fmt: skip
    with pytest.raises(ValueError, match="has a record of step 4, not 5"):
        Timeline.from_records(loaded_table(), records(step=4), STEP)
    with pytest.raises(ValueError, match="3 tasks, the table has 4"):
        Timeline.from_records(loaded_table(), records(), STEP, {"weight_bytes": [0, 0, 0], "other_bytes": [0, 0, 0]})


def simulated_records(loaded: table.LoadedTable, step: int, handoff_ns: int = 300) -> list[list[int]]:
    """Stamps of a run that obeys the execution model: each CTA's producer runs its list ahead, its
    consumers run it in order; a task is done waiting `handoff_ns` after the last signal of its events
    (or at once when they came earlier)."""
    headers = loaded.task_headers()
    by_cta: dict[int, list] = {}
    for h in headers:
        by_cta.setdefault(h.cta, []).append(h)
    signallers: dict[int, list[int]] = {}
    for h in headers:
        if h.signal is not None:
            signallers.setdefault(h.signal, []).append(h.index)
    stamps: dict[int, tuple] = {}
    clock = {cta: 1000 * cta for cta in by_cta}  # CTAs start at different times
    producer = {cta: 1000 * cta - 500 for cta in by_cta}
    pending = {cta: list(tasks) for cta, tasks in by_cta.items()}
    while any(pending.values()):
        for cta, tasks in pending.items():
            ready = tasks and all(s in stamps for e in tasks[0].waits for s in signallers[e])
            if not ready:
                continue
            h = tasks.pop(0)
            start = clock[cta]
            last = max((stamps[s][2] for e in h.waits for s in signallers[e]), default=0)
            wait_done = max(start + 40, last + handoff_ns)
            body_end = wait_done + 500 + 100 * h.opcode
            produce_start = producer[cta]
            producer[cta] = produce_start + 30
            stamps[h.index] = (start, wait_done, body_end, 100 + cta, produce_start, produce_start + 30, 5, 64)
            clock[cta] = body_end + 20
    return records(stamps, step)


def test_timeline_of_a_simulated_run():
    """The diamond case (8 CTAs, joins of 2 events): a run that obeys the model has no violations, the
    accounting closes, and every blocking hand-off measures the simulated 300 ns."""
    loaded = table.read_table(all_cases()["diamond"].builder.table().encode())
    tl = Timeline.from_records(loaded, simulated_records(loaded, 1), 1)
    assert tl.violations() == []
    s = summarize(tl)
    assert sum(s["cta_time_ns"].values()) == s["ctas"] * s["wall_ns"]
    assert s["handoff"]["blocking"] > 0 and s["handoff"]["median_ns"] == s["handoff"]["max_ns"] == 300
    assert all(h.latency == 300 for h in tl.handoffs() if h.blocking)
    assert all(h.latency >= 300 for h in tl.handoffs())  # a late waiter's "latency" includes its lateness


def test_megakernel_profile_records_ring():
    """Megakernel.profile_records without a GPU: step e lives in slot (e - 1) % PROFILE_RING_STEPS; only the
    last PROFILE_RING_STEPS completed steps are readable; a task without this step's record is an error."""
    mk = object.__new__(Megakernel)
    ring = torch.zeros(abi.PROFILE_RING_STEPS, 3, abi.PROFILE_WORDS, dtype=torch.int64)
    epoch, start = abi.PROFILE_FIELDS.index("epoch"), abi.PROFILE_FIELDS.index("start")
    for e in range(3, 7):  # steps 3..6 ran
        ring[(e - 1) % abi.PROFILE_RING_STEPS, :, epoch] = e
        ring[(e - 1) % abi.PROFILE_RING_STEPS, :, start] = 100 * e
    mk._profile_ring, mk.control = ring, torch.zeros(abi.CONTROL_WORDS, dtype=torch.int64)
    mk.control[abi.C_EPOCH] = 6
    assert mk.profile_records()[:, start].tolist() == [600] * 3
    assert mk.profile_records(3)[:, start].tolist() == [300] * 3
    for step in (0, 2, 7):
        with pytest.raises(ValueError, match=f"step {step} is not among the last 4 completed steps"):
            mk.profile_records(step)
    ring[(6 - 1) % abi.PROFILE_RING_STEPS, 1, epoch] = 2  # task 1 did not finish step 6 (a watchdog abort)
    with pytest.raises(RuntimeError, match="1 tasks did not finish in step 6 \\(e.g. global task 1\\)"):
        mk.profile_records()
    mk._profile_ring = None
    with pytest.raises(RuntimeError, match="not a profile build"):
        mk.profile_records()


def test_timeline_of_reads_the_ring_and_task_bytes(tmp_path):
    mk = object.__new__(Megakernel)
    mk.table = loaded_table()
    mk._profile_ring = torch.zeros(abi.PROFILE_RING_STEPS, 4, abi.PROFILE_WORDS, dtype=torch.int64)
    mk._profile_ring[(STEP - 1) % abi.PROFILE_RING_STEPS] = torch.tensor(records())
    mk.control = torch.zeros(abi.CONTROL_WORDS, dtype=torch.int64)
    mk.control[abi.C_EPOCH] = STEP
    (tmp_path / TASK_BYTES_FILE).write_text(json.dumps(TASK_BYTES))
    digest = hashlib.sha256((tmp_path / TASK_BYTES_FILE).read_bytes()).hexdigest()  # every file is read against its hash
    mk.manifest = Manifest(tmp_path, {"files": {TASK_BYTES_FILE: TASK_BYTES_FILE}, "files_sha256": {TASK_BYTES_FILE: digest}})
    assert Timeline.of(mk) == Timeline.from_records(loaded_table(), records(), STEP, TASK_BYTES)
