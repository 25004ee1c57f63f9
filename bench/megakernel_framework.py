"""Framework benchmarks on a GPU (prebuilt artifacts: tests/runtime/build_megakernel_cases.py):

* copy: device-to-device copy bandwidth (the roofline's denominator; a copy of N bytes moves 2N);
* bench_nop_132: a step with one empty task per SM (launch + epoch protocol);
* bench_handoff_1024: 1,024 dependent tasks hopping across 132 CTAs (event hand-off latency);
* bench_gemv_b{1,4}_16384x7168: one 235 MB bf16 GEMV tiled over 132 CTAs x 4 tasks, against
  torch's F.linear (cuBLAS), both timed as CUDA graph replays.

    python bench/megakernel_framework.py [--replays 200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "runtime"))

from megakernel_cases import all_cases, artifacts_dir  # noqa: E402

from k3mk.runtime import Megakernel  # noqa: E402


def graph_of(fn) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g


def time_replays(g: torch.cuda.CUDAGraph, replays: int, per_sample: int = 10) -> tuple[float, float]:
    """(median, p90) microseconds per replay over samples of `per_sample` back-to-back replays."""
    for _ in range(10):
        g.replay()
    samples = []
    for _ in range(max(1, replays // per_sample)):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(per_sample):
            g.replay()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b) * 1000 / per_sample)
    samples.sort()
    return statistics.median(samples), samples[int(0.9 * (len(samples) - 1))]


def copy_bandwidth() -> float:
    """TB/s of a 2 GiB device-to-device copy (bytes read + written), after a warm-up that ramps clocks:
    the best of an eager copy_ (timed with events) and an SM copy kernel (x * 1) in a graph; a
    copy_ captured in a graph became a memcpy node and measured only ~2.7 TB/s (2026-11-29)."""
    n = 1 << 28
    src, dst = torch.randn(n, device="cuda").to(torch.float64), torch.empty(n, dtype=torch.float64, device="cuda")
    for _ in range(100):
        dst.copy_(src)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(20):
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000)
    eager = statistics.median(times)
    kernel, _ = time_replays(graph_of(lambda: torch.mul(src, 1.0, out=dst)), 50, 5)
    print(f"copy: eager copy_ {2 * n * 8 / eager / 1e6:.2f} TB/s, graph x*1 {2 * n * 8 / kernel / 1e6:.2f} TB/s")
    return 2 * n * 8 / (min(eager, kernel) * 1e-6) / 1e12


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--suffixes", nargs="*", default=[""], help="GEMV artifact variants: <case>@<suffix>")
    args = ap.parse_args()
    cases = all_cases()
    gen = torch.Generator().manual_seed(0)
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: device-to-device copy {bw:.2f} TB/s")
    rows = []
    for name in ("bench_nop_132", "bench_handoff_1024"):
        mk = Megakernel(artifacts_dir() / name)
        med, p90 = time_replays(graph_of(mk.step), args.replays)
        rows.append((name, med, p90, ""))
        if name.startswith("bench_handoff"):
            rows.append(("  per dependent hop", med / 1024, p90 / 1024, ""))
    gemvs = [(n, f"{n}@{s}" if s else n) for n in ("bench_gemv_b1_16384x7168", "bench_gemv_b4_16384x7168")
             for s in args.suffixes]  # fmt: skip
    for name, artifact in gemvs:
        case = cases[name]
        mk = Megakernel(artifacts_dir() / artifact)
        regs = mk.manifest["compile"]["registers"]
        weights = case.builder.random_weights(gen, "cuda")
        mk.bind_weights(weights)
        x = case.inputs(gen)["x"].cuda()
        mk.buffer("x").copy_(x)
        med, p90 = time_replays(graph_of(mk.step), args.replays)
        w = weights["w"]
        nbytes = w.numel() * 2
        ref = F.linear(x, w)
        mk.step()
        torch.cuda.synchronize()
        err = ((mk.buffer("y").double() - ref.double()).norm() / ref.double().norm()).item()
        out = torch.empty_like(ref)
        t_med, _ = time_replays(graph_of(lambda: torch.matmul(x, w.T, out=out)), args.replays)
        roof = nbytes / (bw * 1e12) * 1e6
        rows.append((artifact, med, p90, f"{regs} regs {nbytes / med / 1e6:.2f} TB/s = {roof / med:.0%} of copy roofline "
                     f"({roof:.1f} us); torch {t_med:.1f} us; rel err {err:.1e}"))  # fmt: skip
    for name, artifact in [("bench_layers8_b1_7168", f"bench_layers8_b1_7168@{s}" if s else "bench_layers8_b1_7168")
                           for s in args.suffixes]:
        case = cases[name]
        mk = Megakernel(artifacts_dir() / artifact)
        weights = case.builder.random_weights(gen, "cuda")
        mk.bind_weights(weights)
        x0 = case.inputs(gen)["x0"].cuda()
        mk.buffer("x0").copy_(x0)
        med, p90 = time_replays(graph_of(mk.step), args.replays)
        ws = [weights[f"w{i}"] for i in range(8)]
        outs = [torch.empty_like(x0) for _ in ws]

        def torch_layers():
            x = x0
            for w, o in zip(ws, outs):
                torch.matmul(x, w.T, out=o)
                x = o

        t_med, _ = time_replays(graph_of(torch_layers), args.replays)
        nbytes = sum(w.numel() * 2 for w in ws)
        mk.step()
        torch_layers()
        torch.cuda.synchronize()
        err = ((mk.buffer("x8").double() - outs[-1].double()).norm() / outs[-1].double().norm()).item()
        rows.append((artifact, med, p90, f"{mk.manifest['compile']['registers']} regs {nbytes / med / 1e6:.2f} TB/s; "
                     f"torch {t_med:.1f} us ({nbytes / t_med / 1e6:.2f} TB/s); rel err {err:.1e}"))  # fmt: skip
    print(f"{'case':34s} {'median us':>10s} {'p90 us':>9s}")
    for name, med, p90, note in rows:
        print(f"{name:34s} {med:10.2f} {p90:9.2f}  {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
