"""emit_task_table: the scheduled TaskGraph -> the binary task table the megakernel executes
(ir/task_table.py, docs/task_table.md, format 1).

Input: a TaskGraph after schedule (every task on one SM list, at most 2 waits and 1 signal per task
as build_events guarantees). Output: an `EmittedTable` holding the `TaskTable`, its encoded bytes and
the TaskGraph it came from; its `verify()` decodes the bytes and checks they give the same table. What the table says:
- lists: one per SM of the schedule (list s = SM s's tasks in order, empty lists included);
- events: the TaskGraph's events, same ids; each count is derived by `encode` from the signallers,
  which must equal the expected count the waiters carry (checked here: a miscount is a hang);
- weights: one entry per IR WEIGHT tensor, sorted by name (the order the manifest lists; weights are
  bound by name at load time, a weight operand is an index into this table);
- buffers: every arena tensor at its planned offset. Step inputs and outputs that a task reads or
  writes are placed after the activations ("io" bytes): format 1 addresses them as arena buffers that
  the runtime fills and reads by name;
- one table task per TaskGraph task, labelled `t<id> <node>`, its opcode the index of its
  (op kind, compile-time constants) variant, deduplicated.
Each task's recipe (`task.op`, `task.args`, `task.results`: ir/tasks.py) is lowered by the rule for
its op kind in `LOWER`; a kind without a rule, or a tile a rule cannot express, is an EmitError that
names every such kind (with counts) or the task.

Format 1 has op kinds for gemv (plain, rmsnorm prologue, one residual), rmsnorm, embedding, argmax and
add only. What the full models need beyond that (found lowering k3-tiny and a small Kimi Linear):
op kinds for the other recipe kinds tile.py makes (kda_conv, kda_recurrence, linear_kda_gate,
linear_gated_rmsnorm, linear_sigmoid_gate, gated_linear, router, expert_gated_linear(_mxfp4),
expert_linear(_mxfp4)_combine, mla_latent, mla_cache_write, mla_q_absorb, mla_decode, mla_v_up,
attn_res, the collectives); operands for decode state (engine-owned buffers outside the arena: a state
table like the weight table); float32 activations; batch ranges for embedding (tile.py makes a task
per batch row); int64 step inputs (the IR's token_ids / positions; embedding reads int32 ids).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

from k3mk.ir.graph import Graph, Role
from k3mk.ir.task_table import (
    AddParams,
    ArgmaxParams,
    BufferSpec,
    EmbeddingParams,
    Event,
    GemvParams,
    OpVariant,
    RmsnormParams,
    Task,
    TaskTable,
    WeightSpec,
)
from k3mk.ir.tasks import Operand, TaskGraph, byte_runs
from k3mk.ir.tasks import Task as GraphTask

IO_ALIGN = 256  # as the arena plan's slots (passes/plan_memory.ALIGN)

class EmitError(ValueError):
    """A task graph the task table format cannot express: names the op kinds or the task."""


def dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --------------------------------------------------------------------------------------------
# lowering context


@dataclass
class _Context:
    graph: Graph
    offsets: dict[str, int]  # arena byte offset of every activation and io tensor
    weight_ids: dict[str, int]

    def arena(self, task: GraphTask, name: str) -> int:
        if name not in self.offsets:
            raise EmitError(f"task t{task.id} ({task.node}): '{name}' ({self.graph.tensors[name].role.value}) has no arena offset")
        return self.offsets[name]

    def weight(self, name: str) -> int:
        return self.weight_ids[name]

    def shape(self, a: Operand) -> tuple[int, ...]:
        return self.graph.tensors[a.tensor].shape

    def whole(self, task: GraphTask, a: Operand) -> None:
        if a.boxes != (tuple((0, s) for s in self.shape(a)),):
            raise EmitError(f"task t{task.id} ({task.node}): format 1 needs all of '{a.tensor}', the tile has {a.text()}")

    def dtype(self, task: GraphTask, a: Operand, allowed: tuple[str, ...] = ("bfloat16",)) -> str:
        name = dtype_name(self.graph.tensors[a.tensor].dtype)
        if name not in allowed:
            raise EmitError(f"task t{task.id} ({task.node}): '{a.tensor}' is {name}, format 1 takes {' or '.join(allowed)}")
        return name


def _rows(task: GraphTask, out: Operand, ctx: _Context) -> tuple[int, int]:
    """The (begin, count) of dim 0 of a result box that is whole along every other dim."""
    (box,) = out.boxes
    if any(b != (0, s) for b, s in zip(box[1:], ctx.shape(out)[1:])):
        raise EmitError(f"task t{task.id} ({task.node}): format 1 tiles {out.tensor} by batch rows only, the tile has {out.text()}")
    return box[0][0], box[0][1] - box[0][0]


# --------------------------------------------------------------------------------------------
# one rule per op kind: (task, ctx) -> (variant, operands)

Lowered = tuple[OpVariant, dict[str, int]]


def _gemv(task: GraphTask, ctx: _Context) -> Lowered:
    """linear / rmsnorm_linear / linear_residual with one residual: rows [r0, r1) of out, all batch rows."""
    op, args = task.op, task.args
    norm = residual = None
    if op.name == "linear":
        x, w = args
    elif op.name == "rmsnorm_linear":
        x, norm, w = args
    elif len(args) == 3:  # linear_residual with one residual
        residual, x, w = args
    else:
        raise EmitError(f"task t{task.id} ({task.node}): format 1's gemv adds one residual, the task adds {len(args) - 2}")
    if getattr(op, "fp32", False):
        raise EmitError(f"task t{task.id} ({task.node}): format 1's gemv is bf16, the task computes in fp32")
    (out,) = task.results
    batch, out_features = ctx.shape(out)
    (box,) = out.boxes
    (row_begin, row_end) = box[1]
    if box[0] != (0, batch) or w.boxes[0][0] != (row_begin, row_end):
        raise EmitError(f"task t{task.id} ({task.node}): format 1's gemv writes rows of all batch rows, the tile is {out.text()}")
    ctx.whole(task, x)
    for a in (x, out, *((residual,) if residual else ())):
        ctx.dtype(task, a)
    params = GemvParams(
        in_features=ctx.shape(w)[1],
        out_features=out_features,
        batch=batch,
        rmsnorm=norm is not None,
        residuals=int(residual is not None),
        **({"eps": op.eps} if norm is not None else {}),
    )
    operands = {
        "x": ctx.arena(task, x.tensor),
        "out": ctx.arena(task, out.tensor),
        "weight": ctx.weight(w.tensor),
        "row_begin": row_begin,
        "row_count": row_end - row_begin,
    }
    if residual is not None:
        operands["residual"] = ctx.arena(task, residual.tensor)
    if norm is not None:
        operands["norm_weight"] = ctx.weight(norm.tensor)
    return OpVariant("gemv", params), operands


def _rmsnorm(task: GraphTask, ctx: _Context) -> Lowered:
    x, w = task.args
    (out,) = task.results
    begin, count = _rows(task, out, ctx)
    ctx.dtype(task, x)
    ctx.dtype(task, out)
    batch, dim = ctx.shape(out)
    operands = {"x": ctx.arena(task, x.tensor), "out": ctx.arena(task, out.tensor), "weight": ctx.weight(w.tensor), "batch_begin": begin, "batch_count": count}
    return OpVariant("rmsnorm", RmsnormParams(dim=dim, batch=batch, eps=task.op.eps)), operands


def _embedding(task: GraphTask, ctx: _Context) -> Lowered:
    table, ids = task.args
    (out,) = task.results
    ctx.whole(task, out)
    ctx.dtype(task, ids, ("int32",))
    ctx.dtype(task, out)
    vocab, dim = ctx.shape(table)
    operands = {"ids": ctx.arena(task, ids.tensor), "out": ctx.arena(task, out.tensor), "table": ctx.weight(table.tensor)}
    return OpVariant("embedding", EmbeddingParams(dim=dim, vocab=vocab, batch=ctx.shape(out)[0])), operands


def _argmax(task: GraphTask, ctx: _Context) -> Lowered:
    (logits,) = task.args
    (out,) = task.results
    batch, vocab = ctx.shape(logits)
    (box,) = out.boxes
    if logits.boxes[0][0] != box[0]:
        raise EmitError(f"task t{task.id} ({task.node}): reads logits rows {logits.boxes[0][0]}, writes {box[0]}")
    ctx.dtype(task, out, ("int32",))
    params = ArgmaxParams(vocab=vocab, batch=batch, dtype=ctx.dtype(task, logits, ("bfloat16", "float32")))
    operands = {"logits": ctx.arena(task, logits.tensor), "out": ctx.arena(task, out.tensor), "batch_begin": box[0][0], "batch_count": box[0][1] - box[0][0]}
    return OpVariant("argmax", params), operands


def _add(task: GraphTask, ctx: _Context) -> Lowered:
    """Elements [begin, begin + count) of the flattened tensors: the box must be one run of elements."""
    a, b = task.args
    (out,) = task.results
    runs = byte_runs(out.boxes[0], ctx.shape(out), 1)
    if len(runs) != 1 or a.boxes != out.boxes or b.boxes != out.boxes:
        raise EmitError(f"task t{task.id} ({task.node}): format 1's add takes one contiguous range, the tile is {out.text()}")
    for x in (a, b, out):
        ctx.dtype(task, x)
    (begin, end), = runs
    operands = {"a": ctx.arena(task, a.tensor), "b": ctx.arena(task, b.tensor), "out": ctx.arena(task, out.tensor), "begin": begin, "count": end - begin}
    return OpVariant("add", AddParams()), operands


LOWER: dict[str, Callable[[GraphTask, _Context], Lowered]] = {
    "linear": _gemv,
    "rmsnorm_linear": _gemv,
    "linear_residual": _gemv,
    "rmsnorm": _rmsnorm,
    "embedding": _embedding,
    "argmax": _argmax,
    "add": _add,
}


# --------------------------------------------------------------------------------------------
# the pass


@dataclass
class EmittedTable:
    """The pass's result: what it was emitted from, the table, and the file bytes."""

    task_graph: TaskGraph
    table: TaskTable
    data: bytes

    @property
    def tasks(self) -> list[Task]:
        """The table's tasks, list after list (what the pass manager counts)."""
        return [t for ts in self.table.lists for t in ts]

    def verify(self) -> None:
        """The bytes decode to exactly the table (and the table validates, deadlock check included)."""
        decoded = TaskTable.decode(self.data)
        if decoded != self.table:
            raise EmitError("the encoded task table does not decode to the table emitted")
        decoded.validate()

    def text(self) -> str:
        t = self.table
        lines = [
            f"# k3mk task table: {len(t.lists)} lists, {t.num_tasks} tasks, {len(t.events)} events, "
            f"{len(t.variants)} variants, {len(t.weights)} weights, arena {t.arena_bytes} bytes, {len(self.data)} bytes"
        ]
        lines += [f"variant {i}: {v.op} {v.params}" for i, v in enumerate(t.variants)]
        lines += [f"buffer {b.name} @{b.offset} {b.dtype}{list(b.shape)}" for b in t.buffers]
        for s, tasks in enumerate(t.lists):
            for i, task in enumerate(tasks):
                waits = " ".join(f"wait(e{e})" for e in task.wait)
                signal = f" signal(e{task.signal})" if task.signal is not None else ""
                ops = " ".join(f"{k}={v}" for k, v in task.operands.items())
                lines.append(f"sm{s}#{i} {task.label}: op{task.opcode} {ops} {waits}{signal}".rstrip())
        return "\n".join(lines) + "\n"


