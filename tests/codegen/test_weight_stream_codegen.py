"""Weight-streaming GEMV (KernelConfig.weight_stream; codegen/ops.py GemvStream): every gemv variant
kind compiles to an sm_90a cubin with the bulk-copy ring, its smem fits the 227 KB, and with the flag
off the generated source has none of it (the register path is the release default)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from k3mk.codegen.emit import dynamic_smem_bytes, emit_source
from k3mk.codegen.ops import OP_SMEM_LIMIT, CodegenError, KernelConfig, gemv_tuning
from k3mk.ir.task_table import GemvParams, OpVariant

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from megakernel_cases import all_cases  # noqa: E402

STREAM = KernelConfig(weight_stream=True)

# Every epilogue / prologue kind at batch 1, 4 and 16, odd shapes (those of the GPU op cases).
VARIANTS = [
    GemvParams(520, 333, 1),
    GemvParams(1032, 257, 4, rmsnorm=True, residuals=1),
    GemvParams(264, 100, 16, rmsnorm=True),
    GemvParams(7168, 16384, 16),  # x does not fit the smem: read from the arena
    GemvParams(520, 333, 1, rmsnorm=True, epilogue="situ_mul", linear_beta=25.0),
    GemvParams(264, 200, 4, epilogue="silu_mul"),
    GemvParams(264, 200, 16, epilogue="silu_mul"),
    GemvParams(1032, 257, 4, rmsnorm=True, epilogue="sigmoid_gate"),
    GemvParams(520, 333, 4, residuals=3),
    GemvParams(264, 97, 4, rmsnorm=True, out_dtype="float32"),
    GemvParams(136, 640, 1, epilogue="kda_gate", out_dtype="float32", head_dim=128, lower_bound=-5.0),
    GemvParams(264, 384, 4, rmsnorm=True, epilogue="kda_gate", out_dtype="float32", head_dim=128),
    GemvParams(520, 640, 1, rmsnorm=True, epilogue="gated_rmsnorm", head_dim=128, o_eps=1e-5),
]


def test_flag_off_source_has_no_streaming():
    """The knobs are inert without the flag, and the release source keeps the L2 prefetch path."""
    variants = [OpVariant("gemv", p) for p in VARIANTS]
    off = emit_source(variants)
    assert off == emit_source(variants, KernelConfig(stream_stages=2, stream_bytes=64 * 1024))
    for needle in ("mbarrier", "weight_stream", "stream_barrier", "cp_async_bulk_shared_cluster_global"):
        assert needle not in off, needle
    assert "cp_async_bulk_prefetch" in off
    assert dynamic_smem_bytes(variants) == dynamic_smem_bytes(variants, KernelConfig(stream_bytes=1024))


def test_stream_layout_fits_and_follows_the_staged_input():
    for p in VARIANTS:
        tuning = gemv_tuning(p, STREAM)
        st = tuning.stream
        assert tuning.prefetch_rows == 0 and st.stages == STREAM.stream_stages
        assert st.chunk % 8 == 0 and (st.chunks - 1) * st.chunk < p.in_features <= st.chunks * st.chunk
        assert st.ring_offset % 128 == 0 and st.slot_bytes % 16 == 0
        x_bytes = p.batch * p.in_features * 2 if tuning.x_smem else 0
        assert st.ring_offset >= x_bytes
        assert st.ring_offset + st.ring_bytes <= OP_SMEM_LIMIT
    assert dynamic_smem_bytes([OpVariant("gemv", p) for p in VARIANTS], STREAM) <= 232448


def test_stream_chunks_keep_the_register_path_summation_order():
    """Where a slot holds a whole lane stride (32 lanes x 8 elements), chunks are multiples of it, so every
    lane sums its elements in the register path's order: the streamed build's values equal the release
    build's bit for bit. Kimi Linear's K = 2304 took 464-element chunks before, and its streamed logits
    differed from the release build's by up to 3 bf16 ULPs on the H200 (docs/megakernel.md)."""
    shapes = [GemvParams(2304, 4096, 1), GemvParams(2304, 1024, 1, epilogue="silu_mul"), GemvParams(4096, 2304, 1, residuals=1),
              GemvParams(7168, 16384, 1), GemvParams(7168, 2048, 4, rmsnorm=True, epilogue="situ_mul"), *VARIANTS]  # fmt: skip
    for config in (STREAM, KernelConfig(weight_stream=True, stream_bytes=64 * 1024)):
        for p in shapes:
            st = gemv_tuning(p, config).stream
            if p.in_features > st.chunk:  # several chunks: each must start on a lane-stride boundary
                assert st.chunk % (32 * 8) == 0 or st.chunk < 32 * 8, (p, st)
            assert st.chunk % 8 == 0 and (st.chunks - 1) * st.chunk < p.in_features <= st.chunks * st.chunk


@pytest.mark.parametrize("config, message", [
    (KernelConfig(weight_stream=True, stream_stages=9), "stream_stages 9"),
    (KernelConfig(weight_stream=True, stream_bytes=4096), "elements per row per fill"),
])  # fmt: skip
def test_stream_rejects(config, message):
    with pytest.raises(CodegenError, match=message):
        emit_source([OpVariant("gemv", GemvParams(7168, 1024, 1))], config)


def test_streamed_variants_compile_for_sm90a(tmp_path, monkeypatch):
    """All variant kinds in one kernel (with the K3 b16 case whose x is read from the arena)."""
    pytest.importorskip("cutlass", reason="compiling needs nvidia-cutlass-dsl (the compile extra)")
    from k3mk.codegen.build import compile_source

    monkeypatch.setenv("K3MK_CACHE_DIR", str(tmp_path / "cache"))
    source = emit_source([OpVariant("gemv", p) for p in VARIANTS], STREAM)
    entry, info = compile_source(source, "sm_90a")
    print(f"streamed gemv kernel: {info.get('registers')} registers, spills {info.get('spill_store_bytes')} / "
          f"{info.get('spill_load_bytes')} B, {info['compile_seconds']} s")  # fmt: skip
    assert info["spill_store_bytes"] <= 64
    ptx = (entry / "megakernel.sm_90a.ptx").read_text()
    for needle in ("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes", "mbarrier.arrive.expect_tx",
                   "mbarrier.try_wait.parity", "mbarrier.init", "fence.mbarrier_init", "fence.proxy.async.shared::cta",
                   "ld.shared.v4"):  # fmt: skip
        assert needle in ptx, needle
    assert "cp.async.bulk.prefetch.L2" not in ptx  # the copies replace the L2 window


def test_case_tables_stream():
    """The GPU op cases' tables (built @stream by build_megakernel_cases.py) generate with the flag."""
    cases = all_cases()
    for name in ("gemv_b1", "gemv_b4_norm_residual", "gemv_b16_norm", "gated_situ_b1", "gated_rmsnorm_b1",
                 "bench_gemv_b4_16384x7168", "bench_layers8_b1_7168"):  # fmt: skip
        source = emit_source(cases[name].builder.table().variants, STREAM)
        assert "weight_stream_init(smem, warp, lane)" in source and "_fill(task, weights, smem, warp, f)" in source
