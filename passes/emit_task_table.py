"""emit_task_table: the scheduled TaskGraph -> the binary task table the megakernel executes
(ir/task_table.py, docs/task_table.md, format 3).

Input: a TaskGraph after schedule (every task on one SM list, at most 2 waits and 1 signal per task
as build_events guarantees). Output: an `EmittedTable` holding the `TaskTable`, its encoded bytes and
the TaskGraph it came from; its `verify()` decodes the bytes and checks they give the same table. What the table says:
- lists: one per SM of the schedule (list s = SM s's tasks in order, empty lists included);
- events: the TaskGraph's events, same ids; each count is derived by `encode` from the signallers,
  which must equal the expected count the waiters carry (checked here: a miscount is a hang);
- weights: one entry per IR WEIGHT tensor, sorted by name (the order the manifest lists; weights are
  bound by name at load time, a weight operand is an index into this table);
- states (format 3): one entry per IR STATE tensor (KDA conv / recurrent state, MLA latent cache),
  sorted by name, pointer-table entries after the weights; the STATE_OUT of a state is the same entry
  (updated in place);
- buffers: every arena tensor at its planned offset; step inputs and outputs that a task reads or
  writes are placed after the activations with role "input" / "output" (token ids and positions as
  int32: the IR's int64 step inputs are converted by the runtime);
- router results (expert ids, weights): own slots after the io, never reused (readable after a step);
- one table task per TaskGraph task, labelled `t<id> <node>`, its opcode the index of its
  (op kind, compile-time constants) variant, deduplicated.
Each task's recipe (`task.op`, `task.args`, `task.results`: ir/tasks.py) is lowered by the rule for
its op kind in `LOWER`; a kind without a rule, or a tile a rule cannot express, is an EmitError that
names every such kind (with counts) or the task.

Lowering notes: the fused GEMV family (linear, rmsnorm_linear, linear_residual with 1..4 residuals,
gated_linear, linear_sigmoid_gate, linear_kda_gate, linear_gated_rmsnorm) becomes `gemv` variants
(prologue + epilogue in GemvParams); mla_latent becomes the `mla_latent` op that also writes the
latent cache row (the cache and positions come from the mla_cache_write node that consumes it), and
mla_cache_write a `nop` that keeps the graph's events (it waits on the latent task and signals the
decode tasks). An unfused router (gate > 256 KB, passes/fuse_epilogue.py) is its fp32 `linear`, row-tiled,
and `router_topk`: the top-k is folded into the GEMV's tiles (`_router_folds`: GemvParams epilogue "router",
no task of its own and no hand-off on every MoE layer's critical path, PERFORMANCE.md E5). Its tasks wait
on the logits event instead (the last tile's signal follows its selection), and its own event becomes the
tiles' arrival count. A router_topk whose logits are not such tiles' alone stays one `router_topk` task.
mla_decode tiles are head groups of <= mla_decode_group_heads(batch) (passes/tile.py).

Tensor parallelism (tp > 1, docs/task_table.md "Tensor parallelism"): every rank runs this same table.
all_reduce / all_gather tasks (column chunks of a [rows, cols] operand) get receive slots in the comm
region (`CommSpec`: per collective node `ranks` slots of its whole operand, in node order; per
collective task one comm counter, in task order) and read this rank's index from the `tp_rank` step
input, which is always placed in the arena; shard_slice, argmax_partial and argmax_combine are
rank-local ops.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Callable

from k3mk.ir.collectives import TP_RANK
from k3mk.ir.graph import Graph, Role
from k3mk.ir.ops import SiluMul, SituMul
from k3mk.ir.task_table import (
    COLLECTIVE_OPS,
    COMBINE_RESIDUAL_OPERANDS,
    MAX_ATTN_RES_SOURCES,
    AddParams,
    ArgmaxCombineParams,
    ArgmaxParams,
    AttnResParams,
    BufferSpec,
    CollectiveParams,
    CommSpec,
    EmbeddingParams,
    Event,
    ExpertCombineParams,
    ExpertGatedParams,
    GemvParams,
    KdaConvParams,
    KdaRecurrenceParams,
    MlaDecodeParams,
    MlaLatentParams,
    MlaQAbsorbParams,
    MlaVUpParams,
    NopParams,
    OpVariant,
    RmsnormParams,
    RouterParams,
    RouterTopkParams,
    ShardSliceParams,
    StateSpec,
    Task,
    TaskTable,
    WeightSpec,
)
from k3mk.ir.tasks import Operand, TaskGraph, buffer_name, byte_runs
from k3mk.ir.tasks import Task as GraphTask
from k3mk.passes.tile import mla_decode_group_heads

IO_ALIGN = 256  # as the arena plan's slots (passes/plan_memory.ALIGN)

class EmitError(ValueError):
    """A task graph the task table format cannot express: names the op kinds or the task."""


def dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --------------------------------------------------------------------------------------------
# lowering context


@dataclass
class _CommLayout:
    """Where the collectives exchange: the comm region, each collective node's parity-0 slots (byte
    offset in a comm region) and each collective task's comm counter."""

    spec: CommSpec
    pointer: int  # pointer-table index of rank 0's comm region
    slots: dict[str, int]
    events: dict[int, int]


