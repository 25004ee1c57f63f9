"""The runtime's own reader of a task table file (docs/task_table.md): the device part to upload,
the two word offsets the kernel needs, and the JSON metadata (labels and event names for watchdog
reports). Duplicates a few constants of k3mk.ir.task_table on purpose: the runtime imports no
compiler package (tests/runtime/test_runtime_cpu.py checks that the two agree).

The reader checks the table's structure before anything is uploaded (`check_structure`): a table the
kernel would walk out of bounds with (an offset past the device part, an unknown opcode, an event
out of range or an expected count that is not its event's count) is an error, even when its hash matches.
"""

from __future__ import annotations

import json
import struct
import sys
from array import array
from dataclasses import dataclass

FORMAT_VERSION = 3
MAGIC = 0x5454334B
HEADER_WORDS = 16
TASK_WORDS = 32
H_MAGIC, H_VERSION, H_HEADER_WORDS, H_TASK_WORDS, H_NUM_LISTS, H_NUM_TASKS, H_NUM_EVENTS, H_NUM_VARIANTS = range(8)
H_LISTS_OFFSET, H_TASKS_OFFSET, H_EVENTS_OFFSET, H_DEVICE_WORDS, H_META_BYTES = 8, 9, 10, 11, 12
W_OPCODE, W_WAIT0, W_COUNT0, W_WAIT1, W_COUNT1, W_SIGNAL, W_WEIGHT_WAIT, W_WEIGHT_COUNT = range(8)  # an absent event is NO_EVENT
NO_EVENT = -1


class TaskTableFormatError(ValueError):
    pass


@dataclass(frozen=True)
class TaskHeader:
    """What the runtime needs of one task (profiles): where it runs, its op and its events."""

    index: int  # global task index: list offset + position
    cta: int
    position: int  # in its list
    opcode: int
    waits: tuple[int, ...]
    signal: int | None


@dataclass(frozen=True)
class LoadedTable:
    device_bytes: bytes
    lists_offset: int  # words
    tasks_offset: int  # words
    num_lists: int
    num_tasks: int
    num_events: int
    num_variants: int
    meta: dict

    def label(self, cta: int, task: int) -> str:
        try:
            return self.meta["labels"][cta][task]
        except (KeyError, IndexError):
            return "?"

    def event_name(self, event: int) -> str:
        names = self.meta.get("events", [])
        return names[event] if 0 <= event < len(names) else "?"

    def task_headers(self) -> list[TaskHeader]:
        """Every task in global index order (list after list), read from the device part."""
        words = struct.unpack_from(f"<{len(self.device_bytes) // 4}i", self.device_bytes)
        offsets = words[self.lists_offset : self.lists_offset + self.num_lists + 1]
        headers = []
        for cta in range(self.num_lists):
            for index in range(offsets[cta], offsets[cta + 1]):
                base = self.tasks_offset + index * TASK_WORDS
                w = words[base : base + W_SIGNAL + 1]
                waits = tuple(e for e in (w[W_WAIT0], w[W_WAIT1]) if e != NO_EVENT)
                signal = None if w[W_SIGNAL] == NO_EVENT else w[W_SIGNAL]
                headers.append(TaskHeader(index, cta, index - offsets[cta], w[W_OPCODE], waits, signal))
        return headers


def read_table(data: bytes) -> LoadedTable:
    if len(data) < HEADER_WORDS * 4:
        raise TaskTableFormatError("task table file too short")
    h = struct.unpack_from(f"<{HEADER_WORDS}i", data)
    if h[H_MAGIC] != MAGIC:
        raise TaskTableFormatError(f"bad magic {h[H_MAGIC]:#x}: not a k3mk task table")
    if h[H_VERSION] != FORMAT_VERSION:
        raise TaskTableFormatError(f"task table format {h[H_VERSION]}; this runtime reads format {FORMAT_VERSION}")
    end = h[H_DEVICE_WORDS] * 4
    if h[H_DEVICE_WORDS] < HEADER_WORDS or h[H_META_BYTES] < 0 or len(data) != end + h[H_META_BYTES]:
        raise TaskTableFormatError("task table length disagrees with its header")
    check_structure(h, data[:end])
    try:
        meta = json.loads(data[end:].decode())
    except (UnicodeDecodeError, ValueError) as e:
        raise TaskTableFormatError(f"task table metadata is not JSON ({e})") from None
    return LoadedTable(
        device_bytes=data[:end],
        lists_offset=h[H_LISTS_OFFSET],
        tasks_offset=h[H_TASKS_OFFSET],
        num_lists=h[H_NUM_LISTS],
        num_tasks=h[H_NUM_TASKS],
        num_events=h[H_NUM_EVENTS],
        num_variants=h[H_NUM_VARIANTS],
        meta=meta if isinstance(meta, dict) else {},
    )


