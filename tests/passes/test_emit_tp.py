"""Tensor parallelism in the task table (docs/task_table.md "Tensor parallelism"): k3-tiny at TP2, TP4
and (widened to 8 heads) TP8, and kimi-linear-tiny at TP2, lower to the collective op kinds and
validate; the decoded table, executed on the CPU on every rank at once from its operand words
(ir/table_exec.RankGroup: pushes into every rank's comm region, counted, reduced from the rank's own
slots), is bit for bit the sharded graph run on simulated ranks (ir/ranks.run), states included, over 2
steps; the table's own synchronisation runs in the task simulator; bad tables and graphs are refused
with errors that name the problem."""

from __future__ import annotations

import dataclasses
import random
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from k3mk.compiler.capture import capture
from k3mk.compiler.random_weights import random_weights
from k3mk.ir import ranks
from k3mk.ir.collectives import TP_RANK, AllReduce
from k3mk.ir.graph import Graph, Node, Role, Tensor
from k3mk.ir.simulate import Simulator, from_table, sm_order
from k3mk.ir.table_exec import RankGroup
from k3mk.ir.task_table import TaskTable, TaskTableError
from k3mk.passes.emit_task_table import EmitError, emit_task_table
from k3mk.passes.manager import PIPELINE, Target, run_pipeline, until

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from test_model_gpu import config_of  # noqa: E402

BF16 = torch.bfloat16
MAX_CONTEXT = 64
TP_OPS = {"all_reduce", "all_gather", "shard_slice", "argmax_partial", "argmax_combine"}


def k3_tiny_8_heads():
    """k3-tiny with 8 KDA and 8 MLA heads: its own 4 heads do not split 8 ways."""
    c = config_of("k3-tiny")
    return c.replace(kda=dataclasses.replace(c.kda, num_heads=8), mla=dataclasses.replace(c.mla, num_heads=8))


def emitted(name: str, batch: int, tp: int = 2):
    config = k3_tiny_8_heads() if name == "k3-tiny-8-heads" else config_of(name)
    graph = capture(config, batch, MAX_CONTEXT, BF16)
    target = Target.for_arch(config, tp=tp, max_tokens=batch, max_context=MAX_CONTEXT, dtype=BF16)
    return config, graph, run_pipeline(graph, target, PIPELINE).output


def ops_of(table: TaskTable) -> Counter:
    return Counter(table.variants[t.opcode].op for ts in table.lists for t in ts)


@pytest.mark.parametrize("name,batch,tp", [("k3-tiny", 1, 2), ("k3-tiny", 4, 2), ("kimi-linear-tiny", 4, 2), ("k3-tiny", 1, 4),
                                           ("k3-tiny-8-heads", 1, 8)])  # fmt: skip
def test_tp_table_executes_on_every_rank_like_the_sharded_graph(name, batch, tp):
    config, captured, out = emitted(name, batch, tp)
    table = TaskTable.decode(out.data)  # what every rank's GPU loads
    assert table == out.table
    table.validate()
    ops = ops_of(table)
    collectives = ops["all_reduce"] + ops["all_gather"]
    assert {"all_reduce", "all_gather", "argmax_partial", "argmax_combine"} <= set(ops)
    assert "shard_slice" in ops or name == "kimi-linear-tiny"  # K3's latent MoE slices the normed latent
    assert table.comm.ranks == tp and table.comm.events == collectives
    assert table.comm_pointer == len(table.weights) + len(table.states) and table.num_pointers == table.comm_pointer + tp
    assert table.buffer(TP_RANK).role == "input" and table.buffer(TP_RANK).dtype == "int32"

    graph = out.task_graph.graph
    weights = random_weights(config, 0, BF16)
    gen = torch.Generator().manual_seed(batch)
    state = {t.name: (0.5 * torch.randn(t.shape, generator=gen)).to(t.dtype) for t in captured.by_role(Role.STATE)}
    pieces = [ranks.rank_inputs(graph, {**weights, **state, "token_ids": torch.zeros(batch), "positions": torch.zeros(batch)}, r)
              for r in range(tp)]  # fmt: skip
    group = RankGroup(table, [{w.name: p[w.name] for w in table.weights} for p in pieces],
                      [{s.name: p[s.name].clone() for s in table.states} for p in pieces])  # fmt: skip
    tokens = torch.randint(0, config.vocab_size, (batch,), generator=gen)
    positions = torch.randint(0, MAX_CONTEXT - 2, (batch,), generator=gen)
    for step in range(2):
        inputs = {"token_ids": tokens, "positions": positions + step}
        expected = ranks.run(graph, {**weights, **inputs, **state})  # the sharded graph, reference semantics
        group.step(inputs)
        logits = graph.tensors["logits"].shard.assemble([ex.buffer("logits") for ex in group.ranks])
        assert torch.equal(logits, expected["logits"])
        for ex in group.ranks:
            assert torch.equal(ex.buffer("next_tokens"), expected["next_tokens"])
        for name_, st in state.items():
            spec = graph.tensors[name_].shard
            got = [ex.pointers[table.state_id(name_)] for ex in group.ranks]
            assert torch.equal(spec.assemble(got) if spec else got[0], expected[name_]), name_
            if spec is None:
                assert all(torch.equal(g, got[0]) for g in got), name_  # replicated state stays bitwise equal on every rank
            state[name_] = expected[name_]
        tokens = expected["next_tokens"].long()
    events = group.ranks[0].comm[: table.comm.events * 8].view(torch.int64)
    assert events.tolist() == [tp * 2] * table.comm.events  # every rank pushed every collective task once per step