@dataclass
class _Context:
    graph: Graph
    offsets: dict[str, int]  # arena byte offset of every activation and io tensor
    weight_ids: dict[str, int]
    state_ids: dict[str, int]  # pointer-table index of every state (after the weights)
    comm: _CommLayout | None = None

    def state(self, task: GraphTask, name: str) -> int:
        base = buffer_name(self.graph, name)
        if base not in self.state_ids:
            raise EmitError(f"task t{task.id} ({task.node}): '{name}' is not decode state")
        return self.state_ids[base]

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
            raise EmitError(f"task t{task.id} ({task.node}): format 3 needs all of '{a.tensor}', the tile has {a.text()}")

    def dtype(self, task: GraphTask, a: Operand, allowed: tuple[str, ...] = ("bfloat16",)) -> str:
        name = dtype_name(self.graph.tensors[a.tensor].dtype)
        if name not in allowed:
            raise EmitError(f"task t{task.id} ({task.node}): '{a.tensor}' is {name}, format 3 takes {' or '.join(allowed)}")
        return name

    def io_dtype(self, task: GraphTask, a: Operand) -> None:
        """Step inputs the kernel reads as int32 (token ids, positions): int64 in the IR, int32 in the arena."""
        t = self.graph.tensors[a.tensor]
        if t.role != Role.INPUT or dtype_name(t.dtype) not in ("int32", "int64"):
            raise EmitError(f"task t{task.id} ({task.node}): '{a.tensor}' must be an int step input")


def _rows(task: GraphTask, out: Operand, ctx: _Context) -> tuple[int, int]:
    """The (begin, count) of dim 0 of a result box that is whole along every other dim."""
    (box,) = out.boxes
    if any(b != (0, s) for b, s in zip(box[1:], ctx.shape(out)[1:])):
        raise EmitError(f"task t{task.id} ({task.node}): format 3 tiles {out.tensor} by batch rows only, the tile has {out.text()}")
    return box[0][0], box[0][1] - box[0][0]


# --------------------------------------------------------------------------------------------
# one rule per op kind: (task, ctx) -> (variant, operands)

Lowered = tuple[OpVariant, dict[str, int]]


RESIDUAL_OPERANDS = ("residual", "residual2", "residual3", "residual4")


def _gemv_x(name: str, args) -> Operand:
    """The input x of a fused GEMV task's op (its operand order: _gemv)."""
    return args[-2] if name == "linear_residual" else args[0]


def _gemv(task: GraphTask, ctx: _Context) -> Lowered:
    """The fused GEMV family: rows [r0, r1) of out, all batch rows; prologue / epilogue per op kind."""
    op, args = task.op, list(task.args)
    name = op.name
    norm = None
    extra: dict[str, Any] = {}
    operands: dict[str, int] = {}
    residuals: list[Operand] = []
    x = _gemv_x(name, args)
    if name == "linear":
        _, w = args
    elif name == "rmsnorm_linear":
        _, norm, w = args
        extra["eps"] = op.eps
    elif name == "linear_residual":
        *residuals, _, w = args
        if not 1 <= len(residuals) <= len(RESIDUAL_OPERANDS):
            raise EmitError(f"task t{task.id} ({task.node}): gemv adds 1..4 residuals, the task adds {len(residuals)}")
    else:  # NormPrologue ops: x, [norm], rest
        norm_eps = getattr(op, "norm_eps", None)
        args.pop(0)
        if norm_eps is not None:
            norm = args.pop(0)
            extra["eps"] = norm_eps
        if name == "gated_linear":
            w, w_up = args
            operands["weight_up"] = ctx.weight(w_up.tensor)
            act = op.activation
            if isinstance(act, SituMul):
                extra.update(epilogue="situ_mul", beta=act.beta, linear_beta=act.linear_beta)
            elif isinstance(act, SiluMul):
                extra["epilogue"] = "silu_mul"
            else:
                raise EmitError(f"task t{task.id} ({task.node}): no gemv epilogue for activation {act}")
        elif name == "linear_sigmoid_gate":
            w, o = args
            extra["epilogue"] = "sigmoid_gate"
            operands["o"] = ctx.arena(task, o.tensor)
            ctx.dtype(task, o)
        elif name == "linear_kda_gate":
            w, a_log, dt_bias = args
            out_shape = ctx.shape(task.results[0])
            extra.update(epilogue="kda_gate", out_dtype="float32", head_dim=out_shape[2], lower_bound=op.lower_bound)
            operands["a_log"] = ctx.weight(a_log.tensor)
            operands["dt_bias"] = ctx.weight(dt_bias.tensor)
        elif name == "linear_gated_rmsnorm":
            w, o, o_norm = args
            extra.update(epilogue="gated_rmsnorm", head_dim=op.head_dim, o_eps=op.eps)
            operands["o"] = ctx.arena(task, o.tensor)
            operands["o_norm_weight"] = ctx.weight(o_norm.tensor)
            ctx.dtype(task, o)
        else:
            raise EmitError(f"task t{task.id} ({task.node}): no gemv lowering for {name}")
    if getattr(op, "fp32", False):
        extra["out_dtype"] = "float32"
    (out,) = task.results
    out_shape = ctx.shape(out)
    batch = out_shape[0]
    out_features = 1
    for s in out_shape[1:]:
        out_features *= s
    (box,) = out.boxes
    runs = byte_runs(tuple(box[1:]), out_shape[1:], 1)
    if box[0] != (0, batch) or len(runs) != 1:
        raise EmitError(f"task t{task.id} ({task.node}): gemv writes one row range of all batch rows, the tile is {out.text()}")
    ((row_begin, row_end),) = runs
    if w.boxes[0][0] != (row_begin, row_end) and extra.get("epilogue") != "gated_rmsnorm":
        raise EmitError(f"task t{task.id} ({task.node}): weight rows {w.boxes[0][0]} != out rows {(row_begin, row_end)}")
    if tuple(ctx.shape(w)) != (out_features, ctx.shape(x)[1]):
        raise EmitError(f"task t{task.id} ({task.node}): weight {ctx.shape(w)} vs out {out_shape} / x {ctx.shape(x)}")
    if x.boxes[0][0] != (0, batch) or x.boxes[0][1] != (0, ctx.shape(x)[1]):
        raise EmitError(f"task t{task.id} ({task.node}): gemv reads all of x, the tile reads {x.text()}")
    ctx.dtype(task, x)
    ctx.dtype(task, out, ("float32",) if extra.get("out_dtype") == "float32" else ("bfloat16",))
    for i, r in enumerate(residuals):
        ctx.dtype(task, r)
        if ctx.shape(r) != out_shape:
            raise EmitError(f"task t{task.id} ({task.node}): residual {r.tensor} shape {ctx.shape(r)} != out {out_shape}")
        operands[RESIDUAL_OPERANDS[i]] = ctx.arena(task, r.tensor)
    params = GemvParams(in_features=ctx.shape(w)[1], out_features=out_features, batch=batch, rmsnorm=norm is not None,
                        residuals=len(residuals), **extra)  # fmt: skip
    operands.update({"x": ctx.arena(task, x.tensor), "out": ctx.arena(task, out.tensor), "weight": ctx.weight(w.tensor),
                     "row_begin": row_begin, "row_count": row_end - row_begin, "batch_stride": out_features})  # fmt: skip
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
    begin, count = _rows(task, out, ctx)
    ctx.io_dtype(task, ids)
    ctx.dtype(task, out)
    vocab, dim = ctx.shape(table)
    operands = {"ids": ctx.arena(task, ids.tensor), "out": ctx.arena(task, out.tensor), "table": ctx.weight(table.tensor),
                "batch_begin": begin, "batch_count": count}  # fmt: skip
    return OpVariant("embedding", EmbeddingParams(dim=dim, vocab=vocab, batch=ctx.shape(out)[0])), operands


