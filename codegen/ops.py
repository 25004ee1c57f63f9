"""What the emitter needs to know about each op kind: its template, its shared-memory need, and the
codegen-time constraints on its compile-time constants (checked before any CuTe DSL is traced).

Every op template (codegen/templates/<op>.py.j2) renders, for one variant `v`:
  def {{ v.fn }}_run(task, arena, weights, smem, scratch, tidx, warp, lane)     (always)
  def {{ v.fn }}_prefetch(task, arena, weights, tidx)                            (when `prefetch`)
as `@cute.jit` functions. `_prefetch` runs BEFORE the task's wait (weights only: never read an
activation there); `_run` runs after it. Neither knows about the task loop or the events.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from k3mk.ir.task_table import (
    OP_KINDS,
    TASK_HEADER_WORDS,
    AddParams,
    ArgmaxParams,
    EmbeddingParams,
    GemvParams,
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
    kernel_name: str = "k3mk_megakernel"
    # Tuning knobs (0 = the measured default, docs/megakernel.md "GPU results"):
    prefetch_bytes: int = 16 * 1024  # L2 bulk prefetch of the first bytes of a task's weights before its wait
    gemv_unroll: int = 0  # 16-byte weight loads in flight per lane per row (0: gemv_tuning's default)
    gemv_rows_per_warp: int = 0  # rows a warp streams at once (0: gemv_tuning's default)

    @property
    def warps(self) -> int:
        return self.threads // 32


@dataclass(frozen=True)
class OpCodegen:
    template: str
    smem_bytes: Callable[[object], int]
    check: Callable[[object], None]
    prefetch: bool = False


@dataclass(frozen=True)
class GemvTuning:
    unroll: int
    rows_per_warp: int
    prefetch_rows: int  # rows of the tile prefetched into L2 before the wait (0: none)


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
    rows = config.gemv_rows_per_warp or rows
    unroll = config.gemv_unroll or unroll
    prefetch_rows = -(-config.prefetch_bytes // (2 * p.in_features)) if config.prefetch_bytes > 0 else 0
    return GemvTuning(unroll, rows, prefetch_rows)


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

    def operand(self, name: str) -> int:
        """Task word holding operand `name` of this op kind."""
        return TASK_HEADER_WORDS + OP_KINDS[self.op].operands.index(name)


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise CodegenError(msg)


def _check_batch(b: int) -> None:
    _require(1 <= b <= MAX_BATCH, f"batch {b} outside [1, {MAX_BATCH}]")


def _check_gemv(p: GemvParams) -> None:
    _check_batch(p.batch)
    _require(p.in_features % VECTOR_ELEMENTS == 0, f"gemv in_features {p.in_features} not a multiple of {VECTOR_ELEMENTS}")
    _require((p.x_stride or p.in_features) % VECTOR_ELEMENTS == 0, "gemv x_stride must keep rows 16-byte aligned")
    _require(_gemv_smem(p) <= X_SMEM_BUDGET, f"gemv input batch*in*2 = {_gemv_smem(p)} B exceeds {X_SMEM_BUDGET} B of smem")


def _gemv_smem(p: GemvParams) -> int:
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


def _none(p: object) -> int:
    return 0


OP_CODEGEN: dict[str, OpCodegen] = {
    "nop": OpCodegen("nop.py.j2", _none, lambda p: None),
    "gemv": OpCodegen("gemv.py.j2", _gemv_smem, _check_gemv, prefetch=True),
    "rmsnorm": OpCodegen("rmsnorm.py.j2", _none, _check_rmsnorm),
    "embedding": OpCodegen("embedding.py.j2", _none, _check_embedding),
    "argmax": OpCodegen("argmax.py.j2", _none, _check_argmax),
    "add": OpCodegen("add.py.j2", _none, _check_add),
}
assert set(OP_CODEGEN) == set(OP_KINDS), "every op kind needs a template"


def variant_code(index: int, variant: OpVariant, config: KernelConfig) -> VariantCode:
    gen = OP_CODEGEN[variant.op]
    gen.check(variant.params)
    tuning = gemv_tuning(variant.params, config) if variant.op == "gemv" else None
    prefetch = gen.prefetch and (tuning is None or tuning.prefetch_rows > 0)
    return VariantCode(index, variant.op, variant.params, f"op{index}_{variant.op}", prefetch, tuning)


def smem_bytes(variants: list[OpVariant]) -> int:
    """Dynamic shared memory of the kernel: the largest op need, 128-byte rounded (ops share it)."""
    need = max([OP_CODEGEN[v.op].smem_bytes(v.params) for v in variants] + [16])
    return (need + 127) // 128 * 128
