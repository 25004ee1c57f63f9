"""The task table: the binary contract between the scheduler passes and the megakernel.

The megakernel (DESIGN.md, "The megakernel execution model") runs one CTA per SM; CTA `s` walks
list `s` of this table in order. A task is an opcode (an index into the table's op VARIANTS: an
op kind plus its compile-time constants, one specialised op body each) plus operand words (arena
byte offsets, weight ids, tile coordinates), the events it waits on and the event it signals.

Events are 64-bit counters in device memory, monotonic across steps: during step `e` (1-based,
`e = completed steps + 1`) a wait on event `v` is satisfied when `counter[v] >= count[v] * e`, where
`count[v]` is the number of tasks that signal `v` once per step. Counts are derived here from the
signalling tasks, never written by hand (a miscounted arrival is a hang). docs/task_table.md
describes the byte layout; `encode` / `decode` are its only reader and writer in Python.

A tensor-parallel table (tp > 1) is run by every rank of its group alike; its collective tasks
exchange through the ranks' comm regions (`CommSpec`; docs/task_table.md "Tensor parallelism").

Pure Python (struct + json): importable without torch or CuTe DSL, by the passes, the codegen and
the runtime alike.
"""

from __future__ import annotations

import json
import struct
from collections import deque
from dataclasses import asdict, dataclass, field, fields
from types import MappingProxyType
from typing import Any, Mapping

from k3mk.ir.streaming import RingModel, check_ring, producer_waits

FORMAT_VERSION = 3  # 3: the producer's weight wait (W_WEIGHT_WAIT, W_WEIGHT_COUNT)
MAGIC = 0x5454334B  # b"K3TT" little-endian
HEADER_WORDS = 16
TASK_WORDS = 32  # 128 bytes per task
TASK_HEADER_WORDS = 8
MAX_OPERANDS = TASK_WORDS - TASK_HEADER_WORDS  # 24
NO_EVENT = -1
ARENA_ALIGN = 16  # every arena offset an op vector-loads from is 16-byte aligned

# Task header word indices (device code reads these; keep in sync with codegen/templates).
W_OPCODE, W_WAIT0, W_COUNT0, W_WAIT1, W_COUNT1, W_SIGNAL, W_WEIGHT_WAIT, W_WEIGHT_COUNT = range(TASK_HEADER_WORDS)

# File header word indices.
H_MAGIC, H_VERSION, H_HEADER_WORDS, H_TASK_WORDS = 0, 1, 2, 3
H_NUM_LISTS, H_NUM_TASKS, H_NUM_EVENTS, H_NUM_VARIANTS = 4, 5, 6, 7
H_LISTS_OFFSET, H_TASKS_OFFSET, H_EVENTS_OFFSET, H_DEVICE_WORDS = 8, 9, 10, 11
H_META_BYTES = 12


class TaskTableError(ValueError):
    """A task table that breaks the format or its invariants."""


# --------------------------------------------------------------------------------------------
# Op kinds: compile-time constants (typed records) and the names of their operand words.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GemvParams:
    """y[b, r] = sum_k W[r, k] * xn[b, k] for rows r of one tile; bf16 in, fp32 accumulate.

    rmsnorm: xn = rmsnorm(x, norm_weight, eps) computed in the task (semantics.rmsnorm; fused.py's
    norm prologue). Epilogues (ir/fused.py; any row tile, the template indexes heads per row):
      "none"           bf16(y) + `residuals` (0..4) residual rows, each add rounded to bf16, in order
                       (fused.linear_residual); out_dtype "float32": the fp32 accumulator itself
                       (semantics.linear(fp32=True), e.g. router logits)
      "silu_mul", "situ_mul"  fused.gated_linear: the same rows of weight (gate) and weight_up,
                       act(bf16(gate), bf16(up)); SiTU with beta, linear_beta (spec 5.1)
      "sigmoid_gate"   fused.linear_sigmoid_gate: o[b, r] * sigmoid(bf16(y)), bf16 (spec 4.2)
      "kda_gate"       fused.linear_kda_gate: fp32 decay g[b, r // head_dim, r % head_dim] from bf16(y),
                       a_log [H] and dt_bias [H*D] fp32, lower_bound or softplus form (spec 3.2)
      "gated_rmsnorm"  fused.linear_gated_rmsnorm: fp32 RMS of o over r's head (o_eps) * o_norm_weight
                       [head_dim] fp32 * sigmoid(bf16(y)), bf16 (spec 3.2 o_norm)
      "router"         the fp32 router logits (out_dtype "float32"), and the router's top-k where the GEMV
                       finishes (spec 5.2, semantics.router_topk with top_k, renormalize, scaling; PERFORMANCE.md
                       E5): every tile counts itself on the `arrivals` event, and the tile whose add completes
                       the step's count (`tiles` adds per step) selects for every request from all the logits,
                       writing ids / topk_weights; the tiles signal one event, which the experts wait on
    x_stride: the elements between x's batch rows (0: in_features). The batch rows of out, the residuals and o lie
    out_features apart: a task says so in its `batch_stride` operand, so that gemvs that differ only in their rows
    run one code (codegen/emit.py shared_code)."""

    in_features: int
    out_features: int
    batch: int
    rmsnorm: bool = False
    residuals: int = 0
    eps: float = 1e-6
    x_stride: int = 0  # 0: in_features
    epilogue: str = "none"
    out_dtype: str = "bfloat16"  # or "float32" ("none" without residuals; "kda_gate" always)
    beta: float = 4.0  # situ_mul
    linear_beta: float | None = 25.0  # situ_mul; None: no soft clamp of up
    head_dim: int = 0  # kda_gate, gated_rmsnorm
    lower_bound: float | None = None  # kda_gate; None: the softplus form (Kimi Linear)
    o_eps: float = 1e-5  # gated_rmsnorm
    top_k: int = 0  # router
    renormalize: bool = False  # router
    scaling: float = 1.0  # router


