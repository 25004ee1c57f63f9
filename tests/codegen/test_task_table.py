"""The task table format (k3mk/ir/task_table.py, docs/task_table.md): encode / decode round trips,
the byte layout the kernel reads, and validation of every invariant."""

from __future__ import annotations

import struct
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from k3mk.ir import task_table as tt
from k3mk.ir.task_table import (
    BufferSpec,
    Event,
    GemvParams,
    KdaRecurrenceParams,
    NopParams,
    OpVariant,
    RmsnormParams,
    Task,
    TaskTable,
    TaskTableError,
    WeightSpec,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from megakernel_cases import all_cases  # noqa: E402


def small() -> TaskTable:
    gemv = OpVariant("gemv", GemvParams(64, 48, 2, rmsnorm=True))
    return TaskTable(
        variants=[OpVariant("nop", NopParams()), gemv],
        lists=[
            [Task(1, {"x": 0, "out": 256, "weight": 0, "norm_weight": 1, "row_begin": 0, "row_count": 24, "batch_stride": 48}, signal=0, label="a0")],
            [Task(1, {"x": 0, "out": 256, "weight": 0, "norm_weight": 1, "row_begin": 24, "row_count": 24, "batch_stride": 48}, signal=0, label="a1"),
             Task(0, wait=(0,), label="join")],
        ],
        events=[Event("gemv")],
        weights=[WeightSpec("w", "bfloat16", (48, 64)), WeightSpec("g", "bfloat16", (64,))],
        buffers=[BufferSpec("x", 0, "bfloat16", (2, 64)), BufferSpec("y", 256, "bfloat16", (2, 48))],
        arena_bytes=512,
    )  # fmt: skip


@pytest.mark.parametrize("name", sorted(all_cases()))
def test_round_trip(name):
    case = all_cases()[name]
    table = case.builder.table()
    data = table.encode(check=case.check)
    back = TaskTable.decode(data)
    assert back == table
    assert back.encode(check=case.check) == data


def test_byte_layout():
    table = small()
    data = table.encode()
    h = tt.read_header(data)
    assert (h["magic"], h["version"], h["task_words"]) == (tt.MAGIC, tt.FORMAT_VERSION, 32)
    assert (h["num_lists"], h["num_tasks"], h["num_events"], h["num_variants"]) == (2, 3, 1, 2)
    assert h["tasks_offset"] % 32 == 0 and h["device_words"] % 32 == 0
    words = struct.unpack_from(f"<{h['device_words']}i", data)
    assert words[h["lists_offset"] : h["lists_offset"] + 3] == (0, 1, 3)
    join = words[h["tasks_offset"] + 2 * 32 : h["tasks_offset"] + 3 * 32]
    assert join[tt.W_OPCODE] == 0 and join[tt.W_WAIT0] == 0 and join[tt.W_COUNT0] == 2  # two signallers
    assert join[tt.W_WAIT1] == tt.NO_EVENT and join[tt.W_SIGNAL] == tt.NO_EVENT
    a1 = words[h["tasks_offset"] + 32 : h["tasks_offset"] + 64]
    names = tt.OP_KINDS["gemv"].operands
    assert a1[8 + names.index("row_begin")] == 24 and a1[8 + names.index("norm_weight")] == 1
    assert words[h["events_offset"]] == 2
    device, lists_offset, tasks_offset = tt.device_part(data)
    assert len(device) == h["device_words"] * 4 and (lists_offset, tasks_offset) == (16, h["tasks_offset"])


def test_decode_rejects_foreign_data():
    data = bytearray(small().encode())
    with pytest.raises(TaskTableError, match="magic"):
        TaskTable.decode(b"\0" * 64 + bytes(data[64:]))
    data[4] = 99
    with pytest.raises(TaskTableError, match="format 99"):
        TaskTable.decode(bytes(data))


def _with_task(table: TaskTable, cta: int, index: int, **changes) -> TaskTable:
    lists = [list(l) for l in table.lists]
    lists[cta][index] = replace(lists[cta][index], **changes)
    return replace(table, lists=lists)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(opcode=5), "opcode 5 out of range"),
        (dict(operands={"x": 0, "bogus": 1}), "bogus"),
        (dict(operands={"x": 8, "weight": 0}), "not 16-aligned"),
        (dict(operands={"x": 4096}), "out of range"),
        (dict(operands={"weight": 7}), "weight id weight=7"),
        (dict(wait=(3,)), "event 3 out of range"),
        (dict(wait=(0, 0, 0)), "at most 2 waits"),
        (dict(operands={"row_begin": 2**31}), "not an int32"),
    ],
)
def test_validate_rejects(change, message):
    table = _with_task(small(), 0, 0, **change)
    with pytest.raises(TaskTableError, match=message):
        table.validate()