def _argmax(task: GraphTask, ctx: _Context) -> Lowered:
    """argmax, and argmax_partial (one vocabulary shard under tp: results (value, local index))."""
    (logits,) = task.args
    *value, out = task.results
    batch, vocab = ctx.shape(logits)
    (box,) = out.boxes
    if logits.boxes[0][0] != box[0] or any(v.boxes != out.boxes for v in value):
        raise EmitError(f"task t{task.id} ({task.node}): reads logits rows {logits.boxes[0][0]}, writes {[r.text() for r in task.results]}")
    ctx.dtype(task, out, ("int32",))
    params = ArgmaxParams(vocab=vocab, batch=batch, dtype=ctx.dtype(task, logits, ("bfloat16", "float32")))
    operands = {"logits": ctx.arena(task, logits.tensor), "out": ctx.arena(task, out.tensor), "batch_begin": box[0][0], "batch_count": box[0][1] - box[0][0]}
    for v in value:
        ctx.dtype(task, v, ("float32",))
        operands["value"] = ctx.arena(task, v.tensor)
    return OpVariant(task.op.name, params), operands


def _add(task: GraphTask, ctx: _Context) -> Lowered:
    """Elements [begin, begin + count) of the flattened tensors: the box must be one run of elements."""
    a, b = task.args
    (out,) = task.results
    runs = byte_runs(out.boxes[0], ctx.shape(out), 1)
    if len(runs) != 1 or a.boxes != out.boxes or b.boxes != out.boxes:
        raise EmitError(f"task t{task.id} ({task.node}): format 3's add takes one contiguous range, the tile is {out.text()}")
    for x in (a, b, out):
        ctx.dtype(task, x)
    (begin, end), = runs
    operands = {"a": ctx.arena(task, a.tensor), "b": ctx.arena(task, b.tensor), "out": ctx.arena(task, out.tensor), "begin": begin, "count": end - begin}
    return OpVariant("add", AddParams()), operands


def _kda_conv(task: GraphTask, ctx: _Context) -> Lowered:
    q, k, v, state, wq, wk, wv = task.args
    yq, yk, yv, _ = task.results
    batch, channels = ctx.shape(yq)
    (box,) = yq.boxes
    c0, c1 = box[1]
    if box[0] != (0, batch) or any(a.boxes[0] != ((0, batch), (c0, c1)) for a in (q, k, v, yk, yv)):
        raise EmitError(f"task t{task.id} ({task.node}): kda_conv tiles channels of all rows, the tile is {yq.text()}")
    width = ctx.shape(wq)[-1]
    params = KdaConvParams(channels=channels, batch=batch, width=width)
    operands = {"q": ctx.arena(task, q.tensor), "k": ctx.arena(task, k.tensor), "v": ctx.arena(task, v.tensor),
                "out_q": ctx.arena(task, yq.tensor), "out_k": ctx.arena(task, yk.tensor), "out_v": ctx.arena(task, yv.tensor),
                "state": ctx.state(task, state.tensor), "weight_q": ctx.weight(wq.tensor), "weight_k": ctx.weight(wk.tensor),
                "weight_v": ctx.weight(wv.tensor), "channel_begin": c0, "channel_count": c1 - c0}  # fmt: skip
    return OpVariant("kda_conv", params), operands


def _kda_recurrence(task: GraphTask, ctx: _Context) -> Lowered:
    q, k, v, g, beta, state = task.args
    o, _ = task.results
    batch, heads, v_dim, k_dim = ctx.shape(state)
    head = task.tile["head"]
    v0, v1 = task.tile["values"]
    if state.boxes[0] != ((0, batch), (head, head + 1), (v0, v1), (0, k_dim)):
        raise EmitError(f"task t{task.id} ({task.node}): kda_recurrence tiles (head, value rows) of all requests, the tile is {state.text()}")
    params = KdaRecurrenceParams(num_heads=heads, head_dim=k_dim, batch=batch, value_rows=v1 - v0)
    operands = {"q": ctx.arena(task, q.tensor), "k": ctx.arena(task, k.tensor), "v": ctx.arena(task, v.tensor),
                "g": ctx.arena(task, g.tensor), "beta": ctx.arena(task, beta.tensor), "out": ctx.arena(task, o.tensor),
                "state": ctx.state(task, state.tensor), "head": head, "value_begin": v0, "value_count": v1 - v0}  # fmt: skip
    return OpVariant("kda_recurrence", params), operands


