"""What the emitter needs to know about each op kind: its template, its shared-memory need, and the
codegen-time constraints on its compile-time constants (checked before any CuTe DSL is traced).

Every op template (codegen/templates/<op>.py.j2) renders, for one variant `v`:
  def {{ v.fn }}_run(task, arena, weights, smem, scratch, tidx, warp, lane)     (always)
  def {{ v.fn }}_prefetch(task, arena, weights, tidx)                            (when `prefetch`)
as `@cute.jit` functions. `_prefetch` runs BEFORE the task's wait (weights only: never read an
activation there); `_run` runs after it. Neither knows about the task loop or the events, except for
ops that wait inside their body (`sync`: the collectives, which wait for the other ranks): their `_run`
also gets (control, debug, epoch, cta, task_index, watchdog_ns) for the task loop's `wait_event`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from k3mk.ir.task_table import (
    MAX_ATTN_RES_SOURCES,
    OP_KINDS,
    TASK_HEADER_WORDS,
    AddParams,
    ArgmaxParams,
    AttnResParams,
    EmbeddingParams,
    GemvParams,
    KdaConvParams,
    KdaRecurrenceParams,
    OpVariant,
    RmsnormParams,
)

VECTOR_ELEMENTS = 8  # bf16 per 16-byte load
MAX_BATCH = 16
X_SMEM_BUDGET = 160 * 1024  # GEMV stages its (normalised) input in shared memory


class CodegenError(ValueError):
    """A variant the templates cannot generate."""


@dataclass(frozen=True)
class KernelConfig:
    """Compile-time constants of the whole kernel (one per artifact)."""

    threads: int = 256
    debug: bool = False  # watchdog on every wait (docs/megakernel.md)
    profile: bool = False  # per-task %globaltimer records (docs/megakernel.md "Profile builds")
    kernel_name: str = "k3mk_megakernel"
    # Tuning knobs (0 = the measured default, docs/megakernel.md "GPU results"):
    prefetch_bytes: int = 16 * 1024  # L2 bulk prefetch of the first bytes of a task's weights before its wait
    gemv_unroll: int = 0  # 16-byte weight loads in flight per lane per row (0: gemv_tuning's default)
    gemv_rows_per_warp: int = 0  # rows a warp streams at once (0: gemv_tuning's default)
    # Weight streaming (gemv_stream): the gemv reads its weights from smem slots filled by 1-D bulk
    # copies, the first ones issued before the task's wait. Off: the register-load path.
    weight_stream: bool = False
    stream_stages: int = 4  # slots per warp (copies in flight per warp)
    stream_bytes: int = 128 * 1024  # the ring of slots per CTA (shrunk where the staged input leaves less)

    @property
    def warps(self) -> int:
        return self.threads // 32


@dataclass(frozen=True)
class OpCodegen:
    template: str
    smem_bytes: Callable[[object], int]
    check: Callable[[object], None]
    prefetch: bool = False
    sync: bool = False  # the op waits inside its body (module docstring)


@dataclass(frozen=True)
class GemvStream:
    """The weight-streaming layout of one gemv variant (KernelConfig.weight_stream). Each warp owns
    `stages` slots; a fill is `rows_per_warp` rows x one K chunk of `chunk` elements (the gate rows,
    then the up rows when gated), one bulk copy per row. A warp's fills run group by group (its rows
    of the tile), chunk by chunk; fill f goes to slot f % stages. Slots are warp-private: the warp
    that reads a slot refills it, so no slot is shared between warps."""

    stages: int
    chunk: int  # elements per row per fill (a multiple of 8; the last chunk of a row may be shorter)
    chunks: int  # fills per row group: ceil(in / chunk)
    slot_bytes: int
    ring_offset: int  # byte offset of the slots in the op smem, after the staged input (and rstd)
    ring_bytes: int


@dataclass(frozen=True)
class GemvTuning:
    unroll: int
    rows_per_warp: int
    prefetch_rows: int  # rows of the tile prefetched into L2 before the wait (0: none)
    x_smem: bool = True  # the input is staged in smem; False: read from the arena (gemv_x_in_smem)
    stream: GemvStream | None = None  # weight streaming (KernelConfig.weight_stream)


def gemv_x_in_smem(p: GemvParams) -> bool:
    """Stage x in smem unless it does not fit (batch * in * 2 > X_SMEM_BUDGET: K3's 33792-wide dense down
    projection at batch >= 3): then the dot loop reads x from the arena (L1 / L2). The rmsnorm prologue
    and the gated_rmsnorm statistics need the smem copy (checked by _check_gemv)."""
    return p.batch * p.in_features * 2 <= X_SMEM_BUDGET


def gemv_tuning(p: GemvParams, config: KernelConfig) -> GemvTuning:
    """Measured defaults (H200, 2026-11-29, 16384x7168 GEMV over 132 CTAs x 4 tasks; docs/megakernel.md):
    batch 1: 4 rows per warp, unroll 4 (2.70 TB/s; 8 rows 1.95, 2 rows 1.86); batch 4: 4 rows, unroll 8
    (2.76 TB/s; 2 rows unroll 4 2.39). Larger batches take 1 row x unroll 4 (registers: the
    accumulators are rows x batch fp32; 2 rows at batch 16 needed 242 registers). Whole-tile L2 prefetch cost 10-15%: the window is 16 KB."""
    if p.batch == 1:
        rows, unroll = 4, 4
    elif p.batch <= 4:
        rows, unroll = 4, 8
    else:
        rows, unroll = 1, 4
    if p.epilogue in GATED_EPILOGUES:
        rows = max(1, rows // 2)  # two weight streams per row (gate and up): the same loads in flight
    rows = config.gemv_rows_per_warp or rows
    unroll = config.gemv_unroll or unroll
    if config.weight_stream:  # the bulk copies replace the L2 prefetch window
        return GemvTuning(unroll, rows, 0, gemv_x_in_smem(p), gemv_stream(p, rows, config))
    prefetch_rows = -(-config.prefetch_bytes // (2 * p.in_features)) if config.prefetch_bytes > 0 else 0
    return GemvTuning(unroll, rows, prefetch_rows, gemv_x_in_smem(p))


# sm_90's 227 KB of dynamic smem per block less the reduction scratch (codegen/emit.py SCRATCH_BYTES).
OP_SMEM_LIMIT = 232448 - 1024
MAX_STREAM_STAGES = 8
MIN_STREAM_CHUNK = 64  # elements per row per fill: below this the copies get too small to stream well
LANE_ORDER_ELEMENTS = 32 * VECTOR_ELEMENTS  # one 16-byte load per lane: the dot loop's stride over a row


def stream_state_bytes(config: KernelConfig) -> int:
    """The persistent weight-streaming state at the end of the kernel's smem (no op uses it): one
    mbarrier per slot, then one int32 of phase bits per warp (bit s: the parity slot s waits for next)."""
    return (config.warps * config.stream_stages * 8 + config.warps * 4 + 127) // 128 * 128


def gemv_stream(p: GemvParams, rows: int, config: KernelConfig) -> GemvStream:
    """Split the ring (config.stream_bytes, or what the staged input leaves of the smem) into
    warps x stages slots, and each row into the fewest equal chunks (multiples of 8) a slot holds."""
    _require(1 <= config.stream_stages <= MAX_STREAM_STAGES, f"stream_stages {config.stream_stages} outside [1, {MAX_STREAM_STAGES}]")
    ring_offset = (_gemv_op_smem(p) + 127) // 128 * 128
    ring = min(config.stream_bytes, OP_SMEM_LIMIT - stream_state_bytes(config) - ring_offset)
    streams = rows * (2 if p.epilogue in GATED_EPILOGUES else 1)  # rows copied per fill
    fit = ring // (config.warps * config.stream_stages * streams * 2) // VECTOR_ELEMENTS * VECTOR_ELEMENTS
    _require(fit >= min(MIN_STREAM_CHUNK, p.in_features),
             f"gemv weight streaming: {ring} B of smem left for {config.warps} warps x {config.stream_stages} slots x "
             f"{streams} rows gives {fit} elements per row per fill (< {MIN_STREAM_CHUNK}): lower stream_stages or the batch")  # fmt: skip
    # Equal chunks of the fewest fills, then their count again (rounding up may need fewer). Chunks of a
    # multiple of LANE_ORDER_ELEMENTS start every lane where the register path's lane would be, so each
    # lane sums the same elements in the same order and the streamed build computes the release build's
    # values bit for bit (other chunks regroup the fp32 partial sums: a different rounding).
    step = LANE_ORDER_ELEMENTS if fit >= LANE_ORDER_ELEMENTS else VECTOR_ELEMENTS
    fit = fit // step * step
    chunk = -(-p.in_features // (-(-p.in_features // fit) * step)) * step
    chunks = -(-p.in_features // chunk)
    slot_bytes = streams * chunk * 2
    return GemvStream(config.stream_stages, chunk, chunks, slot_bytes, ring_offset, config.warps * config.stream_stages * slot_bytes)


@dataclass(frozen=True)
class VariantCode:
    """One variant as the templates see it: `p` is its typed record of constants, `tuning` the
    op's implementation choices (a typed record too, or None)."""

    index: int
    op: str
    p: object
    fn: str
    prefetch: bool
    tuning: object = None
    sync: bool = False

    @property
    def stream(self) -> bool:
        """The op streams its weights through smem slots (its _prefetch also takes the smem)."""
        return getattr(self.tuning, "stream", None) is not None

    def operand(self, name: str) -> int:
        """Task word holding operand `name` of this op kind."""
        return TASK_HEADER_WORDS + OP_KINDS[self.op].operands.index(name)


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise CodegenError(msg)