@dataclass(frozen=True)
class RmsnormParams:
    """out[b] = rmsnorm(x[b], weight, eps) for rows b of [batch_begin, batch_begin + batch_count)."""

    dim: int
    batch: int
    eps: float = 1e-6


@dataclass(frozen=True)
class EmbeddingParams:
    """out[b] = table[ids[b]]; ids int32 [batch] in the arena, table [vocab, dim] bf16."""

    dim: int
    vocab: int
    batch: int


@dataclass(frozen=True)
class ArgmaxParams:
    """out[b] = argmax(logits[b]) (lowest index on ties), int32; logits [batch, vocab] bf16 or fp32."""

    vocab: int
    batch: int
    dtype: str = "bfloat16"  # or "float32"


@dataclass(frozen=True)
class AddParams:
    """out[i] = a[i] + b[i] over elements [begin, begin + count) of bf16 vectors."""

    dtype: str = "bfloat16"


@dataclass(frozen=True)
class NopParams:
    """Does nothing but wait and signal (tests, padding, pure join points)."""


@dataclass(frozen=True)
class KdaConvParams:
    """Spec 3.2 short conv (semantics.kda_conv) of channels [channel_begin, +channel_count) of q, k and v
    [batch, channels] bf16 (rows x_stride apart): out = bf16(silu(sum_j window_j * w[c, 0, j])) in fp32
    over the window (state[b, :, g*channels + c], new token), conv weights fp32 [channels, 1, width];
    the q|k|v state [batch, width-1, 3*channels] bf16 (spec 8 "SD") is shifted in place."""

    channels: int
    batch: int
    width: int = 4
    x_stride: int = 0  # 0: channels
    out_stride: int = 0  # 0: channels


@dataclass(frozen=True)
class KdaRecurrenceParams:
    """Spec 3.2 delta rule (semantics.kda_recurrence) of one head, value rows [value_begin, +value_count):
    q, k, v [batch, H*D] bf16, g [batch, H, D] fp32, beta logits [batch, H] bf16, out [batch, H*D] bf16,
    state [batch, H, D(v), D(k)] fp32 updated in place (each row read once, written once). value_rows: the most value
    rows a task of this variant holds (0: head_dim), what the template unrolls its rows for."""

    num_heads: int
    head_dim: int
    batch: int
    value_rows: int = 0


MAX_ATTN_RES_SOURCES = 9


@dataclass(frozen=True)
class AttnResParams:
    """Spec 6 block attention residual (semantics.attn_res) of rows [batch_begin, +batch_count): fp32 RMS
    (no gain) per source, score = sum(normed * norm_weight * proj_weight), softmax over the sources, mix
    of the un-normalized sources; sources [batch, dim] bf16 (operands source0..), out bf16."""

    dim: int
    batch: int
    num_sources: int
    eps: float = 1e-5


# ---- MoE and MLA op kinds (spec 4.3, 5.2, 5.3, 5.5; codegen/templates/{router,expert_*,mla_*}.py.j2) ----


@dataclass(frozen=True)
class RouterParams:
    """Spec 5.2 (fused.router): ONE task for all rows. logits = fp32 GEMV of (rmsnorm'd) x [batch, dim] bf16
    against the gate [num_experts, dim] bf16; s = sigmoid(logits); top_k of s + bias (fp32 [num_experts],
    selection only; lowest index wins ties); weights from s, renormalized (+1e-20), times scaling. Writes
    ids int32 [batch, top_k] and topk_weights fp32 [batch, top_k] (semantics.router_topk)."""

    dim: int
    num_experts: int
    batch: int
    top_k: int
    renormalize: bool = True
    scaling: float = 1.0
    rmsnorm: bool = False
    eps: float = 1e-5


@dataclass(frozen=True)
class RouterTopkParams:
    """Spec 5.2, the top-k half of the router (semantics.router_topk) for gates too large to fuse
    (passes/fuse_epilogue.py): ONE task for all rows reads fp32 logits [batch, num_experts] from the
    arena (a row-tiled fp32 gemv wrote them); s = sigmoid(logits); top_k of s + bias (fp32
    [num_experts], selection only; lowest index wins ties); weights from s, renormalized (+1e-20), times
    scaling. Writes ids int32 [batch, top_k] and topk_weights fp32 [batch, top_k]."""

    num_experts: int
    batch: int
    top_k: int
    renormalize: bool = True
    scaling: float = 1.0


@dataclass(frozen=True)
class ExpertGatedParams:
    """Spec 5.3 (fused.expert_gated_linear[_mxfp4]): rows [row_begin, +row_count) of routing slot `slot`
    for every request b: e = ids[b, slot] READ AT RUN TIME; out[b, slot, r] = act(bf16(w1[e, r] . x[b]),
    bf16(w3[e, r] . x[b])), fp32 accumulate. x [batch, in] bf16; out [batch, top_k, out] bf16; w1/w3
    [E, out, in] bf16, or MXFP4 packed [E, out, in/2] u8 + UE8M0 scales [E, out, in/32] u8 (spec 5.5)."""

    in_features: int
    out_features: int
    num_experts: int
    batch: int
    top_k: int
    weight_format: str = "bfloat16"  # or "mxfp4"
    activation: str = "silu"  # or "situ"
    beta: float = 4.0  # situ
    linear_beta: float | None = 25.0  # situ; None: no soft clamp of up


@dataclass(frozen=True)
class ExpertCombineParams:
    """Spec 5.3 (fused.expert_linear[_mxfp4]_combine): rows [row_begin, +row_count) of
    out[b, r] = bf16(sum_j topk_weights[b, j] * bf16(w2[ids[b, j], r] . x[b, j])), the slot sum in fp32 in
    slot order, ALL slots in one task. x [batch, top_k, in] bf16; w2 [E, out, in] bf16 or MXFP4. Then
    `residuals` (0..2) bf16 [batch, out] rows added in order, each add rounded to bf16 (the MoE "+ shared"
    and the residual stream: passes/fuse_residual.py)."""

    in_features: int
    out_features: int
    num_experts: int
    batch: int
    top_k: int
    weight_format: str = "bfloat16"  # or "mxfp4"
    residuals: int = 0