def _attn_res(task: GraphTask, ctx: _Context) -> Lowered:
    *sources, norm_w, proj_w = task.args
    (out,) = task.results
    if not 1 <= len(sources) <= MAX_ATTN_RES_SOURCES:
        raise EmitError(f"task t{task.id} ({task.node}): attn_res takes 1..{MAX_ATTN_RES_SOURCES} sources, the task has {len(sources)}")
    begin, count = _rows(task, out, ctx)
    batch, dim = ctx.shape(out)
    for s in (*sources, out):
        ctx.dtype(task, s)
    operands = {"out": ctx.arena(task, out.tensor), "norm_weight": ctx.weight(norm_w.tensor), "proj_weight": ctx.weight(proj_w.tensor),
                "batch_begin": begin, "batch_count": count}  # fmt: skip
    operands.update({f"source{i}": ctx.arena(task, s.tensor) for i, s in enumerate(sources)})
    return OpVariant("attn_res", AttnResParams(dim=dim, batch=batch, num_sources=len(sources), eps=task.op.eps)), operands


def _router(task: GraphTask, ctx: _Context) -> Lowered:
    op, args = task.op, list(task.args)
    x = args.pop(0)
    norm = args.pop(0) if op.norm_eps is not None else None
    w, bias = args
    ids, weights = task.results
    batch, dim = ctx.shape(x)
    if ids.boxes[0][0] != (0, batch):
        raise EmitError(f"task t{task.id} ({task.node}): the router is one task for all rows")
    ctx.dtype(task, ids, ("int32",))
    ctx.dtype(task, weights, ("float32",))
    params = RouterParams(dim=dim, num_experts=ctx.shape(w)[0], batch=batch, top_k=op.top_k, renormalize=op.renormalize,
                          scaling=op.scaling, rmsnorm=norm is not None, **({"eps": op.norm_eps} if norm is not None else {}))  # fmt: skip
    operands = {"x": ctx.arena(task, x.tensor), "ids": ctx.arena(task, ids.tensor), "topk_weights": ctx.arena(task, weights.tensor),
                "weight": ctx.weight(w.tensor), "bias": ctx.weight(bias.tensor)}  # fmt: skip
    if norm is not None:
        operands["norm_weight"] = ctx.weight(norm.tensor)
    return OpVariant("router", params), operands


def _router_topk(task: GraphTask, ctx: _Context) -> Lowered:
    """The top-k half of an unfused router: fp32 logits (a row-tiled fp32 gemv wrote them) -> ids, weights."""
    logits, bias = task.args
    ids, weights = task.results
    batch, experts = ctx.shape(logits)
    if ids.boxes[0][0] != (0, batch) or logits.boxes[0] != ((0, batch), (0, experts)):
        raise EmitError(f"task t{task.id} ({task.node}): router_topk is one task for all rows and experts")
    ctx.dtype(task, logits, ("float32",))
    ctx.dtype(task, ids, ("int32",))
    ctx.dtype(task, weights, ("float32",))
    op = task.op
    params = RouterTopkParams(num_experts=experts, batch=batch, top_k=op.top_k, renormalize=op.renormalize, scaling=op.scaling)
    operands = {"logits": ctx.arena(task, logits.tensor), "ids": ctx.arena(task, ids.tensor),
                "topk_weights": ctx.arena(task, weights.tensor), "bias": ctx.weight(bias.tensor)}  # fmt: skip
    return OpVariant("router_topk", params), operands


@dataclass(frozen=True)
class _RouterFold:
    """A router_topk task folded into the tiles of the fp32 GEMV that writes its logits (module docstring)."""

    topk: int  # the router_topk task (not emitted)
    tiles: tuple[int, ...]  # the logits GEMV's tasks: they select in their epilogue
    logits_event: int  # the event the tiles signal: the router_topk's waiters wait on it instead
    arrivals: int  # the router_topk's own event: the tiles' arrival count


def _router_folds(tg: TaskGraph) -> list[_RouterFold]:
    """Every router_topk task whose one wait is on the event of exactly the tasks writing its logits, each a
    tile of one fp32 GEMV node that signals nothing else, and whose own event only it signals."""
    folds = []
    for t in tg.tasks:
        if t.op is None or t.op.name != "router_topk" or len(t.waits) != 1 or len(t.signals) != 1:
            continue
        (logits_event, _), (arrivals,) = t.waits[0], t.signals
        tiles = tg.events[logits_event].producers
        writers = tuple(sorted(w.id for w in tg.tasks if any(r.tensor == t.args[0].tensor for r in w.results)))
        gemv = all(tg.tasks[i].op.name in ("linear", "rmsnorm_linear") and getattr(tg.tasks[i].op, "fp32", False)
                   and tg.tasks[i].signals == [logits_event] and tg.tasks[i].node == tg.tasks[tiles[0]].node for i in tiles)  # fmt: skip
        if gemv and tuple(sorted(tiles)) == writers and tg.events[arrivals].producers == (t.id,):
            folds.append(_RouterFold(t.id, tuple(tiles), logits_event, arrivals))
    return folds


def _router_tile(tile: GraphTask, lowered: Lowered, fold: _RouterFold, tg: TaskGraph, ctx: _Context) -> Lowered:
    """A tile of a router's logits GEMV with the router_topk task's selection in its epilogue."""
    variant, operands = lowered
    topk_variant, topk_operands = _router_topk(tg.tasks[fold.topk], ctx)
    p = topk_variant.params
    if variant.params.out_features != p.num_experts:
        raise EmitError(f"task t{tile.id} ({tile.node}): {variant.params.out_features} logits per request, the router selects from {p.num_experts}")
    params = replace(variant.params, epilogue="router", top_k=p.top_k, renormalize=p.renormalize, scaling=p.scaling)
    operands = {**operands, **{k: topk_operands[k] for k in ("bias", "ids", "topk_weights")}, "arrivals": fold.arrivals, "tiles": len(fold.tiles)}
    return OpVariant("gemv", params), operands


