"""emit_task_table: the scheduled TaskGraph -> format 3 task table; round trip through
ir/task_table.py's decode, operands that point at the plan, and the table's own synchronisation
executed by the task simulator."""

from __future__ import annotations

import random

import pytest
import torch

from k3mk.compiler.config import load_config
from k3mk.ir import interpreter
from k3mk.ir.graph import Graph, Node, Role, Tensor
from k3mk.ir.ops import Add, Argmax, Embedding, Linear, RMSNorm, SiluMul
from k3mk.ir.simulate import Simulator, event_order, from_table, sm_order
from k3mk.ir.task_table import OP_KINDS, TaskTable
from k3mk.passes.emit_task_table import EmitError, EmittedTable, emit_task_table
from k3mk.passes.manager import PIPELINE, Target, run_pipeline, until

BF16 = torch.bfloat16
DIM, VOCAB = 256, 1024


def tiny_dense(batch: int = 1) -> tuple[Graph, dict[str, torch.Tensor]]:
    """x = embed[ids]; r = x + W1 rmsnorm(x); logits = W2 rmsnorm(r); next = argmax(logits), in bf16:
    a small dense graph."""
    g = Graph(meta={"max_context": 1, "tp": 1})
    gen = torch.Generator().manual_seed(3)
    weights = {}
    for name, shape in (("embed", (VOCAB, DIM)), ("g1", (DIM,)), ("w1", (DIM, DIM)), ("g2", (DIM,)), ("head", (VOCAB, DIM))):
        g.add_tensor(Tensor(name, shape, BF16, Role.WEIGHT))
        scale = 1.0 if name == "embed" else DIM**-0.5
        weights[name] = (1.0 + 0.1 * torch.randn(shape, generator=gen)) if len(shape) == 1 else scale * torch.randn(shape, generator=gen)
        weights[name] = weights[name].to(BF16)
    g.add_tensor(Tensor("token_ids", (batch,), torch.int32, Role.INPUT))
    for name in ("x", "n1", "h", "r", "n2"):
        g.add_tensor(Tensor(name, (batch, DIM), BF16, Role.ACTIVATION))
    g.add_tensor(Tensor("logits", (batch, VOCAB), BF16, Role.OUTPUT))
    g.add_tensor(Tensor("next_tokens", (batch,), torch.int32, Role.OUTPUT))
    g.add_node(Node("embedding", Embedding(), ("embed", "token_ids"), ("x",)))
    g.add_node(Node("norm1", RMSNorm(1e-5), ("x", "g1"), ("n1",)))
    g.add_node(Node("proj", Linear(False), ("n1", "w1"), ("h",)))
    g.add_node(Node("residual", Add(), ("x", "h"), ("r",)))
    g.add_node(Node("norm2", RMSNorm(1e-5), ("r", "g2"), ("n2",)))
    g.add_node(Node("head", Linear(False), ("n2", "head"), ("logits",)))
    g.add_node(Node("argmax", Argmax(), ("logits",), ("next_tokens",)))
    g.verify()
    return g, weights


def scheduled(graph: Graph, num_sms: int = 8):
    target = Target.for_arch(load_config("k3-tiny"), num_sms=num_sms)
    passes = until("schedule")
    return run_pipeline(graph, target, passes[[p.name for p in passes].index("tile") :]).output, target


def test_round_trip_through_decode():
    graph, _ = tiny_dense()
    tg, target = scheduled(graph)
    emitted = run_pipeline(tg, target, [p for p in PIPELINE if p.name == "emit_task_table"]).output  # verifies
    assert isinstance(emitted, EmittedTable)
    table = TaskTable.decode(emitted.data)
    assert table == emitted.table
    assert table.encode() == emitted.data
    assert [len(ts) for ts in table.lists] == [len(ts) for ts in tg.sm_lists]
    assert table.event_counts() == [e.expected for e in tg.events]
    assert [w.name for w in table.weights] == sorted(t.name for t in graph.by_role(Role.WEIGHT))
    assert "t0 embedding" in emitted.text()