COMBINE_RESIDUAL_OPERANDS = ("residual", "residual2")  # expert_combine's residuals, in add order


@dataclass(frozen=True)
class MlaLatentParams:
    """Spec 4.3 (semantics.mla_latent + mla_cache_write) of rows [batch_begin, +batch_count):
    cache[b, positions[b]] = rmsnorm(x[b, :rank], norm_weight, eps) || x[b, rank:] (k_pe copied). x
    [batch, rank+rope] bf16; cache [batch, max_len, rank+rope] bf16 (decode state, pointer table)."""

    kv_lora_rank: int
    rope_dim: int
    max_len: int
    batch: int
    eps: float = 1e-6


@dataclass(frozen=True)
class MlaQAbsorbParams:
    """Spec 4.3 (fused.mla_q_absorb) of heads [head_begin, +head_count) and q_lat columns [column_begin, +columns):
    out[b, h] = bf16(q_nope[b, h] W_UK[h]) (fp32 accumulate) || q_pe[b, h] (copied by the task holding the last
    columns). x = q [batch, H*(nope+rope)] bf16; weight = kv_b [H*(nope+v), rank] bf16 (W_UK[h] = its rows
    [h*(nope+v), +nope)); out [batch, H, rank+rope] bf16. columns: every task's width of the rank (0: kv_lora_rank),
    what the template lays its threads out for."""

    num_heads: int
    qk_nope: int
    qk_rope: int
    v_dim: int
    kv_lora_rank: int
    batch: int
    columns: int = 0


@dataclass(frozen=True)
class MlaDecodeParams:
    """Spec 4.3 (fused.mla_decode) of one (request, KV chunk, head group <= group_heads): MQA of q [batch, H,
    rank+rope] bf16 over the cache rows of the chunk (fused.kv_chunk_bounds from positions, at run time),
    scores * scale, fp32 online softmax; writes the chunk-normalized o [batch, num_chunks, H, rank] fp32
    and lse [batch, num_chunks, H] fp32; an empty chunk gives o = 0, lse = -inf."""

    num_heads: int
    kv_lora_rank: int
    rope_dim: int
    max_len: int
    batch: int
    num_chunks: int
    min_chunk_rows: int
    scale: float
    group_heads: int = 8


@dataclass(frozen=True)
class MlaVUpParams:
    """Spec 4.3 (fused.mla_v_up) of heads [head_begin, +head_count) and output rows [value_begin, +value_count) of
    each, every request: the log-sum-exp merge of the chunks' o [batch, num_chunks, H, rank] / lse [batch, num_chunks,
    H] (fp32), then o_lat W_UV[h]^T (kv_b rows [h*(nope+v)+nope, +v)) in fp32, rounded once: out [batch, H*v] bf16."""

    num_heads: int
    qk_nope: int
    v_dim: int
    kv_lora_rank: int
    batch: int
    num_chunks: int


# ---- tensor parallelism (spec 10; ir/collectives.py; docs/megakernel.md "Tensor parallelism") ----


@dataclass(frozen=True)
class CollectiveParams:
    """all_reduce / all_gather (ir/collectives.py) of this rank's [rows, cols] operand over `ranks` ranks,
    columns [col_begin, +col_count) per task. The task pushes its columns into slot `rank` of every
    rank's comm region (parity = step & 1), release-adds 1 to comm event `comm_event` of every rank
    (system scope), waits until its own reaches `ranks` per step, then all_reduce writes out = the slots
    summed in rank order in fp32, rounded once (collectives.rank_order_sum; bitwise the same on every
    rank), all_gather writes out[:, q*cols + c] = slot q [:, c] (out [rows, ranks*cols]). Slot q holds
    rank q's whole operand ([rows, cols], `slot_bytes`); a collective's `ranks` slots are contiguous."""

    ranks: int
    rows: int
    cols: int
    dtype: str = "bfloat16"

    @property
    def slot_bytes(self) -> int:
        return _align(self.rows * self.cols * DTYPE_BYTES[self.dtype], ARENA_ALIGN)

    @property
    def vector(self) -> int:
        """Elements per access: 16 bytes when every row's columns allow it (task column ranges are
        multiples of it: validate()), else 1."""
        return _vector(self.cols, self.dtype)


