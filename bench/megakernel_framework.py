"""Framework benchmarks on a GPU (prebuilt artifacts: tests/runtime/build_megakernel_cases.py):

* copy: device-to-device copy bandwidth (the roofline's denominator; a copy of N bytes moves 2N);
* bench_nop_132: a step with one empty task per SM (launch + epoch protocol);
* bench_handoff_1024: 1,024 dependent tasks hopping across 132 CTAs (event hand-off latency);
* GEMV_BENCHES: one 235 MB bf16 GEMV tiled over 132 CTAs x 4 tasks (batch 1 and 4), 8 dependent 7168^2
  GEMVs, and the streaming loop's chain of 4 dependent 16384 x 7168 GEMVs (940 MB), each against the
  same GEMVs through torch (cuBLAS), both timed as CUDA graph replays.

    python bench/megakernel_framework.py [--replays 200] [--suffixes '' S ...] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

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


# GEMV benches: one GEMV tiled over every SM, and chains of dependent GEMVs (each tile waits for the
# whole previous GEMV, so streaming the next weights before the wait is what keeps HBM busy).
GEMV_BENCHES = ("bench_gemv_b1_16384x7168", "bench_gemv_b4_16384x7168", "bench_gemv_b8_16384x7168", "bench_layers8_b1_7168", "bench_chain4_b1_16384x7168",
                "bench_chain4_b4_16384x7168")  # fmt: skip


def bench_gemvs(name: str, artifact: str, gen: torch.Generator, bw: float, replays: int) -> tuple:
    """(artifact, median, p90, note): the megakernel against the same GEMVs through torch (cuBLAS) in a
    CUDA graph, the result checked against torch's first."""
    case = all_cases()[name]
    mk = Megakernel(artifacts_dir() / artifact)
    weights = case.builder.random_weights(gen, "cuda")
    mk.bind_weights(weights)
    inputs = {k: v.cuda() for k, v in case.inputs(gen).items()}
    (x_name, x0), = inputs.items()
    mk.buffer(x_name).copy_(x0)
    med, p90 = time_replays(graph_of(mk.step), replays)
    ws = [weights[k] for k in sorted(weights, key=lambda k: int(k[1:]) if k[1:].isdigit() else 0)]
    outs = [torch.empty(x0.shape[0], w.shape[0], dtype=x0.dtype, device="cuda") for w in ws]

    def torch_chain():
        x = x0
        for w, o in zip(ws, outs):
            torch.matmul(x, w.T, out=o)
            x = o

    t_med, _ = time_replays(graph_of(torch_chain), replays)
    mk.step()
    torch_chain()
    torch.cuda.synchronize()
    out = mk.buffer(case.outputs[0])
    err = ((out.double() - outs[-1].double()).norm() / outs[-1].double().norm()).item()
    nbytes = sum(w.numel() * 2 for w in ws)
    roof = nbytes / (bw * 1e12) * 1e6
    note = (f"{mk.manifest['compile']['registers']} regs, {mk.manifest['ring']['slots']} x {mk.manifest['ring']['slot_bytes'] // 1024} KB "
            f"slots; {nbytes / med / 1e6:.2f} TB/s = {roof / med:.0%} of the copy roofline ({roof:.1f} us); torch (cuBLAS) "
            f"{t_med:.1f} us ({nbytes / t_med / 1e6:.2f} TB/s); rel err {err:.1e}")  # fmt: skip
    return artifact, med, p90, note, {"torch_us": t_med, "roofline_us": roof, "bytes": nbytes, "rel_err": err}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--suffixes", nargs="*", default=[""], help="GEMV artifact variants: <case>@<suffix>")
    ap.add_argument("--json", type=Path, help="write every row here")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: device-to-device copy {bw:.2f} TB/s")
    rows = []
    for name in ("bench_nop_132", "bench_handoff_1024"):
        mk = Megakernel(artifacts_dir() / name)
        med, p90 = time_replays(graph_of(mk.step), args.replays)
        rows.append((name, med, p90, "", {}))
        if name.startswith("bench_handoff"):
            rows.append(("  per dependent hop", med / 1024, p90 / 1024, "", {}))
    for name in GEMV_BENCHES:
        for suffix in args.suffixes:
            artifact = f"{name}@{suffix}" if suffix else name
            if (artifacts_dir() / artifact / "manifest.json").exists():
                rows.append(bench_gemvs(name, artifact, gen, bw, args.replays))
    print(f"{'case':40s} {'median us':>10s} {'p90 us':>9s}")
    for name, med, p90, note, _ in rows:
        print(f"{name:40s} {med:10.2f} {p90:9.2f}  {note}")
    if args.json:
        args.json.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "copy_TBps": bw,
                                         "rows": [{"case": n, "median_us": m, "p90_us": p, "note": note, **extra}
                                                  for n, m, p, note, extra in rows]}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
