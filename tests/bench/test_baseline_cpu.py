"""CPU tests of the baseline decode step's replacement ops (bench/baseline.py, bench/baseline_kernels.py)
against the reference: every Triton kernel, the absorbed MLA and the MoE and MLA layers of k3-tiny and
kimi-linear-tiny (random weights, fresh random inputs), run in Triton's CPU interpreter by
tests/bench/kernel_checks.py in a subprocess (TRITON_INTERPRET must be set before Triton is imported).
The fla kernels (KDA recurrence, gated norm) do not run in the interpreter: test_baseline_gpu.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

pytest.importorskip("triton")

import kernel_checks  # noqa: E402


@pytest.mark.slow
def test_replacement_ops_in_the_interpreter():
    proc = subprocess.run([sys.executable, str(HERE / "kernel_checks.py")], env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    results = json.loads(proc.stdout)
    for kernel in ("rmsnorm", "act_mul", "attn_res", "kda_conv", "experts bf16 silu", "experts mxfp4 situ", "mla_absorbed"):
        assert {f"{kernel} float32", f"{kernel} bfloat16"} <= set(results), kernel
    for layer in ("moe layer", "mla layer"):
        assert {f"{layer} k3-tiny", f"{layer} kimi-linear-tiny"} <= set(results), layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_absorbed_mla_at_k3_head_dims(dtype):
    """Pure torch, so in-process: K3's per-head dims (rank 512, rope 64, nope / v 128) over a window of a
    longer cache; float32 equal to the naive MLA up to summation order."""
    gen = torch.Generator().manual_seed(5)
    errors = kernel_checks.check_mla_absorbed(gen, dtype, batch=2, heads=2, nope=128, rope=64, v_dim=128, rank=512, rows=300, window=257)
    assert errors["o"] <= (1e-5 if dtype == torch.float32 else 3e-2)
