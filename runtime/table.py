"""The runtime's own reader of a task table file (docs/task_table.md): the device part to upload,
the two word offsets the kernel needs, and the JSON metadata (labels and event names for watchdog
reports). Duplicates a few constants of k3mk.ir.task_table on purpose: the runtime imports no
compiler package (tests/runtime/test_import_isolation.py checks that the two agree)."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

FORMAT_VERSION = 2
MAGIC = 0x5454334B
HEADER_WORDS = 16
TASK_WORDS = 32
H_MAGIC, H_VERSION, H_NUM_LISTS, H_NUM_TASKS, H_NUM_EVENTS = 0, 1, 4, 5, 6
H_LISTS_OFFSET, H_TASKS_OFFSET, H_DEVICE_WORDS, H_META_BYTES = 8, 9, 11, 12
W_OPCODE, W_WAIT0, W_WAIT1, W_SIGNAL = 0, 1, 3, 5  # task words; an absent event is NO_EVENT
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
    if len(data) != end + h[H_META_BYTES]:
        raise TaskTableFormatError("task table length disagrees with its header")
    return LoadedTable(
        device_bytes=data[:end],
        lists_offset=h[H_LISTS_OFFSET],
        tasks_offset=h[H_TASKS_OFFSET],
        num_lists=h[H_NUM_LISTS],
        num_tasks=h[H_NUM_TASKS],
        num_events=h[H_NUM_EVENTS],
        meta=json.loads(data[end:].decode()),
    )