def test_validate_rejects_recurrence_rows_past_its_variant():
    """kda_recurrence's template unrolls value_rows rows per task (0: head_dim): a task holding more is refused, one
    holding fewer re-reads its last row."""
    rec = {"q": 0, "k": 0, "v": 0, "g": 0, "beta": 0, "out": 256, "state": 0, "head": 0, "value_begin": 0}
    table = replace(small(), variants=[OpVariant("nop", NopParams()), OpVariant("kda_recurrence", KdaRecurrenceParams(2, 64, 1, value_rows=24))])
    for count, ok in ((24, True), (16, True), (32, False)):
        t = _with_task(table, 0, 0, opcode=1, operands={**rec, "value_count": count})
        t = _with_task(t, 1, 0, opcode=1, operands={**rec, "value_begin": 32, "value_count": 16})
        if ok:
            t.validate()
        else:
            with pytest.raises(TaskTableError, match="value_count 32 above its variant's value_rows 24"):
                t.validate()


def test_validate_rejects_a_batched_gemv_without_its_batch_stride():
    """From batch 2 a gemv writes request b's rows at b * batch_stride: a task without it (or with another stride)
    would write every request onto the first one's rows, so the table is refused."""
    small().validate()  # 48, its out_features
    for stride in (0, 24):
        operands = {**small().lists[0][0].operands, "batch_stride": stride}
        with pytest.raises(TaskTableError, match=f"batch_stride {stride} != out_features 48"):
            _with_task(small(), 0, 0, operands=operands).validate()


def test_validate_rejects_wait_without_signaller():
    table = _with_task(small(), 1, 1, wait=(1,))
    table = replace(table, events=[Event("gemv"), Event("nobody")])
    with pytest.raises(TaskTableError, match="no task signals"):
        table.validate()


def test_router_tiles_count_their_arrivals():
    """The tiles of a router GEMV say how many of them complete a step on their `arrivals` event; that event is
    theirs alone (no signaller adds to it, no task waits on it)."""
    table = all_cases()["router_tiled_b4"].builder.table()
    table.validate()
    tiles = [(s, i) for s, ts in enumerate(table.lists) for i, t in enumerate(ts) if table.is_router_tile(t)]
    arrivals = table.lists[tiles[0][0]][tiles[0][1]].operands["arrivals"]
    assert len(tiles) == 7 and table.event_counts()[arrivals] == 0 and table.counter_steps()[arrivals] == 7

    def changed(s, i, **operands):
        lists = [list(ts) for ts in table.lists]
        t = lists[s][i]
        lists[s][i] = replace(t, operands={**t.operands, **operands})
        return replace(table, lists=lists)

    with pytest.raises(TaskTableError, match="a router tile of 6 tiles, and 7 tiles"):
        changed(*tiles[0], tiles=6).validate()
    signal = table.lists[tiles[0][0]][tiles[0][1]].signal
    with pytest.raises(TaskTableError, match="which a task signals or waits on"):
        changed(*tiles[0], arrivals=signal).validate()


def test_validate_finds_deadlock():
    table = all_cases()["hang"].builder.table()
    with pytest.raises(TaskTableError, match="deadlock: 3 CTAs stuck"):
        table.validate()
    table.encode(check=False)  # planted-fault tests can still encode it


def test_wait_before_own_signal_on_same_cta_is_a_deadlock():
    # CTA 0 waits for both gemv tiles, but its own tile comes after the wait.
    t = small()
    lists = [[t.lists[1][1], t.lists[0][0]], [t.lists[1][0]]]
    with pytest.raises(TaskTableError, match="deadlock"):
        replace(t, lists=lists).validate()


def test_variant_params_are_typed():
    with pytest.raises(TaskTableError, match="needs GemvParams"):
        OpVariant("gemv", RmsnormParams(64, 1))
    with pytest.raises(TaskTableError, match="unknown op kind"):
        OpVariant("conv3d", NopParams())
    with pytest.raises(TaskTableError, match="unknown params"):
        OpVariant.from_json({"op": "nop", "params": {"eps": 1.0}})


def test_buffer_outside_arena():
    t = replace(small(), buffers=[BufferSpec("y", 480, "bfloat16", (2, 48))])
    with pytest.raises(TaskTableError, match="outside arena"):
        t.validate()
