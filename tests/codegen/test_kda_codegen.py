"""The KDA-side Kimi op templates (fused GEMV epilogues, kda_conv, kda_recurrence, attn_res) compile to
sm_90a cubins on this GPU-less machine; their params round-trip through the task table; codegen
rejects what the templates cannot do. GPU numerics: tests/runtime/test_kda_ops_gpu.py."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from k3mk.ir.task_table import (
    AttnResParams,
    GemvParams,
    KdaConvParams,
    KdaRecurrenceParams,
    OpVariant,
    TaskTable,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from kda_cases import KDA_OP_CASES  # noqa: E402
from megakernel_cases import all_cases  # noqa: E402


def _gemv(**kw) -> OpVariant:
    return OpVariant("gemv", GemvParams(264, 384, 1, **kw))


GEMV_EPILOGUES = [
    _gemv(rmsnorm=True, epilogue="situ_mul"),
    _gemv(epilogue="silu_mul"),
    _gemv(rmsnorm=True, epilogue="sigmoid_gate"),
    _gemv(epilogue="kda_gate", out_dtype="float32", head_dim=128, lower_bound=-5.0),
    _gemv(epilogue="kda_gate", out_dtype="float32", head_dim=128),
    _gemv(epilogue="gated_rmsnorm", head_dim=128),
    _gemv(residuals=3),
    _gemv(rmsnorm=True, out_dtype="float32"),
]
KDA_OPS = [
    OpVariant("kda_conv", KdaConvParams(640, 2)),
    OpVariant("kda_conv", KdaConvParams(640, 1)),
    OpVariant("kda_recurrence", KdaRecurrenceParams(5, 128, 2)),
    OpVariant("attn_res", AttnResParams(1048, 2, 9)),
]


def test_case_tables_round_trip():
    """Every KDA case's table validates, encodes and decodes to itself (params with None fields included)."""
    cases = all_cases()
    for name in [*KDA_OP_CASES, "bench_kda_recurrence_k3_b4"]:
        table = cases[name].builder.table()
        data = table.encode()
        again = TaskTable.decode(data)
        assert again.variants == table.variants and again.lists == table.lists, name
        assert again.encode() == data


def test_kda_layer_waits_join_conv_and_gate():
    table = all_cases()["kda_layer_b4"].builder.table()
    names = [e.name for e in table.events]
    rec = [t for tasks in table.lists for t in tasks if t.label.startswith("kda_recurrence")]
    assert rec and all(sorted(names[e] for e in t.wait) == ["kda_conv", "linear_kda_gate"] for t in rec)


@pytest.mark.parametrize(
    "variant, message",
    [
        (_gemv(epilogue="tanh"), "epilogue"),
        (_gemv(residuals=5), "residuals 5"),
        (_gemv(residuals=1, epilogue="silu_mul"), "plain bf16 epilogue"),
        (_gemv(epilogue="kda_gate", head_dim=128), "writes float32"),
        (_gemv(epilogue="sigmoid_gate", out_dtype="float32"), "writes bfloat16"),
        (_gemv(epilogue="gated_rmsnorm", head_dim=100), "must divide"),
        (OpVariant("kda_conv", KdaConvParams(100, 1)), "multiple of 8"),
        (OpVariant("kda_conv", KdaConvParams(128, 1, width=1)), "width"),
        (OpVariant("kda_recurrence", KdaRecurrenceParams(4, 96, 1)), "head_dim"),
        (OpVariant("attn_res", AttnResParams(1024, 1, 10)), "sources 10"),
    ],
)
def test_codegen_rejects(variant, message):
    from k3mk.codegen.emit import emit_source
    from k3mk.codegen.ops import CodegenError

    with pytest.raises(CodegenError, match=message):
        emit_source([variant])


def test_gated_gemv_fills_hold_half_the_rows():
    """A gated fill carries the gate AND the up rows (two streams): half the rows of a plain one."""
    from k3mk.ir.streaming import fill_plan

    plain, gated = fill_plan("gemv", GemvParams(2304, 512, 1)), fill_plan("gemv", GemvParams(2304, 512, 1, epilogue="situ_mul"))
    assert (plain.rows, gated.rows) == (3, 1) and gated.stream_offset(1) == 2304 * 2