@dataclass(frozen=True)
class ShardSliceParams:
    """ir/collectives.shard_slice of a replicated [rows, cols] x (no communication): out [rows, cols/parts]
    = x[:, r*cols/parts : (r+1)*cols/parts] for this rank r (read from the `rank` input at run time)."""

    rows: int
    cols: int
    parts: int
    dtype: str = "bfloat16"

    @property
    def vector(self) -> int:
        """Elements per access of the slice (16 bytes when its width allows it)."""
        return _vector(self.cols // self.parts, self.dtype)


def _vector(cols: int, dtype: str) -> int:
    per_16_bytes = 16 // DTYPE_BYTES[dtype]
    return per_16_bytes if cols % per_16_bytes == 0 else 1


@dataclass(frozen=True)
class ArgmaxCombineParams:
    """ir/collectives.argmax_combine: values fp32 / local indices int32 [batch, ranks] (every rank's greedy
    candidate, gathered) -> out int32 [batch] = q * shard_size + indices[b, q] for the first rank q
    holding the largest value (lowest vocabulary index on ties, as argmax)."""

    ranks: int
    batch: int
    shard_size: int


@dataclass(frozen=True)
class OpKind:
    name: str
    params: type
    operands: tuple[str, ...]  # operand word k+TASK_HEADER_WORDS holds operands[k]


# rank: the arena offset of the `tp_rank` step input; comm: the pointer-table index of rank 0's comm region
# (rank q's is comm + q); comm_offset: byte offset of the collective's parity-0 slots in a comm region;
# comm_half: bytes of one parity's slots (CommSpec.half)
COLLECTIVE_OPERANDS = ("x", "out", "rank", "comm", "comm_event", "comm_offset", "comm_half", "col_begin", "col_count")
COLLECTIVE_OPS = frozenset({"all_reduce", "all_gather"})

OP_KINDS: Mapping[str, OpKind] = MappingProxyType(
    {
        k.name: k
        for k in (
            OpKind("nop", NopParams, ()),
            OpKind("gemv", GemvParams, ("x", "out", "weight", "row_begin", "row_count", "residual", "norm_weight",
                                        "weight_up", "o", "a_log", "dt_bias", "o_norm_weight", "residual2", "residual3",
                                        "residual4", "x_staged", "bias", "ids", "topk_weights", "arrivals", "tiles",
                                        "batch_stride")),
            OpKind("rmsnorm", RmsnormParams, ("x", "out", "weight", "batch_begin", "batch_count")),
            OpKind("embedding", EmbeddingParams, ("ids", "out", "table", "batch_begin", "batch_count")),
            OpKind("argmax", ArgmaxParams, ("logits", "out", "batch_begin", "batch_count")),
            OpKind("add", AddParams, ("a", "b", "out", "begin", "count")),
            OpKind("kda_conv", KdaConvParams, ("q", "k", "v", "out_q", "out_k", "out_v", "state", "weight_q", "weight_k",
                                               "weight_v", "channel_begin", "channel_count")),
            OpKind("kda_recurrence", KdaRecurrenceParams, ("q", "k", "v", "g", "beta", "out", "state", "head",
                                                           "value_begin", "value_count")),
            OpKind("attn_res", AttnResParams, ("out", "norm_weight", "proj_weight", "batch_begin", "batch_count",
                                               *(f"source{i}" for i in range(MAX_ATTN_RES_SOURCES)))),
            OpKind("router", RouterParams, ("x", "ids", "topk_weights", "weight", "bias", "norm_weight")),
            OpKind("router_topk", RouterTopkParams, ("logits", "ids", "topk_weights", "bias")),
            OpKind("expert_gated", ExpertGatedParams, ("x", "ids", "out", "weight", "weight_up", "scale", "scale_up",
                                                       "slot", "row_begin", "row_count")),
            OpKind("expert_combine", ExpertCombineParams, ("x", "ids", "topk_weights", "out", "weight", "scale",
                                                           "row_begin", "row_count", "residual", "residual2")),
            OpKind("mla_latent", MlaLatentParams, ("x", "positions", "norm_weight", "cache", "batch_begin", "batch_count")),
            OpKind("mla_q_absorb", MlaQAbsorbParams, ("x", "out", "weight", "head_begin", "head_count", "column_begin")),
            OpKind("mla_decode", MlaDecodeParams, ("q", "positions", "out", "lse", "cache", "request", "chunk",
                                                   "head_begin", "head_count")),
            OpKind("mla_v_up", MlaVUpParams, ("o", "lse", "out", "weight", "head_begin", "head_count", "value_begin",
                                              "value_count")),
            OpKind("all_reduce", CollectiveParams, COLLECTIVE_OPERANDS),
            OpKind("all_gather", CollectiveParams, COLLECTIVE_OPERANDS),
            OpKind("shard_slice", ShardSliceParams, ("x", "out", "rank")),
            # argmax over this rank's vocabulary shard: out = local index, value = fp32 of its logit
            OpKind("argmax_partial", ArgmaxParams, ("logits", "out", "batch_begin", "batch_count", "value")),
            OpKind("argmax_combine", ArgmaxCombineParams, ("values", "indices", "out")),
        )
    }
)
# Operands that are arena byte offsets (checked for range and alignment by validate()).
ARENA_OPERANDS = frozenset({"x", "out", "residual", "ids", "logits", "a", "b"})
WEIGHT_OPERANDS = frozenset({"weight", "norm_weight", "table"})
# KDA / fused-GEMV / attn_res operands. Decode STATE (the KDA conv and recurrent states) lives outside the
# arena like the weights (passes/plan_memory.py): a pointer-table entry bound by name, updated in place.
ARENA_OPERANDS |= {"o", "residual2", "residual3", "residual4", "q", "k", "v", "out_q", "out_k", "out_v", "g", "beta"}
ARENA_OPERANDS |= {f"source{i}" for i in range(MAX_ATTN_RES_SOURCES)}
WEIGHT_OPERANDS |= {"weight_up", "a_log", "dt_bias", "o_norm_weight", "state", "weight_q", "weight_k", "weight_v",
                    "proj_weight"}
# MoE / MLA operands. The MLA latent cache is decode state (pointer table, like the KDA state).
ARENA_OPERANDS |= {"topk_weights", "positions", "q", "o", "lse"}
WEIGHT_OPERANDS |= {"bias", "weight_up", "scale", "scale_up", "cache"}
# Format 2: operands that index a STATE entry of the pointer table (after the weights).
STATE_OPERANDS = frozenset({"state", "cache"})
# Tensor-parallel operands (the comm ones are checked by validate()'s _check_comm).
ARENA_OPERANDS |= {"rank", "value", "values", "indices"}


@dataclass(frozen=True)
class OpVariant:
    """One specialised op body: an op kind and its compile-time constants. Opcode = its index."""

    op: str
    params: Any  # an instance of OP_KINDS[op].params

    def __post_init__(self) -> None:
        kind = OP_KINDS.get(self.op)
        if kind is None:
            raise TaskTableError(f"unknown op kind {self.op!r}; known: {sorted(OP_KINDS)}")
        if not isinstance(self.params, kind.params):
            raise TaskTableError(f"variant {self.op!r} needs {kind.params.__name__}, got {type(self.params).__name__}")

    def to_json(self) -> dict:
        return {"op": self.op, "params": asdict(self.params)}

    @staticmethod
    def from_json(d: dict) -> "OpVariant":
        kind = OP_KINDS.get(d["op"])
        if kind is None:
            raise TaskTableError(f"unknown op kind {d['op']!r}")
        names = {f.name for f in fields(kind.params)}
        extra = set(d["params"]) - names
        if extra:
            raise TaskTableError(f"variant {d['op']!r}: unknown params {sorted(extra)}")
        return OpVariant(d["op"], kind.params(**d["params"]))


# --------------------------------------------------------------------------------------------
# Table contents
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Event:
    """A 64-bit counter; `name` is for humans (watchdog reports, dumps)."""

    name: str


@dataclass(frozen=True)
class Task:
    """One task. `operands` maps the op kind's operand names to int32 values; missing ones are 0
    (zeros are dropped, so a decoded task equals the one encoded)."""

    opcode: int
    operands: Mapping[str, int] = field(default_factory=dict)
    wait: tuple[int, ...] = ()  # at most 2 event ids
    signal: int | None = None
    label: str = ""
    # the event the producer warp waits for before streaming the weights (a routed expert's router:
    # ir/streaming.py PRODUCER_WAITS ops have one, no other op has)
    weight_wait: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "operands", MappingProxyType({k: v for k, v in self.operands.items() if v != 0}))
        object.__setattr__(self, "wait", tuple(self.wait))