def _activation(task: GraphTask, act) -> dict:
    if isinstance(act, SituMul):
        return {"activation": "situ", "beta": act.beta, "linear_beta": act.linear_beta}
    if isinstance(act, SiluMul):
        return {"activation": "silu"}
    raise EmitError(f"task t{task.id} ({task.node}): no expert activation for {act}")


def _expert_gated(task: GraphTask, ctx: _Context) -> Lowered:
    mxfp4 = task.op.name.endswith("mxfp4")
    if mxfp4:
        x, w1, s1, w3, s3, ids = task.args
    else:
        x, w1, w3, ids = task.args
        s1 = s3 = None
    (out,) = task.results
    batch, top_k, out_features = ctx.shape(out)
    slot = task.tile["slot"]
    r0, r1 = task.tile["rows"]
    if out.boxes[0] != ((0, batch), (slot, slot + 1), (r0, r1)):
        raise EmitError(f"task t{task.id} ({task.node}): expert_gated tiles (slot, rows) of all requests, the tile is {out.text()}")
    e, _, k = ctx.shape(w1)
    params = ExpertGatedParams(in_features=k * 2 if mxfp4 else k, out_features=out_features, num_experts=e, batch=batch, top_k=top_k,
                               weight_format="mxfp4" if mxfp4 else "bfloat16", **_activation(task, task.op.activation))  # fmt: skip
    operands = {"x": ctx.arena(task, x.tensor), "ids": ctx.arena(task, ids.tensor), "out": ctx.arena(task, out.tensor),
                "weight": ctx.weight(w1.tensor), "weight_up": ctx.weight(w3.tensor), "slot": slot, "row_begin": r0,
                "row_count": r1 - r0}  # fmt: skip
    if mxfp4:
        operands.update(scale=ctx.weight(s1.tensor), scale_up=ctx.weight(s3.tensor))
    return OpVariant("expert_gated", params), operands


def _expert_combine(task: GraphTask, ctx: _Context) -> Lowered:
    mxfp4 = "mxfp4" in task.op.name
    n = task.op.num_list_inputs(len(task.args))
    residuals, args = task.args[:n], task.args[n:]
    if mxfp4:
        x, w2, s2, ids, weights = args
    else:
        x, w2, ids, weights = args
        s2 = None
    if len(residuals) > len(COMBINE_RESIDUAL_OPERANDS):
        raise EmitError(f"task t{task.id} ({task.node}): expert_combine adds up to {len(COMBINE_RESIDUAL_OPERANDS)} residuals, the task adds {len(residuals)}")
    (out,) = task.results
    batch, out_features = ctx.shape(out)
    _, top_k, _ = ctx.shape(x)
    r0, r1 = task.tile["rows"]
    if out.boxes[0] != ((0, batch), (r0, r1)):
        raise EmitError(f"task t{task.id} ({task.node}): expert_combine tiles rows of all requests, the tile is {out.text()}")
    e, _, k = ctx.shape(w2)
    params = ExpertCombineParams(in_features=k * 2 if mxfp4 else k, out_features=out_features, num_experts=e, batch=batch,
                                 top_k=top_k, weight_format="mxfp4" if mxfp4 else "bfloat16", residuals=len(residuals))  # fmt: skip
    operands = {"x": ctx.arena(task, x.tensor), "ids": ctx.arena(task, ids.tensor), "topk_weights": ctx.arena(task, weights.tensor),
                "out": ctx.arena(task, out.tensor), "weight": ctx.weight(w2.tensor), "row_begin": r0, "row_count": r1 - r0}  # fmt: skip
    for name, r in zip(COMBINE_RESIDUAL_OPERANDS, residuals):
        ctx.dtype(task, r)
        if ctx.shape(r) != (batch, out_features):
            raise EmitError(f"task t{task.id} ({task.node}): residual {r.tensor} shape {ctx.shape(r)} != out {(batch, out_features)}")
        operands[name] = ctx.arena(task, r.tensor)
    if mxfp4:
        operands["scale"] = ctx.weight(s2.tensor)
    return OpVariant("expert_combine", params), operands


def _mla_latent(task: GraphTask, ctx: _Context) -> Lowered:
    """The latent task writes the cache row itself (the template fuses the cache write)."""
    x, norm_w = task.args
    (out,) = task.results
    writers = [n for n in ctx.graph.nodes if n.op.name == "mla_cache_write" and n.inputs[1] == out.tensor]
    if len(writers) != 1 or any(out.tensor in n.inputs for n in ctx.graph.nodes if n.op.name != "mla_cache_write"):
        raise EmitError(f"task t{task.id} ({task.node}): mla_latent must feed exactly one mla_cache_write and nothing else")
    cache, _, positions = writers[0].inputs
    begin, count = _rows(task, out, ctx)
    batch, max_len, width = ctx.graph.tensors[cache].shape
    rank = task.op.kv_lora_rank
    params = MlaLatentParams(kv_lora_rank=rank, rope_dim=width - rank, max_len=max_len, batch=batch, eps=task.op.eps)
    operands = {"x": ctx.arena(task, x.tensor), "positions": ctx.offsets[positions], "norm_weight": ctx.weight(norm_w.tensor),
                "cache": ctx.state(task, cache), "batch_begin": begin, "batch_count": count}  # fmt: skip
    return OpVariant("mla_latent", params), operands


def _mla_cache_write(task: GraphTask, ctx: _Context) -> Lowered:
    """Done by the mla_latent task (above); this task only keeps the events."""
    _, _, positions = task.args
    ctx.io_dtype(task, positions)
    return OpVariant("nop", NopParams()), {}