def _check_batch(b: int) -> None:
    _require(1 <= b <= MAX_BATCH, f"batch {b} outside [1, {MAX_BATCH}]")


GEMV_EPILOGUES = ("none", "silu_mul", "situ_mul", "sigmoid_gate", "kda_gate", "gated_rmsnorm")
GATED_EPILOGUES = ("silu_mul", "situ_mul")
MAX_RESIDUALS = 4  # operands residual, residual2, residual3, residual4


def _check_gemv(p: GemvParams) -> None:
    _check_batch(p.batch)
    _require(p.in_features % VECTOR_ELEMENTS == 0, f"gemv in_features {p.in_features} not a multiple of {VECTOR_ELEMENTS}")
    _require((p.x_stride or p.in_features) % VECTOR_ELEMENTS == 0, "gemv x_stride must keep rows 16-byte aligned")
    _require(gemv_x_in_smem(p) or not (p.rmsnorm or p.epilogue == "gated_rmsnorm"),
             f"gemv input batch*in*2 = {p.batch * p.in_features * 2} B exceeds {X_SMEM_BUDGET} B of smem (needed by the rmsnorm prologue / gated_rmsnorm)")  # fmt: skip
    _require(p.epilogue in GEMV_EPILOGUES, f"gemv epilogue {p.epilogue!r}; known: {GEMV_EPILOGUES}")
    _require(p.out_dtype in ("bfloat16", "float32"), f"gemv out_dtype {p.out_dtype!r}")
    _require(0 <= p.residuals <= MAX_RESIDUALS, f"gemv residuals {p.residuals} outside [0, {MAX_RESIDUALS}]")
    _require(p.residuals == 0 or (p.epilogue == "none" and p.out_dtype == "bfloat16"),
             "gemv residuals need the plain bf16 epilogue")  # fmt: skip
    _require((p.out_dtype == "float32") == (p.epilogue == "kda_gate") or p.epilogue == "none",
             f"gemv epilogue {p.epilogue!r} writes {'float32' if p.epilogue == 'kda_gate' else 'bfloat16'}")  # fmt: skip
    if p.epilogue in ("kda_gate", "gated_rmsnorm"):
        _require(p.head_dim > 0 and p.out_features % p.head_dim == 0, f"gemv {p.epilogue}: head_dim {p.head_dim} must divide {p.out_features}")
    if p.epilogue == "gated_rmsnorm":
        _require(p.head_dim % VECTOR_ELEMENTS == 0, f"gemv gated_rmsnorm head_dim {p.head_dim} not a multiple of {VECTOR_ELEMENTS}")
        _require((p.o_stride or p.out_features) % VECTOR_ELEMENTS == 0, "gemv o_stride must keep rows 16-byte aligned")
    if p.epilogue == "situ_mul":
        _require(p.beta > 0 and (p.linear_beta is None or p.linear_beta > 0), "situ_mul needs beta, linear_beta > 0")


