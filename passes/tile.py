"""tile: the sharded, fused IR graph -> a TaskGraph of SM-sized tasks (DESIGN.md, "The megakernel
execution model"; spec 12 for the per-layer structure).

Guarantees to plan_memory and build_events:
- tasks come in graph node order with ids 0..n-1, so id order is a topological order of the data flow;
- every task has a recipe (`op`, `args`, `results`, ir/tasks.py) and its `reads` / `writes` are exactly
  the regions that recipe touches (weights are never regions: they are read-only and bound by name);
- the tasks of a node write every element of each node output exactly once (disjoint boxes that
  cover it), and no task reads what another task of its own node writes, so a node's tasks may run in
  any order and at once;
- `weight_bytes` (what the task streams from HBM: for a routed expert, ONE expert's rows per batch
  row) and `flops` feed the scheduler's cost model.
Every op kind in `ir.ops.OPS` has a rule in `RULES`; a kind without one is an error naming it.

Sizing (prior art 5.4): a GEMV-like node is cut into row tiles that stream 32 KB - 1 MB of weights each,
and into enough tiles to give every SM work when the matrix allows (a multiple of the SM count when it
is large). Row tiles come in multiples of 8 rows (ROW_GRANULE), except a GEMV's or an expert combine's where that
would leave the stage's busiest SM a quarter more rows than tiles of any rows (`stage_rows`). Head-structured
ops tile by heads (the KDA recurrence also by value rows of a head, whose state rows are independent),
MLA decode by (request, KV chunk), routed experts by (routing slot, rows), row-wise reductions (norms,
attention residual mix, argmax) by batch row, elementwise ops and collectives by column chunks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from k3mk.ir import fused  # noqa: F401  (registers the fused op kinds, so OPS is complete)
from k3mk.ir.graph import Graph, Node, Role, Tensor
from k3mk.ir.ops import OPS
from k3mk.ir.tasks import Box, Operand, Region, Task, TaskGraph

MIN_TILE_BYTES = 32 * 1024  # below this a task's fixed costs (dispatch, event hand-off) dominate
# Above this one SM streams too long while others could help. A task costs ~2-3 us beyond its bytes (its wait,
# prologue, epilogue, release; cold code after another variant): tiles of up to 1 MB instead of 256 KB took the
# bf16 K3 proxy's step from 13.2 to 11.5 ms (BENCHMARKS.md 2026-12-01, night), its work still spread over every SM.
MAX_TILE_BYTES = 1024 * 1024
ROW_GRANULE = 8  # rows per tile come in multiples of 8 (16-byte aligned bf16 tiles, whole row groups from batch 4)
# A GEMV's or combine's tiles take any rows where multiples of 8 would load the busiest SM this much more: Kimi Linear's
# 2304 rows on 132 SMs are 96 tiles of 24 rounded (36 SMs idle in the stage) against 128 of 18 (-0.6 to -1.3% a step on
# an H100, 2026-12-07); the K3 proxy's tiles (<= 14% more) stay rounded: any rows there cost 1.8% (b1) to 6% (b4).
UNROUNDED_GAIN = 1.25
COLUMN_GRANULE = 64  # elementwise chunks: whole 128-byte lines of bf16
ELEMENTWISE_BYTES = 16 * 1024  # output bytes per elementwise / collective task
MIN_STATE_ROWS = 16  # KDA recurrence: fewest value rows of a head per task
MIN_V_UP_ROWS = 32  # MLA v_up: fewest output rows of a head per task (each task merges the head's chunks again)
MIN_Q_ABSORB_COLUMNS = 128  # MLA q_absorb: fewest q_lat columns of a head per task (256 contiguous bytes of a W_UK row)


class TileError(ValueError):
    """A node that cannot be tiled: names the node and why."""


# --- boxes and counts ------------------------------------------------------------------------------------


def full(shape: tuple[int, ...]) -> Box:
    return tuple((0, s) for s in shape)


def sub(shape: tuple[int, ...], ranges: dict[int, tuple[int, int]]) -> Box:
    """The box of `shape` that is `ranges[d]` along the dims given and whole along the others."""
    return tuple(ranges.get(d, (0, s)) for d, s in enumerate(shape))


def task_count(total_bytes: int, num_sms: int) -> int:
    """How many tasks share streaming `total_bytes`: each 32 KB - 1 MB, all SMs busy when there is enough."""
    if total_bytes < MIN_TILE_BYTES * num_sms:
        return max(1, total_bytes // MIN_TILE_BYTES)
    n = max(num_sms, math.ceil(total_bytes / MAX_TILE_BYTES))
    return math.ceil(n / num_sms) * num_sms


def split(n: int, parts: int, granule: int = 1) -> list[tuple[int, int]]:
    """[0, n) in equal pieces of a multiple of `granule` (the last may be shorter), at most `parts` of them."""
    size = max(granule, math.ceil(math.ceil(n / max(parts, 1)) / granule) * granule)
    return [(lo, min(n, lo + size)) for lo in range(0, n, size)]


def stage_rows(n: int, parts: int, num_sms: int) -> list[tuple[int, int]]:
    """A GEMV's or expert combine's row tiles: `split` in multiples of ROW_GRANULE, or of any rows where the node has
    work for every SM and the rounded tiles give the stage's busiest SM (ceil(tiles / SMs) of the largest)
    UNROUNDED_GAIN times the rows. A smaller node keeps its fewer, rounded tiles: more tasks of a few rows each cost
    their fixed parts (the K3 proxy's 96-row KDA projections as 32 tiles of 3 rows instead of 12 of 8)."""
    rounded, fine = split(n, parts, ROW_GRANULE), split(n, parts)
    if parts < num_sms:
        return rounded

    def busiest(tiles: list[tuple[int, int]]) -> int:
        return math.ceil(len(tiles) / num_sms) * max(hi - lo for lo, hi in tiles)

    return fine if busiest(rounded) >= UNROUNDED_GAIN * busiest(fine) else rounded


def split_heads(n: int, parts: int, head: int) -> list[tuple[int, int]]:
    """Like `split`, but every piece lies within one head of `head` rows or covers whole heads."""
    size = max(1, math.ceil(n / max(parts, 1)))
    if size >= head:
        size = math.ceil(size / head) * head
    else:
        size = min(d for d in range(size, head + 1) if head % d == 0 and (d % ROW_GRANULE == 0 or d == head))
    return [(lo, min(n, lo + size)) for lo in range(0, n, size)]


# --- building tasks --------------------------------------------------------------------------------------


@dataclass
class Context:
    """What the rules see: the graph, the SM count, each tensor's readers; builds the tasks."""

    graph: Graph
    num_sms: int
    consumers: dict[str, list[Node]]
    full_boxes: dict[str, Box] = field(default_factory=dict)

    def full_box(self, name: str) -> Box:
        box = self.full_boxes.get(name)
        if box is None:
            box = self.full_boxes[name] = full(self.graph.tensors[name].shape)
        return box

    def tensor(self, name: str) -> Tensor:
        return self.graph.tensors[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.graph.tensors[name].shape

    def is_weight(self, name: str) -> bool:
        return self.graph.tensors[name].role == Role.WEIGHT

    def box_bytes(self, name: str, box: Box) -> int:
        t = self.graph.tensors[name]
        return math.prod(hi - lo for lo, hi in box) * t.dtype.itemsize

    def task(
        self,
        node: Node,
        tile: dict[str, Any],
        args: dict[int, Box | Operand] | None = None,
        results: list[Box | Operand] | None = None,
        op: Any = None,
        weight_bytes: int | None = None,
        flops: int | None = None,
    ) -> Task:
        """A task of `node` evaluating `op` (default: the node's) on its inputs, where `args` overrides
        the box of input i (default: all of it), storing `results[j]` of output j (default: all of it).
        Default weight bytes: the weight boxes it reads; default flops: 4 per element written."""
        operands = []
        for i, name in enumerate(node.inputs):
            a = args.get(i) if args else None
            a = self.full_box(name) if a is None else a
            operands.append(a if isinstance(a, Operand) else Operand(name, (a,)))
        outs = []
        for j, name in enumerate(node.outputs):
            r = self.full_box(name) if results is None else results[j]
            outs.append(r if isinstance(r, Operand) else Operand(name, (r,)))
        reads = tuple(r for a in operands if not self.is_weight(a.tensor) for r in a.regions())
        writes = tuple(r for a in outs for r in a.regions())
        if weight_bytes is None:
            weight_bytes = sum(self.box_bytes(a.tensor, b) for a in operands if self.is_weight(a.tensor) for b in a.boxes)
        if flops is None:
            flops = 4 * sum(math.prod(hi - lo for lo, hi in r.box) for r in writes)
        return Task(-1, node.name, tile, reads, writes, weight_bytes, flops, op=op or node.op, args=tuple(operands), results=tuple(outs))


Rule = Callable[[Context, Node], list[Task]]
RULES: dict[str, Rule] = {}


def rule(*kinds: str):
    def register(fn: Rule) -> Rule:
        for k in kinds:
            RULES[k] = fn
        return fn

    return register


# --- GEMV family: output row tiles, every tile reads the whole input row(s) --------------------------------


def _gemv_rows(
    ctx: Context,
    node: Node,
    weights: list[int],
    columns: tuple[int, ...] = (),
    head: int | None = None,
    extra: Callable[[tuple[int, int]], tuple[dict[int, Box], Box | Operand, Any]] | None = None,
) -> list[Task]:
    """Row tiles of a GEMV-like node: weights `weights` ([out, ...] each) by rows, the activation operands
    `columns` ([B, out] each, e.g. residuals) by the same columns, the output [B, out] by columns. `head`:
    tiles lie within one head or cover whole heads. `extra(rows)` gives (more arg boxes, the output box,
    the op) where the output or attributes are not simply by columns."""
    w0 = node.inputs[weights[0]]
    rows = ctx.shape(w0)[0]
    row_bytes = sum(ctx.tensor(node.inputs[w]).nbytes for w in weights) // rows
    parts = task_count(rows * row_bytes, ctx.num_sms)
    tiles = split_heads(rows, parts, head) if head else stage_rows(rows, parts, ctx.num_sms)
    batch = ctx.shape(node.inputs[0])[0]
    in_features = ctx.tensor(w0).numel // rows
    out = node.outputs[0]
    tasks = []
    for r in tiles:
        args: dict[int, Box] = {w: sub(ctx.shape(node.inputs[w]), {0: r}) for w in weights}
        args.update({c: sub(ctx.shape(node.inputs[c]), {1: r}) for c in columns})
        result, op = sub(ctx.shape(out), {1: r}), None
        if extra is not None:
            more, result, op = extra(r)
            args.update(more)
        tasks.append(
            ctx.task(node, {"rows": r}, args, [result], op=op, weight_bytes=(r[1] - r[0]) * row_bytes,
                     flops=2 * batch * (r[1] - r[0]) * in_features * len(weights))  # fmt: skip
        )
    return tasks


def _prologue(node: Node) -> int:
    """Inputs in the leading list operand of a norm-prologue kind: [x] or [x, norm_weight]."""
    return node.op.num_list_inputs(len(node.inputs))


@rule("linear", "rmsnorm_linear")
def _linear(ctx: Context, node: Node) -> list[Task]:
    return _gemv_rows(ctx, node, [len(node.inputs) - 1])


@rule("gated_linear")
def _gated_linear(ctx: Context, node: Node) -> list[Task]:
    n = _prologue(node)
    return _gemv_rows(ctx, node, [n, n + 1])


@rule("linear_residual")
def _linear_residual(ctx: Context, node: Node) -> list[Task]:
    return _gemv_rows(ctx, node, [len(node.inputs) - 1], columns=tuple(range(len(node.inputs) - 2)))


@rule("linear_sigmoid_gate")
def _linear_sigmoid_gate(ctx: Context, node: Node) -> list[Task]:
    n = _prologue(node)
    return _gemv_rows(ctx, node, [n], columns=(n + 1,))


@rule("linear_gated_rmsnorm")
def _linear_gated_rmsnorm(ctx: Context, node: Node) -> list[Task]:
    """Any rows: the RMS is over a head of o, an input, so a tile reads the whole heads of o its rows lie
    in and streams only its rows of the gate weight. Its CPU recipe evaluates those whole heads and
    stores its rows (the op's semantics normalize whole heads)."""
    n = _prologue(node)
    head = node.op.head_dim
    weight, o, out = node.inputs[n], node.inputs[n + 1], node.outputs[0]

    def extra(r: tuple[int, int]):
        heads = (r[0] // head * head, math.ceil(r[1] / head) * head)
        args = {n: sub(ctx.shape(weight), {0: heads}), n + 1: sub(ctx.shape(o), {1: heads})}
        batch = ctx.shape(out)[0]
        part = ((0, batch), (r[0] - heads[0], r[1] - heads[0]))
        return args, Operand(out, (sub(ctx.shape(out), {1: r}),), part=part), None

    return _gemv_rows(ctx, node, [n], extra=extra)


@rule("linear_kda_gate")
def _linear_kda_gate(ctx: Context, node: Node) -> list[Task]:
    """Output g [B, H, D]: a tile within head h writes g[:, h, d0:d1], a tile of whole heads g[:, h0:h1, :]."""
    n = _prologue(node)
    out_shape = ctx.shape(node.outputs[0])
    head = out_shape[2]

    def extra(r: tuple[int, int]):
        h0, h1 = r[0] // head, math.ceil(r[1] / head)
        inner = (r[0] - h0 * head, r[1] - h0 * head) if h1 - h0 == 1 else (0, head)
        args = {n + 1: ((h0, h1),), n + 2: (r,)}  # A_log per head, dt_bias per row
        return args, sub(out_shape, {1: (h0, h1), 2: inner}), replace(node.op, num_heads=h1 - h0)

    return _gemv_rows(ctx, node, [n], head=head, extra=extra)


@rule("router", "router_topk", "argmax_combine", "shard_slice")
def _one_task(ctx: Context, node: Node) -> list[Task]:
    """One task: top-k needs every logit of a row (ir/fused.py: the router does not tile), the others
    are tiny. NOTE the fused router streams its whole E x d gate matrix on ONE SM: 12.8 MB at K3 widths,
    ~0.2 ms per MoE layer at one SM's share of HBM bandwidth; tiling the logits GEMV apart from the
    top-k (a fusion choice) would spread it over the SMs."""
    return [ctx.task(node, {})]


# --- routed experts ------------------------------------------------------------------------------------


def _expert_row_bytes(ctx: Context, node: Node, weights: list[int]) -> int:
    """Bytes of one output row of ONE expert, over the weight operands ([E, out, ...] each)."""
    return sum(ctx.tensor(node.inputs[w]).nbytes // math.prod(ctx.shape(node.inputs[w])[:2]) for w in weights)


@rule("expert_linear", "expert_linear_mxfp4", "expert_gated_linear", "expert_gated_linear_mxfp4")
def _expert_slots(ctx: Context, node: Node) -> list[Task]:
    """(x, *weights [E, n, ...], ids [B, k]) -> [B, k, n]: tasks per (routing slot j, row tile). A task
    reads ids[:, j] (its dependency on the router) and, per batch row, streams its rows of the chosen
    expert. x is [B, in] (shared by the slots) or [B, k, in] (slot j's row)."""
    weights = list(range(1, len(node.inputs) - 1))
    ids = len(node.inputs) - 1
    batch, k = ctx.shape(node.inputs[ids])
    rows = ctx.shape(node.inputs[1])[1]
    row_bytes = _expert_row_bytes(ctx, node, weights) * batch
    # rounded down: k * per_slot tasks never exceed the count that spreads evenly over the SMs (the K3 proxy's 16 slots
    # of 264 / 16 -> 17 tiles were 272 tasks, 8 SMs streaming three where the rest stream two)
    per_slot = max(1, task_count(rows * row_bytes * k, ctx.num_sms) // k)
    x_shape = ctx.shape(node.inputs[0])
    in_features = x_shape[-1]
    tasks = []
    for j in range(k):
        for r in split(rows, per_slot, ROW_GRANULE):
            args = {w: sub(ctx.shape(node.inputs[w]), {1: r}) for w in weights}
            args[ids] = sub((batch, k), {1: (j, j + 1)})
            if len(x_shape) == 3:
                args[0] = sub(x_shape, {1: (j, j + 1)})
            out = sub(ctx.shape(node.outputs[0]), {1: (j, j + 1), 2: r})
            tasks.append(
                ctx.task(node, {"slot": j, "rows": r}, args, [out], weight_bytes=(r[1] - r[0]) * row_bytes,
                         flops=2 * batch * (r[1] - r[0]) * in_features * len(weights))  # fmt: skip
            )
    return tasks


@rule("expert_linear_combine", "expert_linear_mxfp4_combine")
def _expert_combine(ctx: Context, node: Node) -> list[Task]:
    """(*residuals [B, out], a [B, k, in], *weights [E, out, ...], ids, routing weights) -> [B, out]: row
    tiles covering ALL slots (the fp32 sum over slots stays in one task), so a tile streams its rows of
    B*k experts; a tile reads its columns of every residual."""
    n = node.op.num_list_inputs(len(node.inputs))
    weights = list(range(n + 1, len(node.inputs) - 2))
    batch, k, in_features = ctx.shape(node.inputs[n])
    rows = ctx.shape(node.inputs[n + 1])[1]
    row_bytes = _expert_row_bytes(ctx, node, weights) * batch * k
    tasks = []
    for r in stage_rows(rows, task_count(rows * row_bytes, ctx.num_sms), ctx.num_sms):
        args = {w: sub(ctx.shape(node.inputs[w]), {1: r}) for w in weights}
        args.update({i: sub(ctx.shape(node.inputs[i]), {1: r}) for i in range(n)})
        out = sub(ctx.shape(node.outputs[0]), {1: r})
        tasks.append(
            ctx.task(node, {"rows": r}, args, [out], weight_bytes=(r[1] - r[0]) * row_bytes,
                     flops=2 * batch * k * (r[1] - r[0]) * in_features)  # fmt: skip
        )
    return tasks


# --- attention ---------------------------------------------------------------------------------------


def _head_groups(ctx: Context, heads: int) -> list[tuple[int, int]]:
    """One head per task while there are SMs for them (a head streams 128-256 KB of kv_b at K3 sizes)."""
    return split(heads, ctx.num_sms)


@rule("mla_attention")
def _mla_attention(ctx: Context, node: Node) -> list[Task]:
    """Naive MLA (spec 4.2) per head group: q and kv_b rows of the group, the whole cache."""
    op = node.op
    q_head, kv_head = op.qk_nope + op.qk_rope, op.qk_nope + op.v_dim
    kv_b = node.inputs[3]
    tasks = []
    for h0, h1 in _head_groups(ctx, op.num_heads):
        args = {0: sub(ctx.shape(node.inputs[0]), {1: (h0 * q_head, h1 * q_head)}), 3: sub(ctx.shape(kv_b), {0: (h0 * kv_head, h1 * kv_head)})}
        out = sub(ctx.shape(node.outputs[0]), {1: (h0 * op.v_dim, h1 * op.v_dim)})
        tasks.append(ctx.task(node, {"heads": (h0, h1)}, args, [out], op=replace(op, num_heads=h1 - h0)))
    return tasks


@rule("mla_q_absorb", "mla_v_up")
def _mla_absorbed_heads(ctx: Context, node: Node) -> list[Task]:
    """Absorbed MLA pieces per head group (spec 4.3): q_absorb streams W_UK of its heads, v_up W_UV.
    Both read their rows of kv_b [H*(nope+v), rank]; the box spans a head's W_UK and W_UV rows, the
    weight bytes count only the half each streams."""
    op = node.op
    kv_b = node.inputs[-1]
    rank = ctx.shape(kv_b)[1]
    kv_head = op.qk_nope + op.v_dim
    streamed = op.qk_nope if node.op.name == "mla_q_absorb" else op.v_dim
    per_head = streamed * rank * ctx.tensor(kv_b).dtype.itemsize
    # With fewer heads than SMs a head goes to several tasks (Kimi Linear's 32 heads: 4 each, 128 SMs streaming
    # kv_b instead of 32): q_absorb's q_lat columns in equal widths (the template lays its threads out for one),
    # v_up's output rows (each task merges the head's chunks itself: o_lat is every row's input).
    if node.op.name == "mla_q_absorb":
        limit = max(1, min(ctx.num_sms // op.num_heads, rank // MIN_Q_ABSORB_COLUMNS))
        whole = rank
        pieces = split(rank, max(p for p in range(1, limit + 1) if p == 1 or rank % (p * ROW_GRANULE) == 0))
    else:
        whole = op.v_dim
        pieces = split(op.v_dim, max(1, min(ctx.num_sms // op.num_heads, op.v_dim // MIN_V_UP_ROWS)), ROW_GRANULE)
    out_shape = ctx.shape(node.outputs[0])
    tasks = []
    for h0, h1 in _head_groups(ctx, op.num_heads):
        for lo, hi in pieces:
            args = {len(node.inputs) - 1: sub(ctx.shape(kv_b), {0: (h0 * kv_head, h1 * kv_head)})}
            if node.op.name == "mla_q_absorb":
                q_shape = ctx.shape(node.inputs[0])
                q_head = q_shape[1] // op.num_heads
                args[0] = sub(q_shape, {1: (h0 * q_head, h1 * q_head)})
                c1 = out_shape[2] if hi == rank else hi  # the last columns' task copies q_pe
                out = sub(out_shape, {1: (h0, h1), 2: (lo, c1)})
                part = sub(out_shape, {1: (0, 1), 2: (lo, c1)})
                tile = {"heads": (h0, h1), "columns": (lo, hi)}
            else:
                args[0] = sub(ctx.shape(node.inputs[0]), {2: (h0, h1)})  # o [B, K, H, rank]
                args[1] = sub(ctx.shape(node.inputs[1]), {2: (h0, h1)})  # lse [B, K, H]
                out = sub(out_shape, {1: (h0 * op.v_dim + lo, (h1 - 1) * op.v_dim + hi)})
                part = sub(out_shape, {1: (lo, hi)})
                tile = {"heads": (h0, h1), "values": (lo, hi)}
            if (lo, hi) != (0, whole):  # the op computes the whole head; the task stores its part
                out = Operand(node.outputs[0], (out,), part=part)
            tasks.append(
                ctx.task(node, tile, args, [out], op=replace(op, num_heads=h1 - h0), weight_bytes=(h1 - h0) * per_head * (hi - lo) // whole,
                         flops=2 * ctx.shape(node.inputs[0])[0] * (h1 - h0) * streamed * rank * (hi - lo) // whole)  # fmt: skip
            )
    return tasks


def mla_decode_group_heads(batch: int) -> int:
    """Heads one mla_decode task holds (codegen/ops_moe_mla.py MAX_GROUP_HEADS: at most 16, the M rows of its score
    MMAs). At batch > 1, 16: the MMAs' rows are full and a KV chunk is read once per 16 heads (Kimi Linear b4 8K -2.1%,
    K3 proxy b4 -1.4 / -2.1%, bf16 proxy b4 -1.3 / -1.7%); at batch 1, 8: a layer's decode has the fewest (request,
    chunk) pairs, and 16-head tasks left SMs idle (K3 proxy b1 1K +1.3%, Kimi Linear b1 +0.4 / +0.6%; BENCHMARKS.md
    2026-12-03 afternoon)."""
    return 8 if batch == 1 else 16


def mla_decode_head_groups(heads: int, batch: int) -> list[tuple[int, int]]:
    """Head groups of one (request, chunk): as few as mla_decode_group_heads allows, of equal size where possible."""
    return split(heads, math.ceil(heads / mla_decode_group_heads(batch)))


@rule("mla_decode")
def _mla_decode(ctx: Context, node: Node) -> list[Task]:
    """Per (request b, KV chunk c, head group): the heads share the KV rows, so a task holds up to
    mla_decode_group_heads (Kimi Linear's 32 and K3's 96 heads are 4 and 12 groups at batch 1, 2 and 6 above,
    each re-reading the chunk's rows). The chunk bounds depend on the run-time position, so a task
    declares request b's whole cache; it evaluates every chunk of b and stores chunk c."""
    heads = ctx.shape(node.inputs[0])[1]
    batch, t_max, width = ctx.shape(node.inputs[1])
    o, lse = (ctx.shape(name) for name in node.outputs)
    chunks = node.op.num_chunks
    tasks = []
    for b in range(batch):
        for h0, h1 in mla_decode_head_groups(heads, batch):
            args = {i: sub(ctx.shape(name), {0: (b, b + 1)}) for i, name in enumerate(node.inputs)}
            args[0] = sub(ctx.shape(node.inputs[0]), {0: (b, b + 1), 1: (h0, h1)})
            for c in range(chunks):
                results = [
                    Operand(node.outputs[0], (sub(o, {0: (b, b + 1), 1: (c, c + 1), 2: (h0, h1)}),),
                            part=sub(o, {0: (0, 1), 1: (c, c + 1), 2: (0, h1 - h0)})),  # fmt: skip
                    Operand(node.outputs[1], (sub(lse, {0: (b, b + 1), 1: (c, c + 1), 2: (h0, h1)}),),
                            part=sub(lse, {0: (0, 1), 1: (c, c + 1), 2: (0, h1 - h0)})),  # fmt: skip
                ]
                rows = math.ceil(t_max / chunks)
                tile = {"request": b, "chunk": c, "heads": (h0, h1)}
                task = ctx.task(node, tile, args, results, flops=4 * (h1 - h0) * rows * width)
                # It declares request b's whole cache but reads only its chunk's rows (at full context).
                cache_bytes = rows * width * ctx.tensor(node.inputs[1]).dtype.itemsize
                task.activation_bytes = cache_bytes + sum(ctx.box_bytes(r.tensor, r.box) for r in task.writes) + ctx.box_bytes(node.inputs[0], args[0])
                tasks.append(task)
    return tasks


@rule("mla_latent", "mla_cache_write", "rmsnorm", "attn_res", "moe_combine", "embedding", "argmax", "argmax_partial")
def _batch_rows(ctx: Context, node: Node) -> list[Task]:
    """One task per batch row: the op reduces along a whole row (norms, the attention-residual mix,
    argmax, the slot sum) or touches one row (embedding, the cache row write). Every non-weight operand
    and result has the batch as its first dimension."""
    batch = ctx.shape(node.outputs[0])[0]
    row_weights = node.op.name == "embedding"  # one table row per token, chosen at run time
    tasks = []
    for b in range(batch):
        args = {i: sub(ctx.shape(name), {0: (b, b + 1)}) for i, name in enumerate(node.inputs) if not ctx.is_weight(name)}
        results = [sub(ctx.shape(o), {0: (b, b + 1)}) for o in node.outputs]
        weight_bytes = ctx.shape(node.inputs[0])[1] * ctx.tensor(node.inputs[0]).dtype.itemsize if row_weights else None
        task = ctx.task(node, {"batch": b}, args, results, weight_bytes=weight_bytes)
        if node.op.name == "mla_cache_write":  # declares request b's whole cache, moves one row
            row = ctx.shape(node.inputs[1])[1] * ctx.tensor(node.inputs[1]).dtype.itemsize
            task.activation_bytes = 2 * row
        tasks.append(task)
    return tasks


# --- KDA (spec 3.2) --------------------------------------------------------------------------------------


def _kda_heads(ctx: Context, node: Node) -> int | None:
    """The head count of the KDA layer a conv feeds: its recurrence's beta_logits [B, H]."""
    for reader in ctx.consumers.get(node.outputs[0], []):
        if reader.op.name == "kda_recurrence":
            return ctx.shape(reader.inputs[4])[1]
    return None


@rule("kda_conv")
def _kda_conv(ctx: Context, node: Node) -> list[Task]:
    """Per head's channels [c0, c1): q, k, v columns, the three matching channel pieces of the q|k|v
    conv state [B, W-1, 3P] (read and written in place), the taps of those channels. One task when no
    recurrence tells the head size."""
    channels = ctx.shape(node.inputs[0])[1]
    heads = _kda_heads(ctx, node) or 1
    state = ctx.shape(node.inputs[3])
    tasks = []
    for c in split(channels, heads):
        pieces = tuple(sub(state, {2: (g * channels + c[0], g * channels + c[1])}) for g in range(3))
        args: dict[int, Box | Operand] = {i: sub(ctx.shape(node.inputs[i]), {1: c}) for i in range(3)}
        args[3] = Operand(node.inputs[3], pieces, axis=2)
        args.update({i: sub(ctx.shape(node.inputs[i]), {0: c}) for i in range(4, 7)})
        results: list[Box | Operand] = [sub(ctx.shape(node.outputs[i]), {1: c}) for i in range(3)]
        results.append(Operand(node.outputs[3], pieces, axis=2))
        tasks.append(ctx.task(node, {"channels": c}, args, results))
    return tasks


@rule("kda_gate")
def _kda_gate(ctx: Context, node: Node) -> list[Task]:
    heads = node.op.num_heads
    f = ctx.shape(node.inputs[0])
    d = f[1] // heads
    tasks = []
    for h in range(heads):
        cols = (h * d, (h + 1) * d)
        args = {0: sub(f, {1: cols}), 1: ((h, h + 1),), 2: (cols,)}
        out = sub(ctx.shape(node.outputs[0]), {1: (h, h + 1)})
        tasks.append(ctx.task(node, {"head": h}, args, [out], op=replace(node.op, num_heads=1)))
    return tasks


@rule("kda_recurrence")
def _kda_recurrence(ctx: Context, node: Node) -> list[Task]:
    """Per (head h, value rows [v0, v1)): the state rows S[b, h, v0:v1, :] are independent of the
    others (spec 3.2: u and o are per value row), so a task reads q, k, g, beta of head h, its v
    columns and state rows, and writes its o columns and state rows in place."""
    batch, heads, v_dim, k_dim = ctx.shape(node.inputs[5])
    parts = max(1, min(ctx.num_sms // heads, v_dim // MIN_STATE_ROWS))
    tasks = []
    for h in range(heads):
        for v in split(v_dim, parts, ROW_GRANULE):
            qk = (h * k_dim, (h + 1) * k_dim)
            vs = (h * v_dim + v[0], h * v_dim + v[1])
            args = {
                0: sub(ctx.shape(node.inputs[0]), {1: qk}),
                1: sub(ctx.shape(node.inputs[1]), {1: qk}),
                2: sub(ctx.shape(node.inputs[2]), {1: vs}),
                3: sub(ctx.shape(node.inputs[3]), {1: (h, h + 1)}),
                4: sub(ctx.shape(node.inputs[4]), {1: (h, h + 1)}),
                5: sub(ctx.shape(node.inputs[5]), {1: (h, h + 1), 2: v}),
            }
            results = [sub(ctx.shape(node.outputs[0]), {1: vs}), sub(ctx.shape(node.outputs[1]), {1: (h, h + 1), 2: v})]
            tasks.append(ctx.task(node, {"head": h, "values": v}, args, results, flops=8 * batch * (v[1] - v[0]) * k_dim))
    return tasks


@rule("gated_rmsnorm")
def _gated_rmsnorm(ctx: Context, node: Node) -> list[Task]:
    head = node.op.head_dim
    shape = ctx.shape(node.inputs[0])
    tasks = []
    for h in range(shape[1] // head):
        cols = {1: (h * head, (h + 1) * head)}
        tasks.append(ctx.task(node, {"head": h}, {0: sub(shape, cols), 1: sub(shape, cols)}, [sub(ctx.shape(node.outputs[0]), cols)]))
    return tasks


# --- elementwise and collectives -------------------------------------------------------------------------


@rule("add", "silu_mul", "situ_mul", "sigmoid_gate", "all_reduce")
def _elementwise(ctx: Context, node: Node) -> list[Task]:
    """Operands and result of one shape: [B, n] in column chunks, [B, k, n] per routing slot (so the
    expert ops downstream, which read one slot, wait for that slot only). An all-reduce chunk is what
    one task exchanges with its peers (the collective protocol itself synchronizes the ranks). An add
    takes one contiguous range (task table format 3), so with several rows and several pieces its
    pieces are column chunks of one row each (Kimi K3's TP adds of the all-reduced residual stream at
    batch >= 3)."""
    shape = ctx.shape(node.outputs[0])
    parts = min(ctx.num_sms, max(1, ctx.tensor(node.outputs[0]).nbytes // ELEMENTWISE_BYTES))
    if len(shape) == 3:
        pieces = [{1: (j, j + 1)} for j in range(shape[1])]
    elif node.op.name == "add" and shape[0] > 1 and parts > 1:
        per_row = max(1, parts // shape[0])
        pieces = [{0: (b, b + 1), 1: c} for b in range(shape[0]) for c in split(shape[1], per_row, COLUMN_GRANULE)]
    else:
        pieces = [{len(shape) - 1: c} for c in split(shape[-1], parts, COLUMN_GRANULE)]
    return [ctx.task(node, {"slice": p}, {i: sub(shape, p) for i in range(len(node.inputs))}, [sub(shape, p)]) for p in pieces]


@rule("all_gather")
def _all_gather(ctx: Context, node: Node) -> list[Task]:
    """Chunks [c0, c1) of the local operand along the gathered dim; a task writes that chunk of every
    rank's block of the result (rank q's block starts at q * n)."""
    dim, ranks = node.op.dim, node.op.ranks
    shape = ctx.shape(node.inputs[0])
    parts = min(ctx.num_sms, max(1, ctx.tensor(node.inputs[0]).nbytes // ELEMENTWISE_BYTES))
    out = ctx.shape(node.outputs[0])
    tasks = []
    for c in split(shape[dim], parts, COLUMN_GRANULE if dim == len(shape) - 1 else 1):
        blocks = tuple(sub(out, {dim: (q * shape[dim] + c[0], q * shape[dim] + c[1])}) for q in range(ranks))
        tasks.append(ctx.task(node, {"chunk": c}, {0: sub(shape, {dim: c})}, [Operand(node.outputs[0], blocks, axis=dim)]))
    return tasks


# --- the pass ----------------------------------------------------------------------------------------


def missing_rules() -> list[str]:
    """Registered op kinds no rule tiles (must stay empty: tests/passes/test_tile.py)."""
    return sorted(set(OPS) - set(RULES))


def tile(graph: Graph, target: Any) -> TaskGraph:
    """Split every node into tasks (module docstring). `target` needs `num_sms`."""
    ctx = Context(graph, target.num_sms, graph.consumers())
    tasks: list[Task] = []
    for node in graph.nodes:
        fn = RULES.get(node.op.name)
        if fn is None:
            raise TileError(f"node '{node.name}': no tiling rule for op kind '{node.op.name}' (passes/tile.py RULES)")
        for t in fn(ctx, node):
            t.id = len(tasks)
            tasks.append(t)
    meta = {"num_sms": target.num_sms, "tasks": len(tasks)}
    return TaskGraph(graph, tasks, meta=meta)


def coverage_errors(tg: TaskGraph) -> list[str]:
    """Outputs not written exactly once by their node's tasks (the guarantee above), as messages.
    Counts written elements per output: equal to the tensor's size and no two write boxes overlapping."""
    by_tensor: dict[str, list[Region]] = {}
    for t in tg.tasks:
        for r in t.writes:
            by_tensor.setdefault(r.tensor, []).append(r)
    errors = []
    for node in tg.graph.nodes:
        for name in node.outputs:
            regions = by_tensor.get(name, [])
            written = sum(math.prod(hi - lo for lo, hi in r.box) for r in regions)
            if written != tg.graph.tensors[name].numel:
                errors.append(f"'{name}' of node '{node.name}': {written} elements written, it has {tg.graph.tensors[name].numel}")
            elif _any_overlap(regions):
                errors.append(f"'{name}' of node '{node.name}': two tasks write overlapping boxes")
    return errors


def _any_overlap(regions: list[Region]) -> bool:
    """Sweep over the first dimension's starts; boxes are few per tensor after that filter."""
    ordered = sorted(regions, key=lambda r: r.box[0])
    for i, a in enumerate(ordered):
        for b in ordered[i + 1 :]:
            if b.box[0][0] >= a.box[0][1]:
                break
            if a.overlaps(b):
                return True
    return False