def test_operands_point_at_the_plan():
    graph, _ = tiny_dense()
    tg, target = scheduled(graph)
    emitted = emit_task_table(tg, target)
    table = emitted.table
    buffers = {b.name: b.offset for b in table.buffers}
    assert all(buffers[n] == o for n, (o, _) in tg.arena.items())
    io = [buffers[n] for n in ("token_ids", "logits", "next_tokens")]
    assert min(io) >= tg.arena_bytes and table.arena_bytes >= max(io)  # inputs/outputs after the activations
    weight_id = {w.name: i for i, w in enumerate(table.weights)}
    for s, entries in enumerate(table.lists):
        for position, entry in enumerate(entries):
            task = tg.tasks[tg.sm_lists[s][position]]
            assert entry.label.startswith(f"t{task.id} {task.node}")
            assert entry.wait == tuple(e for e, _ in task.waits) and entry.signal == (task.signals[0] if task.signals else None)
            variant = table.variants[entry.opcode]
            assert set(entry.operands) <= set(OP_KINDS[variant.op].operands)
            if variant.op == "gemv":
                operand = lambda name: entry.operands.get(name, 0)  # noqa: E731  (zeros are not stored)
                (x, w) = task.args
                (out,) = task.results
                rows = out.boxes[0][1]
                assert (operand("x"), operand("out"), operand("weight")) == (buffers[x.tensor], buffers[out.tensor], weight_id[w.tensor])
                assert (operand("row_begin"), operand("row_count")) == (rows[0], rows[1] - rows[0])
                assert operand("batch_stride") == graph.tensors[out.tensor].shape[1]  # the elements between out's rows
                assert (variant.params.in_features, variant.params.out_features) == graph.tensors[w.tensor].shape[::-1]
    assert {v.op for v in table.variants} == {"embedding", "rmsnorm", "gemv", "add", "argmax"}


def test_the_table_itself_runs_in_the_simulator():
    """The decoded table's lists, waits and signals drive the simulator (STYLE.md: the CPU simulator
    executes the SAME table the GPU executes)."""
    graph, weights = tiny_dense()
    tg, target = scheduled(graph)
    table = TaskTable.decode(emit_task_table(tg, target).data)
    replay = from_table(tg, table)
    values = {"token_ids": torch.tensor([17], dtype=torch.int32)}
    expected = interpreter.run(graph, {**weights, **values})
    sim = Simulator(replay, weights)
    rng = random.Random(0)
    for order in [sm_order(replay, rng) for _ in range(5)] + [event_order(replay, rng) for _ in range(5)]:
        got = sim.run(values, order).values
        assert torch.equal(got["next_tokens"], expected["next_tokens"])
        assert torch.equal(got["logits"], expected["logits"])


def test_names_what_the_format_cannot_express():
    """Format 2 lowers every op kind of the fused Kimi graphs, tensor-parallel ones included
    (tests/passes/test_emit_models.py, test_emit_tp.py); an op kind the fuse pass always folds into a
    GEMV epilogue has none, and the error names it with its task count."""
    g = Graph(meta={"max_context": 1, "tp": 1})
    for name, role in (("gate", Role.INPUT), ("up", Role.INPUT), ("y", Role.OUTPUT)):
        g.add_tensor(Tensor(name, (1, 64), BF16, role))
    g.add_node(Node("act", SiluMul(), ("gate", "up"), ("y",)))
    tg, target = scheduled(g)
    with pytest.raises(EmitError, match=r"no op kind for: silu_mul \(1 tasks\)"):
        emit_task_table(tg, target)


def test_refuses_an_unscheduled_graph():
    graph, _ = tiny_dense()
    tg, target = scheduled(graph)
    tg.sm_lists = []
    with pytest.raises(EmitError, match="run the schedule pass"):
        emit_task_table(tg, target)


@pytest.mark.parametrize("batch", [1, 4])
def test_x_staged_marks_a_gemv_right_after_the_same_gemv_input(batch):
    """A gemv task skips staging its input (x_staged = 1) exactly when the task before it in its list is a gemv of the
    same variant and norm weight whose graph task reads the same x tensor: what that task staged is this input."""
    from k3mk.compiler.capture import capture

    config = load_config("k3-tiny")
    target = Target.for_arch(config, num_sms=16, max_tokens=batch, max_context=256)  # few SMs: stages share CTAs
    em = run_pipeline(capture(config, batch, 256, torch.bfloat16), target, until("emit_task_table")).output
    table, tg = em.table, em.task_graph
    offsets = {b.name: b.offset for b in table.buffers}

    def reads(i: int, offset: int) -> set[str]:  # the graph tensors task i reads at arena offset `offset`
        return {a.tensor for a in tg.tasks[i].args if offsets.get(a.tensor) == offset}

    flagged = 0
    for ids, entries in zip(tg.sm_lists, table.lists):
        for k, entry in enumerate(entries):
            if table.variants[entry.opcode].op != "gemv":
                assert "x_staged" not in entry.operands
                continue
            x = entry.operands.get("x", 0)
            prev = entries[k - 1] if k else None
            same = (prev is not None and prev.opcode == entry.opcode and prev.operands.get("x", 0) == x
                    and prev.operands.get("norm_weight", 0) == entry.operands.get("norm_weight", 0)
                    and bool(reads(ids[k - 1], x) & reads(ids[k], x)))  # fmt: skip
            assert entry.operands.get("x_staged", 0) == int(same), entry.label
            flagged += same
    assert flagged > 0
