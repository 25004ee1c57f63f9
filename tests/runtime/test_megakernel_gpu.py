"""GPU tests of the megakernel framework (docs/megakernel.md): every op template run inside the
persistent kernel against k3mk.ir.semantics, fork/join topologies, 1,000 CUDA-graph replays (the
epoch protocol), and a planted deadlock that the debug watchdog turns into an error.

Artifacts come prebuilt (CuTe DSL is not needed here): tests/runtime/build_megakernel_cases.py."""

from __future__ import annotations

import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from megakernel_cases import all_cases, artifacts_dir  # noqa: E402

from k3mk.ir import semantics  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CASES = all_cases()
OP_CASES = ["gemv_b1", "gemv_b4_norm_residual", "gemv_b4_norm_chunked", "gemv_b16_norm", "gemv_b8_norm_tiles", "gemv_b16_norm_tiles", "rmsnorm_b3", "embedding_b4", "argmax_bf16_b4",
            "argmax_f32_b1", "add", "diamond", "chain"]  # fmt: skip
BF16_TOLERANCE = 1e-2  # DESIGN.md, Numerics: bf16 paths around 1e-2


def load(name: str):
    from k3mk.runtime import Megakernel

    path = artifacts_dir() / name
    if not (path / "manifest.json").exists():
        pytest.skip(f"no artifact at {path}: run tests/runtime/build_megakernel_cases.py")
    case = CASES[name.split("@")[0]]  # <case>@<suffix>: a variant build of the case
    stored = (path / "task_table.bin").read_bytes()
    assert stored == case.builder.table().encode(check=case.check), f"{path} is stale: rebuild the artifacts"
    return case, Megakernel(path)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def compare(case, mk, inputs, weights) -> dict[str, float]:
    ref = case.builder.reference(inputs, weights)
    errors = {}
    for name in case.outputs:
        got = mk.buffer(name)
        assert got.shape == ref[name].shape
        if got.is_floating_point():
            assert not got.isnan().any(), f"{case.name}: {name} has NaNs (unwritten poison?)"
        if name in case.exact:
            assert torch.equal(got, ref[name].to(got.dtype)), f"{case.name}: {name} differs"
            errors[name] = 0.0
        else:
            errors[name] = relative_error(got, ref[name])
            assert errors[name] < BF16_TOLERANCE, f"{case.name}: {name} relative error {errors[name]:.2e}"
    if case.argmax_of:
        nxt, logits = case.argmax_of
        assert torch.equal(mk.buffer(nxt), semantics.argmax(mk.buffer(logits))), f"{case.name}: argmax of own logits"
    return errors


def run_three_steps(name: str, case, mk, label: str) -> None:
    """Three steps of a case's artifact against the semantics: random weights seeded by the case name,
    fresh inputs every step; counters carry over (epochs 1, 2, 3)."""
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    weights = case.builder.random_weights(gen, "cuda")
    mk.bind_weights(weights)
    for step in range(3):
        inputs = {k: v.cuda() for k, v in case.inputs(gen).items()}
        for k, v in inputs.items():
            mk.buffer(k).copy_(v)
        mk.step()
        torch.cuda.synchronize()
        errors = compare(case, mk, inputs, weights)
        print(f"{label} step {step + 1}: " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
    assert mk.epoch == 3
    assert mk.events.tolist() == [3 * c for c in case.builder.table().event_counts()]


@pytest.mark.parametrize("name", OP_CASES)
def test_case_matches_semantics(name):
    case, mk = load(name)
    run_three_steps(name, case, mk, name)


def test_diamond_cuda_graph_1000_replays():
    case, mk = load("diamond")
    gen = torch.Generator().manual_seed(7)
    weights = case.builder.random_weights(gen, "cuda")
    mk.bind_weights(weights)
    xs = [case.inputs(gen)["x"].cuda() for _ in range(8)]
    eager = []
    for x in xs:
        mk.buffer("x").copy_(x)
        mk.step()
        torch.cuda.synchronize()
        compare(case, mk, {"x": x}, weights)
        eager.append((mk.buffer("out").clone(), mk.buffer("next").clone()))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        mk.step()  # warm-up on the capture stream's side, as torch recommends
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mk.step()
    torch.cuda.synchronize()
    epoch0 = mk.epoch
    n = 1000
    outs = torch.empty((n, *mk.buffer("out").shape), dtype=torch.bfloat16, device="cuda")
    nexts = torch.empty((n, 4), dtype=torch.int32, device="cuda")
    for i in range(n):
        mk.buffer("x").copy_(xs[i % 8])
        graph.replay()
        outs[i].copy_(mk.buffer("out"))
        nexts[i].copy_(mk.buffer("next"))
    torch.cuda.synchronize()
    assert mk.epoch == epoch0 + n
    for i in range(n):  # the kernel is deterministic: every replay equals the eager step bit for bit
        assert torch.equal(outs[i], eager[i % 8][0]), f"replay {i} differs"
        assert torch.equal(nexts[i], eager[i % 8][1]), f"replay {i} argmax differs"

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    print(f"diamond: {start.elapsed_time(end) * 1000 / n:.2f} us per step (graph replay, 18 tasks, 8 CTAs)")


def test_planted_hang_ends_in_watchdog_error():
    path = artifacts_dir() / "hang"
    if not (path / "manifest.json").exists():
        pytest.skip(f"no artifact at {path}")
    script = f"""
import sys, torch
from k3mk.runtime import Megakernel, WatchdogError
mk = Megakernel({str(path)!r})
mk.step(watchdog_us=200_000)
torch.cuda.synchronize()
try:
    mk.check()
except WatchdogError as e:
    print(e)
    mk.reset()
    sys.exit(0)
print("the watchdog did not fire")
sys.exit(1)
"""
    # A child process: if the watchdog failed, the hang is killed here instead of wedging the suite.
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    print(out)
    assert proc.returncode == 0, out
    assert "timed out" in out and "SM " in out
    assert "CTA 0" in out and "waits_for_cta1" in out and "from_cta1" in out
    assert "CTA 2" in out and "bystander" in out