def _compile(variants: list[OpVariant], cache) -> tuple[str, dict]:
    pytest.importorskip("cutlass", reason="compiling needs nvidia-cutlass-dsl (the compile extra)")
    from k3mk.codegen.build import compile_source
    from k3mk.codegen.emit import emit_source

    entry, info = compile_source(emit_source(variants), "sm_90a")
    assert (entry / "megakernel.sm_90a.cubin").read_bytes()[:4] == b"\x7fELF"
    assert info["spill_store_bytes"] <= 64, info  # as the framework's test: a few bytes around call ABI paths
    return (entry / "megakernel.sm_90a.ptx").read_text(), info


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("K3MK_CACHE_DIR", str(tmp_path / "cache"))


def test_gemv_epilogues_compile_sm90a(cache):
    """All eight GEMV epilogue / prologue variants in one kernel (batch 1: about 13 s here)."""
    ptx, info = _compile(GEMV_EPILOGUES, cache)
    assert ".target sm_90a" in ptx
    assert "cp.async.bulk.shared::cluster.global" in ptx and "ld.shared.v4" in ptx  # weights through the ring
    assert "div.rn.f32" in ptx  # SiTU's g / beta and u / linear_beta are IEEE divisions, as in torch
    assert "tanh.approx" not in ptx  # accurate tanh (libdevice), not the approximation


def test_kda_ops_compile_sm90a(cache):
    """kda_conv (batch 2 and batch 1), kda_recurrence and attn_res in one kernel."""
    ptx, info = _compile(KDA_OPS, cache)
    assert ".target sm_90a" in ptx
    assert "cp.async.bulk.prefetch.L2.global" in ptx  # the producer's prefetch of the recurrence's state
    assert "sqrt.rn.f32" in ptx  # the q/k L2 norms: x / sqrt(sum x^2 + 1e-6)
    assert ptx.count("st.global.cs.v4") >= 16  # 16 state rows per warp, 16-byte streaming stores (L2 evict-first)
    # the conv's output and its 3 shifted state rows: three copies at batch 2 (q, k, v each), one at batch 1
    assert ptx.count("st.global.v4") >= 3 * (1 + 3) + (1 + 3)
    assert ptx.count("shfl.sync.bfly") >= 2 * 16 * 5  # two butterflies per state row
    assert info["registers"] <= 255


@pytest.mark.parametrize("value_rows, per_warp", [(0, 16), (32, 4), (24, 3), (128, 16)])
def test_recurrence_unrolls_the_rows_its_tasks_hold(value_rows, per_warp):
    """kda_recurrence unrolls ceil(value_rows / warps) rows per warp (head_dim's when 0): Kimi Linear's (head, 32 value
    rows) tasks at batch 1 compute 4 rows a warp, not head_dim's 16 with 12 of them re-reading the last row."""
    from k3mk.codegen.emit import emit_source

    source = emit_source([OpVariant("kda_recurrence", KdaRecurrenceParams(5, 128, 1, value_rows=value_rows))])
    run = source[source.index("def op0_kda_recurrence_run("):]
    assert set(re.findall(r"for i in cutlass.range_constexpr\((\d+)\):", run)) == {str(per_warp)}


def test_gemv_wide_input_reads_x_from_the_arena(cache):
    """K3's dense down projection (33792 inputs) at batch 4: x (264 KB) exceeds the smem budget, so the
    plain and gated gemv read it from the arena instead of staging it (codegen/ops.py gemv_x_in_smem);
    the variant needs no smem for x, and the kernel compiles."""
    from k3mk.codegen.ops import OP_CODEGEN, gemv_x_in_smem

    wide = [OpVariant("gemv", GemvParams(33792, 7168, 4, residuals=1)), OpVariant("gemv", GemvParams(33792, 64, 4, epilogue="situ_mul", beta=4.0, linear_beta=25.0))]
    for v in wide:
        assert not gemv_x_in_smem(v.params) and OP_CODEGEN["gemv"].smem_bytes(v.params) == 0
    ptx, info = _compile(wide, cache)
    assert ".target sm_90a" in ptx and "ld.global.v4" in ptx