def _gemv_rstd_offset(p: GemvParams) -> int:
    """gated_rmsnorm: byte offset of the per-(batch, head) fp32 rstd table, after the staged input."""
    return (p.batch * p.in_features * 2 + 15) // 16 * 16


def _gemv_op_smem(p: GemvParams) -> int:
    """The register path's smem: the staged input (and the rstd table)."""
    if not gemv_x_in_smem(p):
        return 0  # x read from the arena (no rmsnorm, no gated_rmsnorm: _check_gemv)
    if p.epilogue == "gated_rmsnorm":
        return _gemv_rstd_offset(p) + p.batch * (p.out_features // p.head_dim) * 4
    return p.batch * p.in_features * 2


def _check_rmsnorm(p: RmsnormParams) -> None:
    _check_batch(p.batch)
    _require(p.dim % VECTOR_ELEMENTS == 0, f"rmsnorm dim {p.dim} not a multiple of {VECTOR_ELEMENTS}")


def _check_embedding(p: EmbeddingParams) -> None:
    _check_batch(p.batch)
    _require(p.dim % VECTOR_ELEMENTS == 0, f"embedding dim {p.dim} not a multiple of {VECTOR_ELEMENTS}")


def _check_argmax(p: ArgmaxParams) -> None:
    _check_batch(p.batch)
    _require(p.dtype in ("bfloat16", "float32"), f"argmax dtype {p.dtype!r}")


def _check_add(p: AddParams) -> None:
    _require(p.dtype == "bfloat16", f"add dtype {p.dtype!r}")


def _check_kda_conv(p: KdaConvParams) -> None:
    _check_batch(p.batch)
    _require(p.channels % VECTOR_ELEMENTS == 0, f"kda_conv channels {p.channels} not a multiple of {VECTOR_ELEMENTS}")
    _require(2 <= p.width <= 8, f"kda_conv width {p.width} outside [2, 8]")
    for stride in (p.x_stride, p.out_stride):
        _require(stride % VECTOR_ELEMENTS == 0, "kda_conv strides must keep rows 16-byte aligned")


def _check_kda_recurrence(p: KdaRecurrenceParams) -> None:
    _check_batch(p.batch)
    _require(p.head_dim in (64, 128, 256), f"kda_recurrence head_dim {p.head_dim} not in (64, 128, 256)")
    _require(p.num_heads >= 1, "kda_recurrence needs heads")


def _check_attn_res(p: AttnResParams) -> None:
    _check_batch(p.batch)
    _require(p.dim % VECTOR_ELEMENTS == 0, f"attn_res dim {p.dim} not a multiple of {VECTOR_ELEMENTS}")
    _require(1 <= p.num_sources <= MAX_ATTN_RES_SOURCES, f"attn_res sources {p.num_sources} outside [1, {MAX_ATTN_RES_SOURCES}]")


def _attn_res_smem(p: AttnResParams) -> int:
    return 2 * p.num_sources * 32 * 4  # per-warp partial sums (up to 32 warps)


def _none(p: object) -> int:
    return 0


OP_CODEGEN: dict[str, OpCodegen] = {
    "nop": OpCodegen("nop.py.j2", _none, lambda p: None),
    "gemv": OpCodegen("gemv.py.j2", _gemv_op_smem, _check_gemv, prefetch=True),
    "rmsnorm": OpCodegen("rmsnorm.py.j2", _none, _check_rmsnorm),
    "embedding": OpCodegen("embedding.py.j2", _none, _check_embedding),
    "argmax": OpCodegen("argmax.py.j2", _none, _check_argmax),
    "add": OpCodegen("add.py.j2", _none, _check_add),
    "kda_conv": OpCodegen("kda_conv.py.j2", _none, _check_kda_conv),
    "kda_recurrence": OpCodegen("kda_recurrence.py.j2", _none, _check_kda_recurrence, prefetch=True),
    "attn_res": OpCodegen("attn_res.py.j2", _attn_res_smem, _check_attn_res),
}
from k3mk.codegen.ops_moe_mla import MOE_MLA_CODEGEN  # noqa: E402  (the MoE / MLA ops live in their own module)

OP_CODEGEN.update(MOE_MLA_CODEGEN)
from k3mk.codegen.ops_tp import TP_CODEGEN  # noqa: E402  (and the tensor-parallel ops theirs)

OP_CODEGEN.update(TP_CODEGEN)
assert set(OP_CODEGEN) == set(OP_KINDS), "every op kind needs a template"


def variant_code(index: int, variant: OpVariant, config: KernelConfig) -> VariantCode:
    gen = OP_CODEGEN[variant.op]
    gen.check(variant.params)
    tuning = gemv_tuning(variant.params, config) if variant.op == "gemv" else None
    prefetch = gen.prefetch and (tuning is None or tuning.prefetch_rows > 0 or tuning.stream is not None)
    return VariantCode(index, variant.op, variant.params, f"op{index}_{variant.op}", prefetch, tuning, gen.sync)


def _op_smem(variant: OpVariant, config: KernelConfig) -> int:
    if variant.op == "gemv" and config.weight_stream:
        stream = gemv_tuning(variant.params, config).stream
        return stream.ring_offset + stream.ring_bytes
    return OP_CODEGEN[variant.op].smem_bytes(variant.params)


def smem_bytes(variants: list[OpVariant], config: KernelConfig = KernelConfig()) -> int:
    """Dynamic shared memory of the kernel: the largest op need, 128-byte rounded (ops share it), then
    the weight-streaming state (stream_state_bytes) when streaming, which no op overlaps."""
    need = max([_op_smem(v, config) for v in variants] + [16])
    state = stream_state_bytes(config) if config.weight_stream else 0
    return (need + 127) // 128 * 128 + state
