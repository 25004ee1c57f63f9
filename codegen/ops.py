"""What the emitter needs to know about each op kind: its template, its shared-memory need, and the
codegen-time constraints on its compile-time constants (checked before any CuTe DSL is traced); and
the kernel's shared-memory map (the op smem, then the streaming ring: `ring_layout`).

Every op template (codegen/templates/<op>.py.j2) renders, for one variant `v`:
  def {{ v.fn }}_run(task, arena, weights, smem, scratch, iscratch, tidx, warp, lane[, fill])   (always)
  def {{ v.fn }}_fills(task, smem) -> Int32                                (ops that stream: `v.plan`)
  def {{ v.fn }}_produce(task, arena, weights, smem, fill, ...) -> Int32   (ops with a producer half)
as `@cute.jit` functions. `_run` is the consumer half: the CTA's consumer warps run it after the
task's waits; an op that streams reads its weights from the ring fills [fill, fill + _fills(task, smem))
(a grouped expert_gated's count depends on the step's routing: its `_run` leaves it in its op smem).
`_produce` is the producer half: ONE lane of the producer warp runs it when it reaches the task,
ahead of the consumers, and returns the next fill index; it issues the task's fills (or only L2
prefetches) and, except for the routed experts (ir/streaming.py PRODUCER_WAITS), never waits on an
event. Neither knows about the task loop, except for ops that wait inside their body (`sync`: the
collectives): their `_run` also gets (control, debug, epoch, cta, task_index, watchdog_ns) for the
task loop's `wait_event`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from k3mk.ir.streaming import SLOT_BYTES, X_SMEM_BUDGET, X_STAGE_BYTES, FillPlan, StreamingError, fill_plan, gemv_row_mma_split
from k3mk.ir.task_table import (
    MAX_ATTN_RES_SOURCES,
    OP_KINDS,
    TASK_HEADER_WORDS,
    TASK_WORDS,
    AddParams,
    ArgmaxParams,
    AttnResParams,
    EmbeddingParams,
    ExpertCombineParams,
    GemvParams,
    KdaConvParams,
    KdaRecurrenceParams,
    OpVariant,
    RmsnormParams,
)

VECTOR_ELEMENTS = 8  # bf16 per 16-byte load
MAX_BATCH = 16
# Beside the consumers: the producer warp (it also forwards the task records), the waiter and the signaller warps
# (megakernel.py.j2: events waited and released off the consumers). Where the consumers take more registers than the
# launch's even share (KernelConfig.moves_registers), a spare warp makes them one support warpgroup: `setmaxnreg`
# moves registers per warpgroup, this one dropping to KernelConfig.support_registers and the consumer warpgroups
# taking the rest (KernelConfig.consumer_registers).
SUPPORT_WARPS = 3
WARPGROUP = 4  # warps
WIDE_BATCH = 8  # KernelConfig.for_batch: from this many requests, registers move to the consumers
WIDE_SUPPORT_REGISTERS = 120
SELECT_WARPS = 8  # the consumer warps a batch-1 router's top-k spreads over (KernelConfig().warps; variant_code checks)
REGISTER_FILE = 65536  # 32-bit registers per SM (sm_90, sm_100)


class CodegenError(ValueError):
    """A variant the templates cannot generate."""


@dataclass(frozen=True)
class KernelConfig:
    """Compile-time constants of the whole kernel (one per artifact)."""

    threads: int = 256  # consumer threads: the op bodies' CTA (the block adds the producer, waiter and signaller warps)
    debug: bool = False  # watchdog on every wait (docs/megakernel.md)
    profile: bool = False  # per-task %globaltimer records (docs/megakernel.md "Profile builds")
    kernel_name: str = "k3mk_megakernel"
    # The streaming ring (docs/megakernel.md "The streaming task loop"): slots of `slot_bytes` in what the
    # op smem leaves (at most `ring_bytes`, 0: all of it); `records` task records forwarded ahead.
    slot_bytes: int = 0  # 0: by the kernel's fills (`fill_slot_bytes`, resolved by `for_kernel`)
    ring_bytes: int = 0
    records: int = 16
    # spans (a 16-byte vector per lane) per loop trip of the bf16 dot loops (0: by batch, `for_batch`, then `dot_unroll`)
    gemv_unroll: int = 0
    # 128-code spans per loop trip of the MXFP4 experts' MMA loops (0: the default, 2: a span is 4 MMAs, and the loop
    # is latency bound with 8 consumer warps, 2 per scheduler; measured 2026-12-02 on the K3-size gated expert GEMV:
    # 1 / 2 / 4 spans gave 2.34 / 2.55 / 2.54 TB/s, BENCHMARKS.md)
    mxfp4_unroll: int = 0
    # registers per thread of the support warpgroup after `setmaxnreg` (a multiple of 8 from 24; 0: by the kernel's
    # batch, `for_batch`): the producer's expert tables want ~150 to run without spills, the consumers' bodies ~200
    support_registers: int = 0

    def __post_init__(self):
        if self.threads % 128 or not 128 <= self.threads <= 1024 - 32 * WARPGROUP:
            raise CodegenError(
                f"KernelConfig.threads: expected a multiple of 128 (whole warpgroups: setmaxnreg) in [128, {1024 - 32 * WARPGROUP}], "
                f"found {self.threads}"
            )
        if self.support_registers and (self.support_registers % 8 or not 24 <= self.support_registers <= self.launch_registers):
            raise CodegenError(
                f"KernelConfig.support_registers: expected 0 (by batch) or a multiple of 8 in [24, {self.launch_registers}], "
                f"found {self.support_registers}"
            )

    def for_batch(self, batch: int) -> KernelConfig:
        """The knobs left at 0 set for a kernel whose largest op batch is `batch` (measured on the H200, 2026-12-04
        night, BENCHMARKS.md): from WIDE_BATCH requests the consumers take the registers the support warpgroup gives
        back (120 / 192) and every bf16 dot loop takes 2 spans a trip: Kimi Linear b8 -4.7%, the bf16 proxy b8 -1.7%,
        the K3 proxy b8 -1.4%. Below, the kernel is as before: at batch 1 and 4 the same changes measured 0.4-1.3%
        slower (consumers at 192 or the block at 384 threads), so it keeps the launch's even share and the few-chains
        unroll (`dot_unroll`)."""
        wide = batch >= WIDE_BATCH
        return replace(
            self,
            support_registers=self.support_registers or (WIDE_SUPPORT_REGISTERS if wide else self.launch_registers),
            gemv_unroll=self.gemv_unroll or (2 if wide else 0),
        )

    def for_kernel(self, variants: list[OpVariant]) -> KernelConfig:
        """The knobs left at 0 set for the kernel of `variants`: by its batch (`for_batch`) and its fills (the slot size,
        `fill_slot_bytes`)."""
        return replace(self.for_batch(kernel_batch(variants)), slot_bytes=self.slot_bytes or fill_slot_bytes(variants))

    @property
    def warps(self) -> int:
        return self.threads // 32

    def dot_unroll(self, chains: int) -> int:
        """gemv_unroll, by default 2 where a span feeds at most 2 MMA chains, else 1. With few chains a span is a
        few MMAs and the next span's loads fly under them (2 measured 2026-12-04 on every dot loop: Kimi Linear b1
        -1.0%, the K3 proxies b1 -2.5% / -1.5%, BENCHMARKS.md); with more, the chains' accumulators fill the
        registers and 2 spans spill (tests/codegen/test_streaming_codegen.py counts the spills)."""
        return self.gemv_unroll or (2 if chains <= 2 else 1)

    @property
    def moves_registers(self) -> bool:
        """Whether the consumers take registers from a support warpgroup (`for_batch` resolves a 0)."""
        if not self.support_registers:
            raise CodegenError("KernelConfig.support_registers is 0 (by batch): resolve it with for_batch first")
        return self.support_registers < self.launch_registers

    @property
    def block_threads(self) -> int:
        return self.threads + 32 * (WARPGROUP if self.moves_registers else SUPPORT_WARPS)

    @property
    def launch_registers(self) -> int:
        """ptxas's per-thread cap for one block per SM: the register file over the block's warps rounded up to
        whole warpgroups (a scheduler's share), in units of 8 (168 for 8 consumer warps and the 3 or 4 others)."""
        warps = -(-(self.warps + SUPPORT_WARPS) // WARPGROUP) * WARPGROUP
        return min(255, REGISTER_FILE // (32 * warps)) // 8 * 8

    @property
    def consumer_registers(self) -> int:
        """What each consumer thread holds: after `setmaxnreg`, the block's registers at launch less the support
        warpgroup's support_registers per thread (at most 256, a multiple of 8); else the launch's share."""
        if not self.moves_registers:
            return self.launch_registers
        free = self.launch_registers * self.block_threads - self.support_registers * WARPGROUP * 32
        return min(256, free // self.threads // 8 * 8)


KERNEL_TUNING = ("slot_bytes", "ring_bytes", "records", "gemv_unroll", "mxfp4_unroll", "support_registers")  # `k3mk compile --kernel-option` knobs


@dataclass(frozen=True)
class OpCodegen:
    template: str
    smem_bytes: Callable[[object], int]
    check: Callable[[object], None]
    produce: bool = False  # a producer half beyond the streamed fills (kda_recurrence: L2 prefetch of its state)
    sync: bool = False  # the op waits inside its body (module docstring)


@dataclass(frozen=True)
class GemvTuning:
    x_smem: bool = True  # the input is staged in smem; False: read from the arena (gemv_x_in_smem)


@dataclass(frozen=True)
class CombineTuning:
    prefetch: bool = False  # each warp's next input comes in (cp.async) while it sums the current one (combine_prefetches)


def combine_prefetches(p: ExpertCombineParams, config: KernelConfig | None, limit: int) -> bool:
    """Whether an expert_combine whose warps stage more than one input a task (batch > 1, or more slots than the
    kernel's consumer warps: rounds of (request, slot) pairs, each staging an L2 round trip before the round's first
    MMA) copies each warp's next input into a second buffer behind the current round's dots: where the buffer keeps the
    op's smem within `limit` (the kernel's x_staging_limit: what its other ops need, or X_STAGE_BYTES, as a gemv's
    staged input). `config`: the kernel's, resolved (`for_kernel`); None: the ring is not laid out yet
    (x_staging_limit's own sizes)."""
    if config is None or (p.batch == 1 and p.top_k <= config.warps):
        return False
    return fill_plan("expert_combine", p, config.slot_bytes) is not None and OP_CODEGEN["expert_combine"].smem_bytes(p, True) <= limit


def _x_needs_smem(p: GemvParams) -> bool:
    """Staged up to X_SMEM_BUDGET whatever the kernel's staging limit: the rmsnorm prologue needs the copy (passes/fuse_norm.py
    fuses a norm only where it fits: _check_gemv), gated_rmsnorm's tasks reuse it (a wider one reads x from the arena)."""
    return p.rmsnorm or p.epilogue == "gated_rmsnorm"


def gemv_x_in_smem(p: GemvParams, limit: int = X_SMEM_BUDGET) -> bool:
    """Stage x in smem when the rmsnorm prologue or gated_rmsnorm wants the copy (up to X_SMEM_BUDGET) or when
    it fits `limit` (x_staging_limit); otherwise the dot loop reads x from the arena (L1 / L2): K3's
    33792-wide dense down projection at batch >= 3, Kimi Linear's 9216-wide one at batch >= 3, K3's 7168-wide
    gated_rmsnorm g_proj at batch >= 12."""
    return p.batch * p.in_features * 2 <= (X_SMEM_BUDGET if _x_needs_smem(p) else min(limit, X_SMEM_BUDGET))


def kernel_batch(variants: list[OpVariant]) -> int:
    """The largest batch of a kernel's op variants (KernelConfig.for_batch)."""
    return max((getattr(v.params, "batch", 1) for v in variants), default=1)


SLOT_BYTES_MAX = 20 * 1024
GATED_FILL_MIN = 0.75  # the share of a slot a routed gated expert's one-row fill must use (fill_slot_bytes)


def fill_slot_bytes(variants: list[OpVariant]) -> int:
    """The ring's slot size: SLOT_BYTES, unless the kernel's routed gated experts fill a slot with one whole row's gate
    and up that uses less than GATED_FILL_MIN of it: then the bytes of the fewest whole rows that fill SLOT_BYTES, where
    that is at most SLOT_BYTES_MAX. A ring of N slots holds N fills in flight, and the gated experts are most of a
    batched step's bytes: Kimi Linear's 2304-wide rows (9,216 B, 56% of 16 KB) left its gated stage 83 KB in flight per
    SM in a 147 KB ring; two rows a slot (18,432 B) fill it (BENCHMARKS.md 2026-12-07 night). The other models' gated
    fills use 88-93% of 16 KB."""
    for v in variants:
        if v.op != "expert_gated":
            continue
        try:
            plan = fill_plan(v.op, v.params, SLOT_BYTES)
        except StreamingError:  # variant_code names it
            continue
        if plan is None or plan.chunks != 1 or plan.rows != 1:
            continue
        row = plan.fill_bytes(1, 0)
        if row < GATED_FILL_MIN * SLOT_BYTES:
            slot = -(-SLOT_BYTES // row) * row
            slot = -(-slot // 128) * 128
            if slot <= SLOT_BYTES_MAX:
                return slot
    return SLOT_BYTES


def x_staging_limit(variants: list[OpVariant]) -> int:
    """The most a gemv stages of an input it could read from the arena: what the kernel's other ops already
    need of the op smem, or X_STAGE_BYTES. The op smem is every op's and its largest need decides how many
    ring slots are left, so one wide dense projection must not take the ring's slots from every other task
    (Kimi Linear at batch 8: 4 slots instead of 11)."""
    return max([X_STAGE_BYTES] + [_op_smem(v) for v in variants if v.op != "gemv" or _x_needs_smem(v.params)])


def gemv_tuning(p: GemvParams, config: KernelConfig, limit: int = X_SMEM_BUDGET) -> GemvTuning:
    return GemvTuning(gemv_x_in_smem(p, limit))


# sm_90's 227 KB of dynamic smem per block less the reduction scratch (codegen/emit.py SCRATCH_BYTES).
OP_SMEM_LIMIT = 232448 - 1024
MIN_RING_SLOTS = 2
MBARRIER_BYTES = 8


@dataclass(frozen=True)
class RingLayout:
    """The kernel's shared memory (docs/megakernel.md "The streaming task loop"): the op smem (every op
    body's staging, shared), the ring of `slots` slots, the `records` forwarded task records, then one
    mbarrier per slot full / slot empty / record full / record empty / record ready / record done, an int32 per
    slot (its current fill), an int32 per record (the waiter's status),
    the producer's two int64 profile counters, the consumers' three int64 profile stamps, the debug watchdog's
    three int64 and, in profile builds, warp 0's fill wait (ring.py.j2 SLOT_SEQ, RECORD_STATUS, PRODUCER_STATS,
    CONSUMER_STATS, WATCHDOG, FILL_WAIT). Offsets in bytes."""

    op_bytes: int
    slot_bytes: int
    slots: int
    records: int
    profile: bool = False

    @property
    def ring_offset(self) -> int:
        return (self.op_bytes + 127) // 128 * 128

    @property
    def record_offset(self) -> int:
        return self.ring_offset + self.slots * self.slot_bytes

    @property
    def barrier_offset(self) -> int:
        return self.record_offset + self.records * TASK_WORDS * 4

    @property
    def total(self) -> int:
        stats = 16 + 24 + 24 + (8 if self.profile else 0)
        end = self.barrier_offset + (2 * self.slots + 4 * self.records) * MBARRIER_BYTES + (4 * self.slots + 4 * self.records + 7) // 8 * 8 + stats
        return (end + 127) // 128 * 128


def ring_layout(variants: list[OpVariant], config: KernelConfig = KernelConfig()) -> RingLayout:
    """The largest op need first, then as many slots as the rest holds (at most config.ring_bytes; a
    kernel whose ops do not stream gets the fewest slots, which leaves the L1 its share)."""
    config = config.for_kernel(variants)
    _require(config.slot_bytes % 128 == 0 and config.slot_bytes >= 1024, f"slot_bytes {config.slot_bytes} must be a multiple of 128 >= 1024")
    _require(config.records >= 2, f"records {config.records} < 2")
    x_limit = x_staging_limit(variants)
    op_bytes = max([_op_smem(v, x_limit, config) for v in variants] + [16])
    streaming = any(fill_plan(v.op, v.params, config.slot_bytes) is not None for v in variants)
    slots = (config.ring_bytes or OP_SMEM_LIMIT) // config.slot_bytes if streaming else MIN_RING_SLOTS
    while slots > 0 and RingLayout(op_bytes, config.slot_bytes, slots, config.records, config.profile).total > OP_SMEM_LIMIT:
        slots -= 1
    _require(slots >= MIN_RING_SLOTS, f"the op smem ({op_bytes} B) leaves {slots} ring slots of {config.slot_bytes} B (< {MIN_RING_SLOTS})")
    return RingLayout(op_bytes, config.slot_bytes, slots, config.records, config.profile)


@dataclass(frozen=True)
class VariantCode:
    """One variant as the templates see it: `p` is its typed record of constants, `tuning` the
    op's implementation choices (a typed record too, or None), `plan` its fill geometry when it streams
    its weights through the ring (ir/streaming.py)."""

    index: int
    op: str
    p: object
    fn: str
    produce: bool  # the template has a producer half (`_produce`)
    tuning: object = None
    plan: FillPlan | None = None
    sync: bool = False

    @property
    def stream(self) -> bool:
        return self.plan is not None

    def operand(self, name: str) -> int:
        """Task word holding operand `name` of this op kind."""
        return TASK_HEADER_WORDS + OP_KINDS[self.op].operands.index(name)


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise CodegenError(msg)


def _check_batch(b: int) -> None:
    _require(1 <= b <= MAX_BATCH, f"batch {b} outside [1, {MAX_BATCH}]")


GEMV_EPILOGUES = ("none", "silu_mul", "situ_mul", "sigmoid_gate", "kda_gate", "gated_rmsnorm", "router")
MAX_TOP_K = 32
MAX_SELECT_EXPERTS = 32 * 32  # topk_select.py.j2 keeps ceil(E / 32) scores per lane in registers
GATED_EPILOGUES = ("silu_mul", "situ_mul")
MAX_RESIDUALS = 4  # operands residual, residual2, residual3, residual4


def _check_select(name: str, num_experts: int, top_k: int) -> None:
    """The router's selection (topk_select.py.j2)."""
    _require(1 <= top_k <= min(num_experts, MAX_TOP_K), f"{name} top_k {top_k} outside [1, min(E, {MAX_TOP_K})]")
    _require(num_experts <= MAX_SELECT_EXPERTS, f"{name}: {num_experts} experts > {MAX_SELECT_EXPERTS} (selection scores per lane in registers)")


def _check_gemv(p: GemvParams) -> None:
    _check_batch(p.batch)
    _require(p.in_features % VECTOR_ELEMENTS == 0, f"gemv in_features {p.in_features} not a multiple of {VECTOR_ELEMENTS}")
    _require((p.x_stride or p.in_features) % VECTOR_ELEMENTS == 0, "gemv x_stride must keep rows 16-byte aligned")
    _require(gemv_x_in_smem(p) or not p.rmsnorm,
             f"gemv input batch*in*2 = {p.batch * p.in_features * 2} B exceeds {X_SMEM_BUDGET} B of smem (needed by the rmsnorm prologue)")  # fmt: skip
    _require(p.epilogue in GEMV_EPILOGUES, f"gemv epilogue {p.epilogue!r}; known: {GEMV_EPILOGUES}")
    _require(p.out_dtype in ("bfloat16", "float32"), f"gemv out_dtype {p.out_dtype!r}")
    _require(0 <= p.residuals <= MAX_RESIDUALS, f"gemv residuals {p.residuals} outside [0, {MAX_RESIDUALS}]")
    _require(p.residuals == 0 or (p.epilogue == "none" and p.out_dtype == "bfloat16"),
             "gemv residuals need the plain bf16 epilogue")  # fmt: skip
    _require((p.out_dtype == "float32") == (p.epilogue in ("kda_gate", "router")) or p.epilogue == "none",
             f"gemv epilogue {p.epilogue!r} writes {'float32' if p.epilogue in ('kda_gate', 'router') else 'bfloat16'}")  # fmt: skip
    if p.epilogue == "router":
        _check_select("gemv router", p.out_features, p.top_k)
    if p.epilogue in ("kda_gate", "gated_rmsnorm"):
        _require(p.head_dim > 0 and p.out_features % p.head_dim == 0, f"gemv {p.epilogue}: head_dim {p.head_dim} must divide {p.out_features}")
    if p.epilogue == "gated_rmsnorm":
        _require(p.head_dim % VECTOR_ELEMENTS == 0, f"gemv gated_rmsnorm head_dim {p.head_dim} not a multiple of {VECTOR_ELEMENTS}")
    if p.epilogue == "situ_mul":
        _require(p.beta > 0 and (p.linear_beta is None or p.linear_beta > 0), "situ_mul needs beta, linear_beta > 0")


def gemv_rstd_offset(p: GemvParams) -> int:
    """gated_rmsnorm: byte offset of the per-(batch, head) fp32 rstd table, after the staged input if any."""
    return (p.batch * p.in_features * 2 + 15) // 16 * 16 if gemv_x_in_smem(p) else 0


# A row-MMA gemv's partial C fragments where a task of one group is split over the warps (gemv.py.j2,
# ir/streaming.py FillPlan.split_warps): per consumer warp 32 lanes x 4 fp32 per n-tile of 8 requests (4 KB per
# n-tile at 8 warps), after the staged input (and the rstd table)
PARTIAL_WARPS = KernelConfig().warps


def _gemv_staged_bytes(p: GemvParams) -> int:
    """The staged input, and gated_rmsnorm's rstd table after it."""
    if p.epilogue == "gated_rmsnorm":
        return gemv_rstd_offset(p) + p.batch * (p.out_features // p.head_dim) * 4
    return p.batch * p.in_features * 2


def gemv_partials_offset(p: GemvParams) -> int:
    return (_gemv_staged_bytes(p) + 15) // 16 * 16


def router_select_spread(p: GemvParams) -> bool:
    """A router gemv's top-k by every consumer warp (topk_select.py.j2 `_select_spread`): at batch 1 and at most one
    expert per consumer thread (Kimi Linear's 256: its critical path -1.2%). With K3's 896 a lane ranks 4 experts
    against its warp's 128 (unrolled, cold code) and the step measured 0.3% slower than the one-warp rounds."""
    return p.epilogue == "router" and p.batch == 1 and p.out_features <= 32 * SELECT_WARPS


def gemv_select_offset(p: GemvParams, x_smem: bool) -> int:
    """Where `_select_spread`'s candidates go: after the staged input (which a later task of the same variant and
    input may reuse: passes/emit_task_table.py x_staged)."""
    return gemv_partials_offset(p) if x_smem else 0


def _router_select_bytes(p: GemvParams) -> int:
    """`_select_spread`'s candidates (score, s, index: top_k per 32 experts) and the chosen (s, index)."""
    candidates = -(-p.out_features // 32) * p.top_k
    return 4 * (3 * candidates + 2 * p.top_k)


def _gemv_op_smem(p: GemvParams, limit: int = X_SMEM_BUDGET) -> int:
    """The register path's smem: the staged input (and the rstd table), then a row-MMA gemv's partial sums or a
    batch-1 router's selection."""
    if router_select_spread(p):
        return gemv_select_offset(p, gemv_x_in_smem(p, limit)) + _router_select_bytes(p)
    if not gemv_x_in_smem(p, limit):
        return _gemv_staged_bytes(p) if p.epilogue == "gated_rmsnorm" else 0  # x read from the arena (no rmsnorm: _check_gemv)
    if gemv_row_mma_split(p):
        return gemv_partials_offset(p) + PARTIAL_WARPS * 32 * 16 * -(-p.batch // 8)
    return _gemv_staged_bytes(p)


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
    _require(0 <= p.value_rows <= p.head_dim, f"kda_recurrence value_rows {p.value_rows} not in [0, head_dim {p.head_dim}]")


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
    "gemv": OpCodegen("gemv.py.j2", _gemv_op_smem, _check_gemv),
    "rmsnorm": OpCodegen("rmsnorm.py.j2", _none, _check_rmsnorm),
    "embedding": OpCodegen("embedding.py.j2", _none, _check_embedding),
    "argmax": OpCodegen("argmax.py.j2", _none, _check_argmax),
    "add": OpCodegen("add.py.j2", _none, _check_add),
    "kda_conv": OpCodegen("kda_conv.py.j2", _none, _check_kda_conv, produce=True),
    "kda_recurrence": OpCodegen("kda_recurrence.py.j2", _none, _check_kda_recurrence, produce=True),
    "attn_res": OpCodegen("attn_res.py.j2", _attn_res_smem, _check_attn_res),
}
from k3mk.codegen.ops_moe_mla import MOE_MLA_CODEGEN  # noqa: E402  (the MoE / MLA ops live in their own module)

OP_CODEGEN.update(MOE_MLA_CODEGEN)
from k3mk.codegen.ops_tp import TP_CODEGEN  # noqa: E402  (and the tensor-parallel ops theirs)

OP_CODEGEN.update(TP_CODEGEN)
assert set(OP_CODEGEN) == set(OP_KINDS), "every op kind needs a template"


def variant_code(index: int, variant: OpVariant, config: KernelConfig, x_limit: int = X_SMEM_BUDGET) -> VariantCode:
    """`x_limit`: the kernel's x_staging_limit; `config` resolved (`KernelConfig.for_kernel`)."""
    _require(config.slot_bytes > 0, "variant_code needs the kernel's slot size: resolve the KernelConfig with for_kernel")
    gen = OP_CODEGEN[variant.op]
    gen.check(variant.params)
    tuning = None
    if variant.op == "gemv":
        tuning = gemv_tuning(variant.params, config, x_limit)
    elif variant.op == "expert_combine":
        tuning = CombineTuning(combine_prefetches(variant.params, config, x_limit))
    try:
        plan = fill_plan(variant.op, variant.params, config.slot_bytes)
    except StreamingError as e:
        raise CodegenError(str(e)) from None
    if plan is not None and plan.row_mma and not tuning.x_smem:  # ir/streaming.py gemv_stages_x promised it
        raise CodegenError(f"gemv {variant.params}: a row-MMA fill plan but its input is not staged")
    if variant.op == "gemv" and router_select_spread(variant.params) and config.warps != SELECT_WARPS:
        raise CodegenError(f"gemv {variant.params}: a batch-1 router's top-k is laid out for {SELECT_WARPS} consumer warps, not {config.warps}")
    if plan is not None and plan.split and config.warps > PARTIAL_WARPS:  # _gemv_op_smem sized the partials for PARTIAL_WARPS
        raise CodegenError(f"gemv {variant.params}: a split row-MMA plan needs at most {PARTIAL_WARPS} consumer warps, not {config.warps}")
    return VariantCode(index, variant.op, variant.params, f"op{index}_{variant.op}", gen.produce or plan is not None, tuning, plan, gen.sync)


def _op_smem(variant: OpVariant, x_limit: int = X_SMEM_BUDGET, config: KernelConfig | None = None) -> int:
    """`x_limit` and `config`: the kernel's staging limit and resolved config (None: the ops' needs before the optional
    stagings, x_staging_limit's)."""
    if variant.op == "gemv":
        return _gemv_op_smem(variant.params, x_limit)
    if variant.op == "expert_combine":
        return OP_CODEGEN["expert_combine"].smem_bytes(variant.params, combine_prefetches(variant.params, config, x_limit))
    return OP_CODEGEN[variant.op].smem_bytes(variant.params)


def smem_bytes(variants: list[OpVariant], config: KernelConfig = KernelConfig()) -> int:
    """Dynamic shared memory of the kernel before the reduction scratch: the op smem and the ring."""
    return ring_layout(variants, config).total