def check_structure(h: tuple[int, ...], device: bytes) -> None:
    """Everything the kernel indexes with stays inside the device part: the regions in order and in
    bounds, the CSR list offsets, and per task a known opcode, events in range, each wait's expected
    count equal to its event's count (the kernel compares counters with it) and zero reserved words."""
    words = array("i", device)  # compact: a full-size table has millions of words
    if sys.byteorder == "big":
        words.byteswap()  # the file is little-endian
    if (h[H_HEADER_WORDS], h[H_TASK_WORDS]) != (HEADER_WORDS, TASK_WORDS):
        raise TaskTableFormatError(f"header / task words {h[H_HEADER_WORDS]} / {h[H_TASK_WORDS]}, expected {HEADER_WORDS} / {TASK_WORDS}")
    lists, tasks, events, size = h[H_LISTS_OFFSET], h[H_TASKS_OFFSET], h[H_EVENTS_OFFSET], len(words)
    n_lists, n_tasks, n_events, n_variants = h[H_NUM_LISTS], h[H_NUM_TASKS], h[H_NUM_EVENTS], h[H_NUM_VARIANTS]
    if min(n_lists, n_tasks, n_events, n_variants) < 0 or n_lists < 1 or n_variants < 1:
        raise TaskTableFormatError(f"header counts (lists {n_lists}, tasks {n_tasks}, events {n_events}, variants {n_variants}) out of range")
    regions = [("list offsets", lists, lists + n_lists + 1), ("tasks", tasks, tasks + n_tasks * TASK_WORDS), ("event counts", events, events + n_events)]
    previous = HEADER_WORDS
    for name, begin, stop in regions:
        if begin < previous or stop > size:
            raise TaskTableFormatError(f"the {name} (words {begin}..{stop}) overlap another region or lie outside the device part ({size} words)")
        previous = stop
    if tasks % TASK_WORDS:
        raise TaskTableFormatError(f"tasks_offset {tasks} is not {TASK_WORDS * 4}-byte aligned")
    offsets = words[lists : lists + n_lists + 1]
    if offsets[0] != 0 or offsets[-1] != n_tasks or any(a > b for a, b in zip(offsets, offsets[1:])):
        raise TaskTableFormatError(f"list offsets must rise from 0 to num_tasks {n_tasks}")
    counts = words[events : events + n_events]
    signals = [0] * n_events
    for i in range(n_tasks):
        w = words[tasks + i * TASK_WORDS : tasks + i * TASK_WORDS + W_WEIGHT_COUNT + 1]
        if not 0 <= w[W_OPCODE] < n_variants:
            raise TaskTableFormatError(f"{_where(offsets, i)}: opcode {w[W_OPCODE]} is not one of the {n_variants} variants")
        waits = (("wait 0", w[W_WAIT0], w[W_COUNT0]), ("wait 1", w[W_WAIT1], w[W_COUNT1]), ("the weight wait", w[W_WEIGHT_WAIT], w[W_WEIGHT_COUNT]))
        for slot, event, count in waits:
            if event == NO_EVENT and count == 0:
                continue
            if not 0 <= event < n_events or count != counts[event] or count < 1:
                raise TaskTableFormatError(f"{_where(offsets, i)}: {slot} on event {event} expecting {count} per step "
                                           f"(events 0..{n_events - 1}; the count must be the event's, {counts[event] if 0 <= event < n_events else '-'})")  # fmt: skip
        if w[W_SIGNAL] != NO_EVENT:
            if not 0 <= w[W_SIGNAL] < n_events:
                raise TaskTableFormatError(f"{_where(offsets, i)}: signals event {w[W_SIGNAL]}, outside 0..{n_events - 1}")
            signals[w[W_SIGNAL]] += 1
    if signals != list(counts):
        event = next(v for v in range(n_events) if signals[v] != counts[v])
        raise TaskTableFormatError(f"event {event}: its count says {counts[event]} signals per step, the tasks make {signals[event]}")


def _where(offsets, task: int) -> str:
    """A bad task's name for the error (only then: finding its list scans the offsets)."""
    cta = next(s for s in range(len(offsets) - 1) if offsets[s] <= task < offsets[s + 1])
    return f"task {task} (list {cta})"