@dataclass(frozen=True)
class WeightSpec:
    """Entry `id` of the weight pointer table: bound by name at load time."""

    name: str
    dtype: str  # torch dtype name: "bfloat16", "float32", "uint8"
    shape: tuple[int, ...]


@dataclass(frozen=True)
class StateSpec:
    """Format 2: decode state (KDA conv / recurrent state, MLA latent cache), bound by name and updated
    in place by the kernel. Pointer-table entry `len(weights) + i` for states[i] (the kernel sees ONE
    pointer table: weights, then states); operands `state` / `cache` hold that index."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    layout: str = ""  # human-readable layout, e.g. "[batch, width-1, 3*P] q|k|v channels"


@dataclass(frozen=True)
class CommSpec:
    """Tensor-parallel tables only: the comm region every rank allocates, with the same layout on every
    rank (docs/task_table.md "Tensor parallelism"): int64 counters [events] at byte 0 (zero at
    allocation, monotonic like the events), then the receive slots of parity 0 from `slots_offset` and
    of parity 1 `half` bytes later. Pointer-table entry len(weights) + len(states) + q holds rank q's
    comm region (its peer-mapped address on every other rank)."""

    ranks: int
    events: int  # comm counters: one per collective task, pushed once per step by every rank
    half: int  # bytes of one parity's receive slots

    @property
    def slots_offset(self) -> int:
        return _align(self.events * 8, 256)

    @property
    def nbytes(self) -> int:
        return self.slots_offset + 2 * self.half


BUFFER_ROLES = ("activation", "input", "output")


@dataclass(frozen=True)
class BufferSpec:
    """A named region of the activation arena (inputs the runtime fills, outputs it reads).
    Format 2: `role` says which (step inputs are written by the runtime before each launch, e.g. token
    ids / positions as int32; step outputs read after it, e.g. logits / next_tokens)."""

    name: str
    offset: int  # bytes
    dtype: str
    shape: tuple[int, ...]
    role: str = "activation"

    @property
    def nbytes(self) -> int:
        n = DTYPE_BYTES[self.dtype]
        for s in self.shape:
            n *= s
        return n


DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "int32": 4, "int64": 8, "uint8": 1}


@dataclass
class TaskTable:
    variants: list[OpVariant]
    lists: list[list[Task]]  # lists[s] = program order of CTA s; len(lists) = CTAs launched
    events: list[Event]
    weights: list[WeightSpec] = field(default_factory=list)
    buffers: list[BufferSpec] = field(default_factory=list)
    arena_bytes: int = 0
    states: list[StateSpec] = field(default_factory=list)  # format 2: pointer-table entries after the weights
    comm: CommSpec | None = None  # tensor parallelism: the comm regions, pointer-table entries after the states

    @property
    def num_pointers(self) -> int:
        """Entries of the kernel's pointer table: the weights, the states, then every rank's comm region."""
        return len(self.weights) + len(self.states) + (self.comm.ranks if self.comm else 0)

    @property
    def comm_pointer(self) -> int:
        """Pointer-table index of rank 0's comm region (the `comm` operand of every collective)."""
        return len(self.weights) + len(self.states)

    def state_id(self, name: str) -> int:
        for i, st in enumerate(self.states):
            if st.name == name:
                return len(self.weights) + i
        raise KeyError(name)

    # ---- derived ------------------------------------------------------------------------
    @property
    def num_tasks(self) -> int:
        return sum(len(l) for l in self.lists)

    def event_counts(self) -> list[int]:
        """Signals per step of every event (its expected count). A router GEMV's `arrivals` event counts 0:
        its tiles' bodies add to it, not the signaller, and nobody waits on it (_check_arrivals)."""
        counts = [0] * len(self.events)
        for tasks in self.lists:
            for t in tasks:
                if t.signal is not None and 0 <= t.signal < len(counts):
                    counts[t.signal] += 1
        return counts

    def counter_steps(self) -> list[int]:
        """What each event's counter advances by per step: its signals, and a router GEMV's tile count for
        its arrivals event (the tiles' bodies add to it)."""
        steps = self.event_counts()
        for ts in self.lists:
            for t in ts:
                if self.is_router_tile(t) and 0 <= t.operands.get("arrivals", 0) < len(steps):
                    steps[t.operands.get("arrivals", 0)] += 1
        return steps

    def is_router_tile(self, t: Task) -> bool:
        """A tile of a router GEMV with the top-k in its epilogue (GemvParams "router")."""
        if not 0 <= t.opcode < len(self.variants):
            return False
        v = self.variants[t.opcode]
        return v.op == "gemv" and v.params.epilogue == "router"

    def writes_expert_ids(self, t: Task) -> bool:
        """The task writes a router's expert ids (the one-task routers, or a router GEMV's tiles)."""
        return (0 <= t.opcode < len(self.variants) and self.variants[t.opcode].op in ("router", "router_topk")) or self.is_router_tile(t)

    def buffer(self, name: str) -> BufferSpec:
        for b in self.buffers:
            if b.name == name:
                return b
        raise KeyError(name)

    # ---- validation -----------------------------------------------------------------------
    def validate(self) -> None:
        """Raise TaskTableError on any broken invariant, including a possible deadlock."""
        if not self.lists:
            raise TaskTableError("a task table needs at least one list")
        counts = self.event_counts()
        for v in self.variants:
            OpVariant(v.op, v.params)  # re-checks the kind
        for b in self.buffers:
            if b.dtype not in DTYPE_BYTES:
                raise TaskTableError(f"buffer {b.name!r}: unknown dtype {b.dtype!r}")
            if b.role not in BUFFER_ROLES:
                raise TaskTableError(f"buffer {b.name!r}: unknown role {b.role!r}")
            if b.offset % ARENA_ALIGN or b.offset < 0 or b.offset + b.nbytes > self.arena_bytes:
                raise TaskTableError(f"buffer {b.name!r} [{b.offset}, +{b.nbytes}) outside arena {self.arena_bytes} or unaligned")
        ids_writers: dict[int, set] = {}  # arena offset of expert ids -> the events of the router tasks writing them
        for tasks in self.lists:
            for t in tasks:
                if self.writes_expert_ids(t):
                    ids_writers.setdefault(t.operands.get("ids", 0), set()).add(t.signal)
        for s, tasks in enumerate(self.lists):
            for i, t in enumerate(tasks):
                where = f"list {s} task {i} ({t.label or 'unlabelled'})"
                if not 0 <= t.opcode < len(self.variants):
                    raise TaskTableError(f"{where}: opcode {t.opcode} out of range ({len(self.variants)} variants)")
                kind = OP_KINDS[self.variants[t.opcode].op]
                unknown = set(t.operands) - set(kind.operands)
                if unknown:
                    raise TaskTableError(f"{where}: operands {sorted(unknown)} not in {kind.name}{kind.operands}")
                for name, value in t.operands.items():
                    if not -(2**31) <= value < 2**31:
                        raise TaskTableError(f"{where}: operand {name}={value} is not an int32")
                    if name in ARENA_OPERANDS and (value < 0 or value >= max(self.arena_bytes, 1) or value % ARENA_ALIGN):
                        raise TaskTableError(f"{where}: arena offset {name}={value} out of range or not {ARENA_ALIGN}-aligned")
                    if name in WEIGHT_OPERANDS and not 0 <= value < self.comm_pointer:
                        raise TaskTableError(f"{where}: weight id {name}={value} out of range (pointer table: {len(self.weights)} weights + {len(self.states)} states)")
                    if name in STATE_OPERANDS and self.states and value < len(self.weights):
                        raise TaskTableError(f"{where}: {name}={value} is a weight id, the table declares states")
                params = self.variants[t.opcode].params
                if kind.name == "kda_recurrence" and t.operands.get("value_count", 0) > (params.value_rows or params.head_dim):
                    raise TaskTableError(f"{where}: value_count {t.operands['value_count']} above its variant's value_rows "
                                         f"{params.value_rows or params.head_dim}: the template computes no more rows")
                if kind.name == "gemv" and params.batch > 1 and t.operands.get("batch_stride", 0) != params.out_features:
                    raise TaskTableError(f"{where}: batch_stride {t.operands.get('batch_stride', 0)} != out_features "
                                         f"{params.out_features}: the batch rows of out lie out_features apart")
                if kind.name == "mla_q_absorb":
                    c0, width = t.operands.get("column_begin", 0), params.columns or params.kv_lora_rank
                    if c0 % width or not 0 <= c0 < params.kv_lora_rank:
                        raise TaskTableError(f"{where}: column_begin {c0} is not a multiple of its variant's columns {width} "
                                             f"in [0, kv_lora_rank {params.kv_lora_rank})")
                if len(t.wait) > 2:
                    raise TaskTableError(f"{where}: at most 2 waits, got {len(t.wait)}")
                weight_wait = () if t.weight_wait is None else (t.weight_wait,)
                for e in (*t.wait, *weight_wait, *(() if t.signal is None else (t.signal,))):
                    if not 0 <= e < len(self.events):
                        raise TaskTableError(f"{where}: event {e} out of range ({len(self.events)} events)")
                for e in (*t.wait, *weight_wait):
                    if counts[e] == 0:
                        raise TaskTableError(f"{where}: waits on event {e} ({self.events[e].name}) that no task signals")
                if t.weight_wait is not None and not producer_waits(kind.name):
                    raise TaskTableError(f"{where}: {kind.name} streams weights known at compile time: no weight wait")
                writers = ids_writers.get(t.operands.get("ids", 0), set()) if producer_waits(kind.name) else set()
                if writers and t.weight_wait not in writers:
                    raise TaskTableError(f"{where}: {kind.name} reads expert ids a router task writes (event "
                                         f"{sorted(writers)}), but its producer's weight wait is {t.weight_wait}: it would "
                                         f"stream the experts of stale ids")  # fmt: skip
        self._check_arrivals(counts)
        self._check_comm()
        self.check_deadlock_free()

    def _check_arrivals(self, counts: list[int]) -> None:
        """A router GEMV's `arrivals` event counts its tiles' bodies only: each tile says how many adds
        complete a step (`tiles`: the last tile selects), nobody waits on it and no signaller adds to it."""
        tiles: dict[int, list[tuple[str, int]]] = {}
        waited = {e for ts in self.lists for t in ts for e in (*t.wait, *(() if t.weight_wait is None else (t.weight_wait,)))}
        for s, ts in enumerate(self.lists):
            for i, t in enumerate(ts):
                if self.is_router_tile(t):
                    tiles.setdefault(t.operands.get("arrivals", 0), []).append((f"list {s} task {i} ({t.label or 'unlabelled'})", t.operands.get("tiles", 0)))
        for e, members in tiles.items():
            if not 0 <= e < len(self.events) or counts[e] or e in waited:
                raise TaskTableError(f"{members[0][0]}: router tiles count themselves on event {e}, which a task signals or waits on")
            for where, n in members:
                if n != len(members):
                    raise TaskTableError(f"{where}: a router tile of {n} tiles, and {len(members)} tiles count themselves on event {e}")

    def _check_comm(self) -> None:
        """Collectives only in a table with a comm region; each task's slots inside it; every comm counter
        pushed by exactly one task per rank (a wait counts `ranks` pushes per step: a shared or unused
        counter is a hang or a race)."""
        users: dict[int, str] = {}
        for s, tasks in enumerate(self.lists):
            for i, t in enumerate(tasks):
                v = self.variants[t.opcode]
                if v.op not in COLLECTIVE_OPS:
                    continue
                where = f"list {s} task {i} ({t.label or 'unlabelled'})"
                c, o = self.comm, t.operands
                if c is None:
                    raise TaskTableError(f"{where}: {v.op} in a table without a comm region (TaskTable.comm)")
                if v.params.ranks != c.ranks or o.get("comm", 0) != self.comm_pointer or o.get("comm_half", 0) != c.half:
                    raise TaskTableError(f"{where}: {v.op} over {v.params.ranks} ranks, comm {o.get('comm', 0)}, half "
                                         f"{o.get('comm_half', 0)}; the table's comm region: {c.ranks} ranks at pointer "
                                         f"{self.comm_pointer}, half {c.half}")  # fmt: skip
                begin, end = o.get("comm_offset", 0), o.get("comm_offset", 0) + c.ranks * v.params.slot_bytes
                if begin % ARENA_ALIGN or begin < c.slots_offset or end > c.slots_offset + c.half:
                    raise TaskTableError(f"{where}: slots [{begin}, {end}) not 16-byte aligned inside parity 0's "
                                         f"[{c.slots_offset}, {c.slots_offset + c.half})")  # fmt: skip
                cols = (o.get("col_begin", 0), o.get("col_begin", 0) + o.get("col_count", 0))
                if not 0 <= cols[0] < cols[1] <= v.params.cols or cols[0] % v.params.vector or cols[1] % v.params.vector:
                    raise TaskTableError(f"{where}: columns {cols} outside [0, {v.params.cols}) or not multiples of {v.params.vector}")
                event = o.get("comm_event", 0)
                if not 0 <= event < c.events or event in users:
                    raise TaskTableError(f"{where}: comm event {event} out of range ({c.events}) or also pushed by {users.get(event)}")
                users[event] = where
        if self.comm is not None and len(users) != self.comm.events:
            raise TaskTableError(f"comm region declares {self.comm.events} counters, {len(users)} collective tasks push them")

    def check_deadlock_free(self, ring: RingModel | None = None) -> None:
        """Execute one step abstractly: each CTA runs its list in order, a task starts once all its
        waited events reached their per-step count. Every task must run (with every CTA resident).
        With `ring` (the kernel's streaming ring), the CTA's producer and consumers are modelled
        apart, with the ring's slots and records (ir/streaming.py check_ring).

        A collective task also waits inside its body, for every rank's push of the same task. Every rank
        runs this same table, so running this order on all ranks in lockstep (all pushes of a collective
        before any rank's reduce) is a valid execution of the whole group: with every CTA of every rank
        resident and waits that only ever become satisfied, some task can always progress, so this
        one-rank check covers the group."""
        if ring is not None:
            try:
                check_ring(self, ring)
            except ValueError as e:
                raise TaskTableError(str(e)) from None
            return
        counts = self.event_counts()
        seen = [0] * len(self.events)
        pos = [0] * len(self.lists)
        ready = deque(range(len(self.lists)))
        blocked: dict[int, list[int]] = {}  # event -> CTAs blocked on it
        while ready:
            s = ready.popleft()
            tasks = self.lists[s]
            while pos[s] < len(tasks):
                t = tasks[pos[s]]
                missing = [e for e in t.wait if seen[e] < counts[e]]
                if missing:
                    blocked.setdefault(missing[0], []).append(s)
                    break
                if t.signal is not None:
                    seen[t.signal] += 1
                    if seen[t.signal] == counts[t.signal]:
                        ready.extend(blocked.pop(t.signal, []))
                pos[s] += 1
        stuck = [(s, pos[s]) for s in range(len(self.lists)) if pos[s] < len(self.lists[s])]
        if stuck:
            s, i = stuck[0]
            t = self.lists[s][i]
            waits = ", ".join(f"{e} ({self.events[e].name}: {seen[e]}/{counts[e]})" for e in t.wait)
            raise TaskTableError(f"deadlock: {len(stuck)} CTAs stuck, e.g. list {s} task {i} ({t.label}) waiting on {waits}")

    # ---- binary form ----------------------------------------------------------------------
    def encode(self, check: bool = True) -> bytes:
        """The file: device part (header, list offsets, tasks, event counts; int32 LE) + JSON metadata.
        `check=False` skips validate() (planted-fault tests only: a table that deadlocks on purpose)."""
        if check:
            self.validate()
        counts = self.event_counts()
        num_lists, num_tasks, num_events = len(self.lists), self.num_tasks, len(self.events)
        lists_offset = HEADER_WORDS
        tasks_offset = _align(lists_offset + num_lists + 1, TASK_WORDS)  # 128-byte aligned tasks
        events_offset = tasks_offset + num_tasks * TASK_WORDS
        device_words = _align(events_offset + num_events, TASK_WORDS)
        words = [0] * device_words
        meta = json.dumps(self._meta_json(), separators=(",", ":"), sort_keys=True).encode()
        header = {
            H_MAGIC: MAGIC, H_VERSION: FORMAT_VERSION, H_HEADER_WORDS: HEADER_WORDS, H_TASK_WORDS: TASK_WORDS,
            H_NUM_LISTS: num_lists, H_NUM_TASKS: num_tasks, H_NUM_EVENTS: num_events,
            H_NUM_VARIANTS: len(self.variants), H_LISTS_OFFSET: lists_offset, H_TASKS_OFFSET: tasks_offset,
            H_EVENTS_OFFSET: events_offset, H_DEVICE_WORDS: device_words, H_META_BYTES: len(meta),
        }  # fmt: skip
        for k, v in header.items():
            words[k] = v
        n = 0
        for s, tasks in enumerate(self.lists):
            words[lists_offset + s] = n
            for t in tasks:
                base = tasks_offset + n * TASK_WORDS
                words[base : base + TASK_WORDS] = self._task_words(t, counts)
                n += 1
        words[lists_offset + num_lists] = n
        words[events_offset : events_offset + num_events] = counts
        return struct.pack(f"<{device_words}i", *words) + meta

    def _task_words(self, t: Task, counts: list[int]) -> list[int]:
        w = [0] * TASK_WORDS
        waits = list(t.wait) + [NO_EVENT] * (2 - len(t.wait))
        w[W_OPCODE] = t.opcode
        w[W_WAIT0], w[W_COUNT0] = waits[0], (counts[waits[0]] if waits[0] >= 0 else 0)
        w[W_WAIT1], w[W_COUNT1] = waits[1], (counts[waits[1]] if waits[1] >= 0 else 0)
        w[W_SIGNAL] = NO_EVENT if t.signal is None else t.signal
        w[W_WEIGHT_WAIT] = NO_EVENT if t.weight_wait is None else t.weight_wait
        w[W_WEIGHT_COUNT] = 0 if t.weight_wait is None else counts[t.weight_wait]
        names = OP_KINDS[self.variants[t.opcode].op].operands
        for k, name in enumerate(names):
            w[TASK_HEADER_WORDS + k] = t.operands.get(name, 0)
        return w

    def _meta_json(self) -> dict:
        return {
            "format_version": FORMAT_VERSION,
            "variants": [v.to_json() for v in self.variants],
            "events": [e.name for e in self.events],
            "labels": [[t.label for t in tasks] for tasks in self.lists],
            "weights": [asdict(w) for w in self.weights],
            "buffers": [asdict(b) for b in self.buffers],
            "arena_bytes": self.arena_bytes,
            "states": [asdict(st) for st in self.states],
            **({"comm": asdict(self.comm)} if self.comm else {}),  # absent at tp 1: those tables are unchanged
        }

    @staticmethod
    def decode(data: bytes) -> "TaskTable":
        if len(data) < HEADER_WORDS * 4:
            raise TaskTableError("task table too short")
        hdr = struct.unpack_from(f"<{HEADER_WORDS}i", data)
        if hdr[H_MAGIC] != MAGIC:
            raise TaskTableError(f"bad magic {hdr[H_MAGIC]:#x}: not a k3mk task table")
        if hdr[H_VERSION] != FORMAT_VERSION:
            raise TaskTableError(f"task table format {hdr[H_VERSION]}, this k3mk reads {FORMAT_VERSION}")
        if hdr[H_TASK_WORDS] != TASK_WORDS or hdr[H_HEADER_WORDS] != HEADER_WORDS:
            raise TaskTableError("task table word sizes do not match this format version")
        device_words = hdr[H_DEVICE_WORDS]
        if len(data) != device_words * 4 + hdr[H_META_BYTES]:
            raise TaskTableError("task table length does not match its header")
        words = struct.unpack_from(f"<{device_words}i", data)
        meta = json.loads(data[device_words * 4 :].decode())
        variants = [OpVariant.from_json(v) for v in meta["variants"]]
        events = [Event(n) for n in meta["events"]]
        lo, to = hdr[H_LISTS_OFFSET], hdr[H_TASKS_OFFSET]
        lists: list[list[Task]] = []
        for s in range(hdr[H_NUM_LISTS]):
            tasks = []
            for j, i in enumerate(range(words[lo + s], words[lo + s + 1])):
                w = words[to + i * TASK_WORDS : to + (i + 1) * TASK_WORDS]
                names = OP_KINDS[variants[w[W_OPCODE]].op].operands
                ops = {n: w[TASK_HEADER_WORDS + k] for k, n in enumerate(names)}
                waits = tuple(e for e in (w[W_WAIT0], w[W_WAIT1]) if e != NO_EVENT)
                signal = None if w[W_SIGNAL] == NO_EVENT else w[W_SIGNAL]
                weight_wait = None if w[W_WEIGHT_WAIT] == NO_EVENT else w[W_WEIGHT_WAIT]
                tasks.append(Task(w[W_OPCODE], ops, waits, signal, meta["labels"][s][j], weight_wait))
            lists.append(tasks)
        table = TaskTable(
            variants=variants,
            lists=lists,
            events=events,
            weights=[WeightSpec(w["name"], w["dtype"], tuple(w["shape"])) for w in meta["weights"]],
            buffers=[BufferSpec(b["name"], b["offset"], b["dtype"], tuple(b["shape"]), b.get("role", "activation")) for b in meta["buffers"]],
            arena_bytes=meta["arena_bytes"],
            states=[StateSpec(st["name"], st["dtype"], tuple(st["shape"]), st.get("layout", "")) for st in meta.get("states", [])],
            comm=CommSpec(**meta["comm"]) if "comm" in meta else None,
        )
        eo = hdr[H_EVENTS_OFFSET]
        if list(words[eo : eo + hdr[H_NUM_EVENTS]]) != table.event_counts():
            raise TaskTableError("stored event counts disagree with the tasks")
        return table


def device_part(data: bytes) -> tuple[bytes, int, int]:
    """(the bytes to upload, word offset of the list offsets, word offset of the tasks)."""
    hdr = struct.unpack_from(f"<{HEADER_WORDS}i", data)
    if hdr[H_MAGIC] != MAGIC or hdr[H_VERSION] != FORMAT_VERSION:
        raise TaskTableError("not a k3mk task table of this format version")
    return data[: hdr[H_DEVICE_WORDS] * 4], hdr[H_LISTS_OFFSET], hdr[H_TASKS_OFFSET]


def read_header(data: bytes) -> dict[str, int]:
    hdr = struct.unpack_from(f"<{HEADER_WORDS}i", data)
    names = ("magic", "version", "header_words", "task_words", "num_lists", "num_tasks", "num_events",
             "num_variants", "lists_offset", "tasks_offset", "events_offset", "device_words", "meta_bytes")  # fmt: skip
    return dict(zip(names, hdr))


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a