def _mla_q_absorb(task: GraphTask, ctx: _Context) -> Lowered:
    x, kv_b = task.args
    (out,) = task.results
    batch, heads, width = ctx.shape(out)
    rank = ctx.shape(kv_b)[1]
    h0, h1 = task.tile["heads"]
    c0, c1 = task.tile.get("columns", (0, rank))
    whole = (c0, c1) == (0, rank)
    if out.boxes[0] != ((0, batch), (h0, h1), (c0, width if c1 == rank else c1)) or not (whole or h1 - h0 == 1):
        raise EmitError(f"task t{task.id} ({task.node}): mla_q_absorb tiles heads (or one head's q_lat columns) of all requests, the tile is {out.text()}")
    op = task.op
    params = MlaQAbsorbParams(num_heads=heads, qk_nope=op.qk_nope, qk_rope=width - rank, v_dim=op.v_dim, kv_lora_rank=rank, batch=batch,
                              columns=0 if whole else c1 - c0)  # fmt: skip
    operands = {"x": ctx.arena(task, x.tensor), "out": ctx.arena(task, out.tensor), "weight": ctx.weight(kv_b.tensor),
                "head_begin": h0, "head_count": h1 - h0, "column_begin": c0}  # fmt: skip
    return OpVariant("mla_q_absorb", params), operands


def _mla_decode(task: GraphTask, ctx: _Context) -> Lowered:
    q, cache, positions = task.args
    o, lse = task.results
    batch, num_chunks, heads, rank = ctx.shape(o)
    _, max_len, width = ctx.shape(cache)
    b, c = task.tile["request"], task.tile["chunk"]
    h0, h1 = task.tile.get("heads", (0, heads))
    group = mla_decode_group_heads(batch)
    if o.boxes[0] != ((b, b + 1), (c, c + 1), (h0, h1), (0, rank)) or h1 - h0 > group:
        raise EmitError(f"task t{task.id} ({task.node}): mla_decode takes one (request, chunk) of <= {group} heads, the tile stores {o.text()}")
    ctx.io_dtype(task, positions)
    op = task.op
    params = MlaDecodeParams(num_heads=heads, kv_lora_rank=rank, rope_dim=width - rank, max_len=max_len, batch=batch,
                             num_chunks=num_chunks, min_chunk_rows=op.min_chunk_rows, scale=op.scale, group_heads=group)  # fmt: skip
    operands = {"q": ctx.arena(task, q.tensor), "positions": ctx.arena(task, positions.tensor), "out": ctx.arena(task, o.tensor),
                "lse": ctx.arena(task, lse.tensor), "cache": ctx.state(task, cache.tensor), "request": b, "chunk": c,
                "head_begin": h0, "head_count": h1 - h0}  # fmt: skip
    return OpVariant("mla_decode", params), operands


def _mla_v_up(task: GraphTask, ctx: _Context) -> Lowered:
    o, lse, kv_b = task.args
    (out,) = task.results
    batch, num_chunks, heads, rank = ctx.shape(o)
    h0, h1 = task.tile["heads"]
    v0, v1 = task.tile.get("values", (0, task.op.v_dim))
    op = task.op
    whole = (v0, v1) == (0, op.v_dim)
    if out.boxes[0] != ((0, batch), (h0 * op.v_dim + v0, (h1 - 1) * op.v_dim + v1)) or not (whole or h1 - h0 == 1):
        raise EmitError(f"task t{task.id} ({task.node}): mla_v_up tiles heads (or one head's output rows) of all requests, the tile is {out.text()}")
    params = MlaVUpParams(num_heads=heads, qk_nope=op.qk_nope, v_dim=op.v_dim, kv_lora_rank=rank, batch=batch, num_chunks=num_chunks)
    operands = {"o": ctx.arena(task, o.tensor), "lse": ctx.arena(task, lse.tensor), "out": ctx.arena(task, out.tensor),
                "weight": ctx.weight(kv_b.tensor), "head_begin": h0, "head_count": h1 - h0, "value_begin": v0, "value_count": v1 - v0}  # fmt: skip
    return OpVariant("mla_v_up", params), operands


# --- tensor parallelism


def _collective_params(task: GraphTask, ctx: _Context) -> CollectiveParams:
    """all_reduce / all_gather of a [rows, cols] operand (all_gather along cols: the shapes tp_shard makes)."""
    (x,) = task.args
    shape = ctx.shape(x)
    if len(shape) != 2 or getattr(task.op, "dim", 1) != 1:
        raise EmitError(f"task t{task.id} ({task.node}): {task.op.describe()} of a {list(shape)} operand; the megakernel "
                        f"exchanges [rows, cols] operands (all_gather along cols)")  # fmt: skip
    allowed = ("bfloat16",) if task.op.name == "all_reduce" else ("bfloat16", "float32", "int32")
    return CollectiveParams(task.op.ranks, shape[0], shape[1], ctx.dtype(task, x, allowed))


def _comm_layout(tg: TaskGraph, ctx: _Context, pointer: int) -> _CommLayout | None:
    """The comm region of a tensor-parallel task graph (module docstring); None without collectives."""
    tasks = [t for t in tg.tasks if t.op is not None and t.op.name in COLLECTIVE_OPS]
    if not tasks:
        return None
    slots_offset = CommSpec(tasks[0].op.ranks, len(tasks), 0).slots_offset
    slots: dict[str, int] = {}
    end = slots_offset
    for t in tasks:
        if t.node not in slots:
            params = _collective_params(t, ctx)
            slots[t.node] = end
            end += params.ranks * params.slot_bytes
    spec = CommSpec(tasks[0].op.ranks, len(tasks), end - slots_offset)
    return _CommLayout(spec, pointer, slots, {t.id: i for i, t in enumerate(tasks)})