def _io_offsets(tg: TaskGraph) -> tuple[dict[str, int], int]:
    """Arena offsets for the step inputs and outputs tasks touch, after the activations."""
    offsets: dict[str, int] = {}
    end = tg.arena_bytes
    touched = sorted({r.tensor for t in tg.tasks for r in (*t.reads, *t.writes)})
    for name in touched:
        tensor = tg.graph.tensors[name]
        if name in tg.arena or tensor.role not in (Role.INPUT, Role.OUTPUT):
            continue
        offsets[name] = end = -(-end // IO_ALIGN) * IO_ALIGN
        end += tensor.nbytes
    return offsets, end


def emit_task_table(tg: TaskGraph, target: Any = None) -> EmittedTable:
    """Lower every task (module docstring); raise EmitError for what format 1 cannot express."""
    listed = sorted(t for ts in tg.sm_lists for t in ts)
    if listed != list(range(len(tg.tasks))):
        raise EmitError("every task must be on exactly one SM list: run the schedule pass first")
    unsupported = Counter(t.op.name if t.op is not None else "<no recipe>" for t in tg.tasks if t.op is None or t.op.name not in LOWER)
    if unsupported:
        kinds = ", ".join(f"{n} ({c} tasks)" for n, c in sorted(unsupported.items()))
        raise EmitError(f"task table format 1 has no op kind for: {kinds}")
    if [e.id for e in tg.events] != list(range(len(tg.events))):
        raise EmitError("event ids must be 0..n-1 in order (run build_events)")
    graph = tg.graph
    io, arena_bytes = _io_offsets(tg)
    offsets = {**{n: o for n, (o, _) in tg.arena.items()}, **io}
    weights = sorted(t.name for t in graph.by_role(Role.WEIGHT))
    ctx = _Context(graph, offsets, {n: i for i, n in enumerate(weights)})
    expected = {e.id: e.expected for e in tg.events}
    variants: dict[OpVariant, int] = {}
    lists: list[list[Task]] = []
    for ids in tg.sm_lists:
        tasks = []
        for i in ids:
            task = tg.tasks[i]
            if len(task.signals) > 1 or len(task.waits) > 2:
                raise EmitError(f"task t{i} ({task.node}) waits on {len(task.waits)} events and signals {len(task.signals)}: format 1 allows 2 and 1")
            for e, count in task.waits:
                if count != expected[e]:
                    raise EmitError(f"task t{i} ({task.node}) waits for {count} signals of e{e}, which has {expected[e]} producers")
            variant, operands = LOWER[task.op.name](task, ctx)
            opcode = variants.setdefault(variant, len(variants))
            tasks.append(Task(opcode, operands, tuple(e for e, _ in task.waits), task.signals[0] if task.signals else None, f"t{i} {task.node}"))
        lists.append(tasks)
    table = TaskTable(
        variants=list(variants),
        lists=lists,
        events=[Event(f"e{e.id} {tg.tasks[e.producers[0]].node}" if e.producers else f"e{e.id}") for e in tg.events],
        weights=[WeightSpec(n, dtype_name(graph.tensors[n].dtype), graph.tensors[n].shape) for n in weights],
        buffers=[
            BufferSpec(n, o, dtype_name(graph.tensors[n].dtype), graph.tensors[n].shape)
            for n, o in sorted(offsets.items(), key=lambda kv: (kv[1], kv[0]))
        ],
        arena_bytes=arena_bytes,
    )
    return EmittedTable(tg, table, table.encode())
