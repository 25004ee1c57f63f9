"""GPU tests of the weight-streaming GEMV (KernelConfig.weight_stream; codegen/ops.py GemvStream):
- the GEMV op cases (every epilogue / prologue kind, batch 1, 4, 16, odd shapes, several tasks per CTA so
  the barrier phases carry over from task to task, 3 steps) built with the flag, against the same
  references and tolerances as their release builds (test_megakernel_gpu.py, test_kda_ops_gpu.py);
- the GEMV benchmarks, release and streamed side by side (CUDA-graph replays; both checked against
  torch's F.linear first).

Artifacts come prebuilt: python tests/runtime/build_megakernel_cases.py --config weight_stream=true
--suffix stream <case ...> (and the release bench cases without --suffix)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from megakernel_cases import all_cases, artifacts_dir  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CASES = all_cases()
SUFFIX = "stream"
# test_megakernel_gpu.py's cases (compare: exact outputs, argmax of the kernel's own logits) ...
FRAMEWORK_CASES = ["gemv_b1", "gemv_b4_norm_residual", "gemv_b16_norm", "diamond", "chain"]
# ... and test_kda_ops_gpu.py's (run_steps: states, fp32 tolerances, the SiTU / softplus weight scales)
KDA_CASES = ["gated_situ_b1", "gated_silu_b4", "gated_situ_b4", "sigmoid_gate_b4", "sigmoid_gate_b1", "residual3_b4",
             "residual2_b1", "linear_fp32_b4", "kda_gate_lb_b1", "kda_gate_softplus_b4", "gated_rmsnorm_b4",
             "gated_rmsnorm_b1", "kda_layer_b4"]  # fmt: skip
BENCH_GEMV = ["bench_gemv_b1_16384x7168", "bench_gemv_b4_16384x7168"]
BENCH_LAYERS = "bench_layers8_b1_7168"


def load(name: str, suffix: str = SUFFIX):
    from k3mk.runtime import Megakernel

    path = artifacts_dir() / (f"{name}@{suffix}" if suffix else name)
    if not (path / "manifest.json").exists():
        pytest.skip(f"no artifact at {path}: run tests/runtime/build_megakernel_cases.py")
    case = CASES[name]
    assert (path / "task_table.bin").read_bytes() == case.builder.table().encode(check=case.check), f"{path} is stale"
    mk = Megakernel(path)
    assert "weight_stream_init" in (path / "megakernel.py").read_text() or not suffix, f"{path} was built without the flag"
    return case, mk


@pytest.mark.parametrize("name", FRAMEWORK_CASES)
def test_streamed_case_matches_semantics(name):
    from test_megakernel_gpu import run_three_steps

    case, mk = load(name)
    run_three_steps(name, case, mk, f"{name}@{SUFFIX}")


@pytest.mark.parametrize("name", KDA_CASES)
def test_streamed_kda_case_matches_semantics(name):
    from test_kda_ops_gpu import check_case

    check_case(name, *load(name))


def _bench(mk, replays: int) -> float:
    from megakernel_framework import graph_of, time_replays

    med, _ = time_replays(graph_of(mk.step), replays)
    return med


@pytest.mark.parametrize("name", BENCH_GEMV)
def test_bench_gemv_release_vs_streamed(name):
    """One 235 MB GEMV over 132 CTAs x 4 tasks: median us per step of each build, checked against F.linear."""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)
    case = CASES[name]
    weights = case.builder.random_weights(gen, "cuda")
    x = case.inputs(gen)["x"].cuda()
    ref = F.linear(x, weights["w"])
    nbytes = weights["w"].numel() * 2
    rows = []
    for suffix in ("", SUFFIX):
        _, mk = load(name, suffix)
        mk.bind_weights(weights)
        mk.buffer("x").copy_(x)
        mk.step()
        torch.cuda.synchronize()
        err = ((mk.buffer("y").double() - ref.double()).norm() / ref.double().norm()).item()
        assert err < 1e-2, f"{name}@{suffix}: rel err {err:.1e}"
        med = _bench(mk, 200)
        rows.append((suffix or "release", med, mk.manifest["compile"]["registers"], err))
    for label, med, regs, err in rows:
        print(f"{name} {label:8s} {med:8.2f} us  {nbytes / med / 1e6:5.2f} TB/s  {regs} regs  rel err {err:.1e}")
    print(f"{name}: streamed / release = {rows[1][1] / rows[0][1]:.3f}")


def test_bench_layers_release_vs_streamed():
    """8 dependent 7168^2 GEMVs: each tile waits for the whole previous layer (the prefetch-before-wait case)."""
    gen = torch.Generator().manual_seed(0)
    case = CASES[BENCH_LAYERS]
    weights = case.builder.random_weights(gen, "cuda")
    x0 = case.inputs(gen)["x0"].cuda()
    ref = x0
    for i in range(8):
        ref = torch.matmul(ref, weights[f"w{i}"].T)
    nbytes = sum(weights[f"w{i}"].numel() * 2 for i in range(8))
    rows = []
    for suffix in ("", SUFFIX):
        _, mk = load(BENCH_LAYERS, suffix)
        mk.bind_weights(weights)
        mk.buffer("x0").copy_(x0)
        mk.step()
        torch.cuda.synchronize()
        err = ((mk.buffer("x8").double() - ref.double()).norm() / ref.double().norm()).item()
        assert err < 1e-2, f"{BENCH_LAYERS}@{suffix}: rel err {err:.1e}"
        rows.append((suffix or "release", _bench(mk, 200), err))
    for label, med, err in rows:
        print(f"{BENCH_LAYERS} {label:8s} {med:8.2f} us  {nbytes / med / 1e6:5.2f} TB/s  rel err {err:.1e}")
    print(f"{BENCH_LAYERS}: streamed / release = {rows[1][1] / rows[0][1]:.3f}")