def _collective(task: GraphTask, ctx: _Context) -> Lowered:
    """Columns [c0, c1) of every row (passes/tile.py): all_reduce stores them, all_gather their copy in
    every rank's block of the result."""
    p = _collective_params(task, ctx)
    (x,), (out,) = task.args, task.results
    (box,) = x.boxes
    c0, c1 = box[1]
    stored = (box,) if task.op.name == "all_reduce" else tuple(((0, p.rows), (q * p.cols + c0, q * p.cols + c1)) for q in range(p.ranks))
    if box[0] != (0, p.rows) or out.boxes != stored:
        raise EmitError(f"task t{task.id} ({task.node}): {task.op.name} takes columns of every row, the tile is {x.text()} -> {out.text()}")
    ctx.dtype(task, out, (p.dtype,))
    comm = ctx.comm
    operands = {"x": ctx.arena(task, x.tensor), "out": ctx.arena(task, out.tensor), "rank": ctx.offsets[TP_RANK],
                "comm": comm.pointer, "comm_event": comm.events[task.id], "comm_offset": comm.slots[task.node],
                "comm_half": comm.spec.half, "col_begin": c0, "col_count": c1 - c0}  # fmt: skip
    return OpVariant(task.op.name, p), operands


def _shard_slice(task: GraphTask, ctx: _Context) -> Lowered:
    x, rank = task.args
    (out,) = task.results
    shape = ctx.shape(x)
    if len(shape) != 2 or task.op.dim != 1:
        raise EmitError(f"task t{task.id} ({task.node}): shard_slice of a {list(shape)} tensor along dim {task.op.dim}; the megakernel slices [rows, cols] along cols")
    ctx.whole(task, x)
    ctx.whole(task, out)
    params = ShardSliceParams(rows=shape[0], cols=shape[1], parts=task.op.parts, dtype=ctx.dtype(task, x))
    return OpVariant("shard_slice", params), {"x": ctx.arena(task, x.tensor), "out": ctx.arena(task, out.tensor), "rank": ctx.arena(task, rank.tensor)}


def _argmax_combine(task: GraphTask, ctx: _Context) -> Lowered:
    values, indices = task.args
    (out,) = task.results
    for a in (values, indices, out):
        ctx.whole(task, a)
    batch, ranks = ctx.shape(values)
    ctx.dtype(task, values, ("float32",))
    ctx.dtype(task, indices, ("int32",))
    ctx.dtype(task, out, ("int32",))
    params = ArgmaxCombineParams(ranks=ranks, batch=batch, shard_size=task.op.shard_size)
    operands = {"values": ctx.arena(task, values.tensor), "indices": ctx.arena(task, indices.tensor), "out": ctx.arena(task, out.tensor)}
    return OpVariant("argmax_combine", params), operands


LOWER: dict[str, Callable[[GraphTask, _Context], Lowered]] = {
    **dict.fromkeys(("linear", "rmsnorm_linear", "linear_residual", "gated_linear", "linear_sigmoid_gate", "linear_kda_gate",
                     "linear_gated_rmsnorm"), _gemv),  # fmt: skip
    "rmsnorm": _rmsnorm,
    "embedding": _embedding,
    "argmax": _argmax,
    "add": _add,
    "kda_conv": _kda_conv,
    "kda_recurrence": _kda_recurrence,
    "attn_res": _attn_res,
    "router": _router,
    "router_topk": _router_topk,
    "expert_gated_linear": _expert_gated,
    "expert_gated_linear_mxfp4": _expert_gated,
    "expert_linear_combine": _expert_combine,
    "expert_linear_mxfp4_combine": _expert_combine,
    "mla_latent": _mla_latent,
    "mla_cache_write": _mla_cache_write,
    "mla_q_absorb": _mla_q_absorb,
    "mla_decode": _mla_decode,
    "mla_v_up": _mla_v_up,
    "all_reduce": _collective,
    "all_gather": _collective,
    "shard_slice": _shard_slice,
    "argmax_partial": _argmax,
    "argmax_combine": _argmax_combine,
}




# --------------------------------------------------------------------------------------------
# the pass


@dataclass
class EmittedTable:
    """The pass's result: what it was emitted from, the table, and the file bytes."""

    task_graph: TaskGraph
    table: TaskTable
    data: bytes
    graph_lists: list[list[int]]  # per table list, the TaskGraph task of each table task (folded tasks have none)

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
                waits = " ".join([f"wait(e{e})" for e in task.wait] + ([f"weights_wait(e{task.weight_wait})"] if task.weight_wait is not None else []))
                signal = f" signal(e{task.signal})" if task.signal is not None else ""
                ops = " ".join(f"{k}={v}" for k, v in task.operands.items())
                lines.append(f"sm{s}#{i} {task.label}: op{task.opcode} {ops} {waits}{signal}".rstrip())
        return "\n".join(lines) + "\n"


_ROLE = {Role.INPUT: "input", Role.OUTPUT: "output"}


def _buffer_dtype(tensor) -> str:
    """Integer step inputs are int32 in the arena (the runtime converts the IR's int64 token ids / positions)."""
    name = dtype_name(tensor.dtype)
    return "int32" if tensor.role == Role.INPUT and name == "int64" else name


def state_layout(name: str) -> str:
    """The documented layout of a decode state, by its name (compiler/capture.py names them)."""
    if name.endswith("conv_state"):
        return "[batch, conv_size-1, 3*P] bf16: the last conv_size-1 inputs of q | k | v channels, oldest first"
    if name.endswith("recurrent_state"):
        return "[batch, H, D(v), D(k)] fp32: KDA delta-rule state S[b, h] (row v, column k)"
    if name.endswith("kv_cache"):
        return "[batch, max_context, kv_lora_rank + rope] bf16: row t = rmsnorm(c_kv_t) || k_pe_t (MLA latent cache)"
    return ""


