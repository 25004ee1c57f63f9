"""Render the megakernel's CuTe DSL source for a task table's op variants.

The kernel depends only on the variants (and the KernelConfig), not on the tasks: a table with the
same variants but other tasks, events or SM lists runs on the same cubin.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import jinja2

from k3mk.codegen.ops import (
    OP_CODEGEN,
    PARTIAL_WARPS,
    KernelConfig,
    VariantCode,
    gemv_partials_offset,
    gemv_rstd_offset,
    gemv_select_offset,
    ring_layout,
    router_select_spread,
    smem_bytes,
    variant_code,
    x_staging_limit,
)
from k3mk.codegen.ops_moe_mla import v_up_layout
from k3mk.ir import task_table as tt
from k3mk.ir.streaming import COMBINE_BATCH_ROWS, MXFP4_SPAN, ROW_MMA_SPAN, mxfp4_padded
from k3mk.ir.task_table import OpVariant
from k3mk.runtime import abi

TEMPLATES = Path(__file__).parent / "templates"
SCRATCH_BYTES = 1024  # the fp32 / int32 reduction scratch beside the op smem, with alignment slack
BLOCK_SUMS = 8  # CTA-wide sums one reduction round may carry (fp32 scratch of BLOCK_SUMS x warps: 256 B)


def group_size(n: int, limit: int) -> int:
    """The largest divisor of n that is at most max(limit, 1): rows reduced together, in equal groups."""
    return max(d for d in range(1, max(1, min(n, limit)) + 1) if n % d == 0)


_ENV = jinja2.Environment(
    loader=jinja2.FileSystemLoader(str(TEMPLATES)),
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
    keep_trailing_newline=True,
)
_ENV.globals.update(mxfp4_padded=mxfp4_padded, MXFP4_SPAN=MXFP4_SPAN, ROW_MMA_SPAN=ROW_MMA_SPAN)  # staged-x and span geometry
_ENV.globals.update(COMBINE_BATCH_ROWS=COMBINE_BATCH_ROWS)  # expert_combine's batches of row groups (ir/streaming.py)
_ENV.globals.update(COMBINE_RESIDUAL_OPERANDS=tt.COMBINE_RESIDUAL_OPERANDS)  # expert_combine's residuals, in add order
_ENV.globals.update(BLOCK_SUMS=BLOCK_SUMS, group_size=group_size)
_ENV.globals.update(gemv_partials_offset=gemv_partials_offset, PARTIAL_WARPS=PARTIAL_WARPS)  # a row-MMA gemv's partial sums
_ENV.globals.update(gemv_rstd_offset=gemv_rstd_offset)  # gated_rmsnorm's rstd table
_ENV.globals.update(router_select_spread=router_select_spread, gemv_select_offset=gemv_select_offset)  # a batch-1 router's top-k
_ENV.globals.update(v_up_layout=v_up_layout)  # mla_v_up's smem regions
_ENV.globals.update(FLAT_VIEW=1 << 30)  # the extent of an arena view that bounds no index (gemv.py.j2 at batch 1)
_ENV.globals.update(FLOAT32_MAX=3.4028234663852886e38)  # the largest finite float32 (topk_select.py.j2)


def dynamic_smem_bytes(variants: list[OpVariant], config: KernelConfig = KernelConfig()) -> int:
    """What the launch must pass as dynamic shared memory (op smem + scratch)."""
    return smem_bytes(variants, config) + SCRATCH_BYTES


def shared_code(codes: list[VariantCode], sources: list[str]) -> list[int]:
    """For each variant, the variant whose function runs its tasks: the first one whose source is the same but for its
    name and comments (at batch 1, the gemvs of one input width and epilogue whatever their rows). Their tasks share
    one function and one call site, so the SM fetches that code once for all of them: a task whose code is cold
    pays for fetching it (the kda_conv's copies, BENCHMARKS.md 2026-12-07 midday)."""
    first: dict[str, int] = {}
    runs = []
    for c, source in zip(codes, sources):
        text = re.sub(rf"\bop{c.index}_", "op_", source)
        key = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
        runs.append(first.setdefault(f"{c.op}\n{key}", c.index))
    return runs


def emit_source(variants: list[OpVariant], config: KernelConfig = KernelConfig()) -> str:
    if not variants:
        raise ValueError("a kernel needs at least one op variant")
    config = config.for_kernel(variants)
    x_limit = x_staging_limit(variants)
    codes: list[VariantCode] = [variant_code(i, v, config, x_limit) for i, v in enumerate(variants)]
    ring = ring_layout(variants, config)
    sources = [_ENV.get_template(OP_CODEGEN[c.op].template).render(v=c, p=c.p, kc=config).rstrip() + "\n" for c in codes]
    runs = shared_code(codes, sources)
    aliases = [(c.index, runs[c.index]) for c in codes if runs[c.index] != c.index]
    op_sources = [s for c, s in zip(codes, sources) if runs[c.index] == c.index]
    helpers = _ENV.get_template("helpers.py.j2").render(kc=config).rstrip() + "\n\n\n"
    helpers += _ENV.get_template("ring.py.j2").render(kc=config, ring=ring).rstrip() + "\n"
    return _ENV.get_template("megakernel.py.j2").render(
        kc=config,
        ring=ring,
        variants=[c for c in codes if runs[c.index] == c.index],
        aliases=aliases,
        op_sources=op_sources,
        helpers=helpers,
        smem_bytes=smem_bytes(variants, config),
        dynamic_smem_bytes=dynamic_smem_bytes(variants, config),
        tt=SimpleNamespace(**{k: getattr(tt, k) for k in dir(tt) if k.isupper()}),
        abi=abi,
    )