def test_tp2_table_synchronisation_runs_in_the_simulator():
    """The decoded TP2 table's lists, waits and signals drive the task simulator on two simulated ranks
    (collectives on both at once): every read ordered after its writer, results equal to ranks.run."""
    config, captured, out = emitted("k3-tiny", 1)
    replay = from_table(out.task_graph, TaskTable.decode(out.data))
    weights = random_weights(config, 0, BF16)
    values = {"token_ids": torch.tensor([5]), "positions": torch.tensor([9])}
    values.update({t.name: torch.zeros(t.shape, dtype=t.dtype) for t in captured.by_role(Role.STATE)})
    expected = ranks.run(out.task_graph.graph, {**weights, **values})
    sim = Simulator(replay, weights)
    rng = random.Random(0)
    for _ in range(3):
        got = sim.run(values, sm_order(replay, rng)).values
        assert torch.equal(got["next_tokens"], expected["next_tokens"]) and torch.equal(got["logits"], expected["logits"])


# --------------------------------------------------------------------------------------------
# bad tables and graphs


@pytest.fixture(scope="module")
def tp_table() -> TaskTable:
    return emitted("k3-tiny", 1)[2].table


def _collective_tasks(table: TaskTable) -> list[tuple[int, int]]:
    return [(s, i) for s, ts in enumerate(table.lists) for i, t in enumerate(ts) if table.variants[t.opcode].op in ("all_reduce", "all_gather")]


def _with_operands(table: TaskTable, where: tuple[int, int], **changes) -> TaskTable:
    s, i = where
    lists = [list(ts) for ts in table.lists]
    task = lists[s][i]
    lists[s][i] = dataclasses.replace(task, operands={**task.operands, **changes})
    return dataclasses.replace(table, lists=lists)


def _as_nop(table: TaskTable, where: tuple[int, int]) -> TaskTable:
    s, i = where
    lists = [list(ts) for ts in table.lists]
    nop = next(k for k, v in enumerate(table.variants) if v.op == "nop")
    lists[s][i] = dataclasses.replace(lists[s][i], opcode=nop, operands={})
    return dataclasses.replace(table, lists=lists)


def test_validate_refuses_broken_collectives(tp_table):
    first, second = _collective_tasks(tp_table)[:2]
    event = tp_table.lists[first[0]][first[1]].operands.get("comm_event", 0)
    c = tp_table.comm
    cases = [
        (dataclasses.replace(tp_table, comm=None), "without a comm region"),
        (_with_operands(tp_table, second, comm_event=event), "also pushed by"),
        (_with_operands(tp_table, first, comm_offset=c.slots_offset + c.half), r"slots \[\d+, \d+\) not 16-byte aligned inside parity 0"),
        (_with_operands(tp_table, first, comm_half=c.half + 16), "the table's comm region"),
        (_with_operands(tp_table, first, col_begin=4), "not multiples of 8"),
        (_as_nop(tp_table, first), f"declares {c.events} counters, {c.events - 1} collective tasks push them"),
    ]
    for table, message in cases:
        with pytest.raises(TaskTableError, match=message):
            table.validate()


def test_emit_names_a_collective_it_cannot_lower():
    """A hand-made TP2 graph whose all_reduce operand is [batch, slots, n] (tp_shard makes [rows, cols] ones)."""
    g = Graph(meta={"max_context": 1, "tp": 2})
    g.add_tensor(Tensor("x", (2, 3, 64), BF16, Role.INPUT))
    g.add_tensor(Tensor(TP_RANK, (1,), torch.int32, Role.INPUT))
    g.add_tensor(Tensor("y", (2, 3, 64), BF16, Role.OUTPUT))
    g.add_node(Node("reduce", AllReduce(2), ("x",), ("y",)))
    g.verify()
    config = config_of("k3-tiny")
    target = Target.for_arch(config, num_sms=4, tp=2)
    passes = until("schedule")
    tg = run_pipeline(g, target, passes[[p.name for p in passes].index("tile") :]).output
    with pytest.raises(EmitError, match=r"all_reduce\(ranks=2\) of a \[2, 3, 64\] operand"):
        emit_task_table(tg, target)