def _io_offsets(tg: TaskGraph) -> tuple[dict[str, int], int]:
    """Arena offsets for the step inputs and outputs tasks touch, after the activations."""
    offsets: dict[str, int] = {}
    end = tg.arena_bytes
    touched = {r.tensor for t in tg.tasks for r in (*t.reads, *t.writes)}
    touched = sorted(touched | ({TP_RANK} & set(tg.graph.tensors)))  # collectives read it undeclared: no task writes it
    for name in touched:
        tensor = tg.graph.tensors[name]
        if name in tg.arena or tensor.role not in (Role.INPUT, Role.OUTPUT):
            continue
        offsets[name] = end = -(-end // IO_ALIGN) * IO_ALIGN
        end += tensor.nbytes
    return offsets, end


def emit_task_table(tg: TaskGraph, target: Any = None) -> EmittedTable:
    """Lower every task (module docstring); raise EmitError for what format 3 cannot express."""
    listed = sorted(t for ts in tg.sm_lists for t in ts)
    if listed != list(range(len(tg.tasks))):
        raise EmitError("every task must be on exactly one SM list: run the schedule pass first")
    unsupported = Counter(t.op.name if t.op is not None else "<no recipe>" for t in tg.tasks if t.op is None or t.op.name not in LOWER)
    if unsupported:
        kinds = ", ".join(f"{n} ({c} tasks)" for n, c in sorted(unsupported.items()))
        raise EmitError(f"task table format 3 has no op kind for: {kinds}")
    if [e.id for e in tg.events] != list(range(len(tg.events))):
        raise EmitError("event ids must be 0..n-1 in order (run build_events)")
    graph = tg.graph
    io, arena_bytes = _io_offsets(tg)
    offsets = {**{n: o for n, (o, _) in tg.arena.items()}, **io}
    # The router's results (expert ids and weights, a few bytes per layer) get slots of their own after the
    # io, never reused, so the experts a step chose can be read back after it (tests, diagnostics). Moving a
    # tensor to bytes nothing else touches cannot add a hazard; the events stay as they are.
    for name in sorted({r.tensor for t in tg.tasks if t.op is not None and t.op.name in ("router", "router_topk") for r in t.results}):
        offsets[name] = arena_bytes = -(-arena_bytes // IO_ALIGN) * IO_ALIGN
        arena_bytes += graph.tensors[name].nbytes
    weights = sorted(t.name for t in graph.by_role(Role.WEIGHT))
    states = sorted(t.name for t in graph.by_role(Role.STATE))
    ctx = _Context(graph, offsets, {n: i for i, n in enumerate(weights)}, {n: len(weights) + i for i, n in enumerate(states)})
    ctx.comm = _comm_layout(tg, ctx, len(weights) + len(states))
    expected = {e.id: e.expected for e in tg.events}
    folds = _router_folds(tg)
    folded = {f.topk for f in folds}
    tile_fold = {i: f for f in folds for i in f.tiles}
    waits_on = {f.arrivals: f.logits_event for f in folds}  # the folded tasks' waiters wait on the logits event
    variants: dict[OpVariant, int] = {}
    lists: list[list[Task]] = []
    graph_lists = [[i for i in ids if i not in folded] for ids in tg.sm_lists]
    for ids in tg.sm_lists:
        tasks = []
        staged = None  # (opcode, x tensor, norm weight) of the gemv before this task in the list, if it was one
        for i in ids:
            task = tg.tasks[i]
            if i in folded:
                continue
            if len(task.signals) > 1 or len(task.waits) > 2:
                raise EmitError(f"task t{i} ({task.node}) waits on {len(task.waits)} events and signals {len(task.signals)}: format 3 allows 2 and 1")
            for e, count in task.waits:
                if count != expected[e]:
                    raise EmitError(f"task t{i} ({task.node}) waits for {count} signals of e{e}, which has {expected[e]} producers")
            variant, operands = LOWER[task.op.name](task, ctx)
            if i in tile_fold:
                variant, operands = _router_tile(task, (variant, operands), tile_fold[i], tg, ctx)
            opcode = variants.setdefault(variant, len(variants))
            if variant.op == "gemv":
                # the input the previous task staged in the op smem is this task's (same variant, same SSA tensor: the
                # same values): it is not staged again (gemv.py.j2). Only what ran just before on this CTA qualifies.
                key = (opcode, _gemv_x(task.op.name, task.args).tensor, operands.get("norm_weight"))
                if key == staged:
                    operands["x_staged"] = 1
                staged = key
            else:
                staged = None
            for e, count in task.weight_waits:
                if count != expected[e]:
                    raise EmitError(f"task t{i} ({task.node})'s weights wait for {count} signals of e{e}, which has {expected[e]} producers")
            weight_wait = waits_on.get(task.weight_waits[0][0], task.weight_waits[0][0]) if task.weight_waits else None
            waits = tuple(dict.fromkeys(waits_on.get(e, e) for e, _ in task.waits))
            tasks.append(Task(opcode, operands, waits, task.signals[0] if task.signals else None, f"t{i} {task.node}", weight_wait))
        lists.append(tasks)
    table = TaskTable(
        variants=list(variants),
        lists=lists,
        events=[Event(f"e{e.id} {tg.tasks[e.producers[0]].node}{' arrivals' if e.id in waits_on else ''}" if e.producers else f"e{e.id}")
                for e in tg.events],  # fmt: skip
        weights=[WeightSpec(n, dtype_name(graph.tensors[n].dtype), graph.tensors[n].shape) for n in weights],
        buffers=[
            BufferSpec(n, o, _buffer_dtype(graph.tensors[n]), graph.tensors[n].shape, _ROLE.get(graph.tensors[n].role, "activation"))
            for n, o in sorted(offsets.items(), key=lambda kv: (kv[1], kv[0]))
        ],
        arena_bytes=arena_bytes,
        states=[StateSpec(n, dtype_name(graph.tensors[n].dtype), graph.tensors[n].shape, state_layout(n)) for n in states],
        comm=ctx.comm.spec if ctx.comm else None,
    )
    return EmittedTable(tg, table, table.encode(), graph_lists)
