"""The per-SM timeline of whole-model decode steps on the GPU (docs/megakernel.md "Profile builds").

    python bench/timeline.py ARTIFACT_DIR OUT_DIR [--steps N] [--warmup W] [--position P] [--release DIR]

ARTIFACT_DIR: a whole-model artifact built with `k3mk compile --profile --out ...` for a preset model
(random bf16 weights are generated on the GPU: `random_weights(config, 0, bf16, device="cuda")`, bound
through DecodeModel). Runs W warm-up steps (default 5), then records N steps (default 1) at positions
P + W, ..., each request at the same position, greedy tokens fed back. Writes into OUT_DIR:

    trace.json.gz   Chrome trace of the recorded steps (one process per step, one track per CTA): open it
                    in ui.perfetto.dev
    summary.json    per step: k3mk.runtime.profile.summarize (time per interval and op kind, bytes and
                    bandwidth, event hand-off latency), the record violations, and the step times
    summary.txt     the same as text
    records.pt      the raw per-task records of every recorded step (torch.save: {"fields": PROFILE_FIELDS,
                    "steps": [int64 [tasks, fields]], "positions": [...]}, global task index order), which
                    bench/calibrate.py fits the replay's constants to (ir/replay.py), on any machine

Step times are CUDA-event means over 50 eager steps of the profile build and, with --release DIR (the same
model built without --profile), of the release build: their ratio is the cost of profiling.
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from pathlib import Path

import torch

TIMED_STEPS = 50


def request_tokens(batch: int, device) -> torch.Tensor:
    """A distinct token per request. Fed back, a random-weight model's greedy tokens converge: every request then
    routes to the same experts, the all-alike case, which the routed experts' grouping by expert (batch > 1) serves
    best (BENCHMARKS.md 2026-12-03 late night); the timed steps feed these instead, as decode_bench's requests differ."""
    return (torch.arange(batch, dtype=torch.int32, device=device) * 7919 + 17) % 100_000


def step_time_us(model, tokens: torch.Tensor, positions: torch.Tensor) -> float:
    """Mean of TIMED_STEPS eager steps after 3 untimed ones (inputs already on the GPU): each request its own token
    (`request_tokens`), copied in before every step as a fed-back token would be."""
    fixed = request_tokens(tokens.numel(), tokens.device)
    for _ in range(3):
        model.step(tokens.copy_(fixed), positions, check_finite=False)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(TIMED_STEPS):
        model.step(tokens.copy_(fixed), positions, check_finite=False)  # the launch alone, as before the check existed
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / TIMED_STEPS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=1, help="steps to record (default: 1)")
    parser.add_argument("--warmup", type=int, default=5, help="steps before the first recorded one (default: 5)")
    parser.add_argument("--position", type=int, default=0, help="position of the first warm-up step (default: 0)")
    parser.add_argument("--release", type=Path, help="the same model built without --profile: time it too")
    args = parser.parse_args()

    from k3mk.bench.model_configs import artifact_config
    from k3mk.compiler.random_weights import random_weights
    from k3mk.runtime import abi
    from k3mk.runtime.model import DecodeModel
    from k3mk.runtime.profile import Timeline, chrome_trace, format_summary, summarize

    manifest = json.loads((args.artifact / "manifest.json").read_text())
    if not manifest.get("profile"):
        raise SystemExit(f"{args.artifact} is not a profile build: compile it with `k3mk compile --profile --out ...`")
    config = artifact_config(manifest, str(args.artifact))
    last = args.position + args.warmup + args.steps  # the timed steps run at this position
    if last >= manifest["max_context"]:
        raise SystemExit(f"position {last} is outside the artifact's max context {manifest['max_context']}")

    t0 = time.perf_counter()
    weights = random_weights(config, 0, torch.bfloat16, device="cuda")
    model = DecodeModel(args.artifact, weights)
    dev = model.mk.device
    rec = {"artifact": str(args.artifact), "model": manifest["model"], "batch": model.batch, "gpu": torch.cuda.get_device_name(),
           "torch": torch.__version__, "steps": []}  # fmt: skip
    tokens = request_tokens(model.batch, dev)  # each request its own token every step (routing as real requests')
    position = args.position
    with torch.no_grad():
        for _ in range(args.warmup):
            model.step(tokens, torch.full_like(tokens, position), check_finite=False)
            position += 1
        torch.cuda.synchronize()
        rec["setup_s"] = round(time.perf_counter() - t0, 2)
        trace_events, texts, raw = [], [], []
        for _ in range(args.steps):
            model.step(tokens, torch.full_like(tokens, position), check_finite=False)
            torch.cuda.synchronize()
            raw.append(model.mk.profile_records())
            tl = Timeline.of(model.mk)
            summary = summarize(tl)
            violations = tl.violations()
            rec["steps"].append({"position": position, **summary, "violation_count": len(violations), "violations": violations[:20]})
            trace_events += chrome_trace(tl)["traceEvents"]
            texts.append(f"position {position}: {len(violations)} record violations\n" + format_summary(summary))
            position += 1
        positions = torch.full_like(tokens, position)
        rec["profile_step_us"] = step_time_us(model, tokens, positions)
        if args.release:
            release = DecodeModel(args.release, weights)
            rec["release_step_us"] = step_time_us(release, tokens, positions)
            rec["profile_overhead"] = rec["profile_step_us"] / rec["release_step_us"] - 1

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "trace.json.gz").write_bytes(gzip.compress(json.dumps({"traceEvents": trace_events, "displayTimeUnit": "ns"}).encode()))
    (args.out / "summary.json").write_text(json.dumps(rec, indent=1))
    positions = [st["position"] for st in rec["steps"]]
    torch.save({"fields": list(abi.PROFILE_FIELDS), "steps": raw, "positions": positions}, args.out / "records.pt")
    timing = f"step time (mean of {TIMED_STEPS} eager steps at position {position}): profile build {rec['profile_step_us']:.1f} us"
    if args.release:
        timing += f", release build {rec['release_step_us']:.1f} us (profiling costs {rec['profile_overhead'] * 100:+.1f}%)"
    (args.out / "summary.txt").write_text("\n".join(texts) + "\n" + timing + "\n")
    print("\n".join(texts) + "\n" + timing)
    print(f"wrote {args.out}/trace.json.gz, summary.json, summary.txt, records.pt")


if __name__ == "__main__":
    main()
