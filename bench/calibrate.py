"""Fit the streaming replay's constants (ir/replay.py EngineCosts) to a profile build's recorded timeline,
then replay builds with them: the cost model's constants come from measurements, and its predictions are
checked against steps it was not fitted to.

    python bench/calibrate.py PROFILE_ARTIFACT TIMELINE_DIR [--copy-tbps 4.24] [--json OUT]
                              [--replay ARTIFACT=MEASURED_US ...]

TIMELINE_DIR is what bench/timeline.py wrote for PROFILE_ARTIFACT (records.pt, summary.json). Runs on any
machine (no GPU). What is fitted, from the first recorded step, and from what:

* handoff: the median blocking hand-off (waiter's wait_done - its binding event's last body_end);
* task_overhead: the median gap between a task's body_end and the next task's start on its CTA;
* fill_issue: the median producer time per fill of the streaming tasks that wait on nothing
  ((produce_end - produce_start - ring_wait) / fills);
* direct ops (every op that does not stream through the ring): per op kind, body = fixed + bytes / rate,
  least squares over its tasks (bytes: task_bytes.json's weight + other);
* consume and prologue per weight format: the same fit over the streaming tasks whose fills were all
  issued at least `--landed-us` before their body began (so the ring held them: the body is the
  consumers' own work), against the bytes of the task's busiest warp times the warps (the replay's body);
* sm_stream: the copy bandwidth / the CTAs (given: the decode bench measures it in the same run);
* fill_latency: the value of a small grid whose replay of PROFILE_ARTIFACT comes closest to the recorded step.

Prints the constants, the replay of PROFILE_ARTIFACT beside its recorded step and CTA-time shares, and each
--replay artifact's predicted step beside MEASURED_US (e.g. the decode bench's median for that build).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from k3mk.codegen.ops import SUPPORT_WARPS, WARPGROUP
from k3mk.ir.replay import EngineCosts, Replay, mla_chunk_rows, replay, streamed_plans
from k3mk.ir.streaming import RingModel
from k3mk.ir.task_table import TaskTable

FILL_LATENCIES = (0.75e-6, 1.0e-6, 1.5e-6, 2.0e-6, 3.0e-6, 4.0e-6, 5.0e-6, 6.0e-6)


def consumer_warps(block_threads: int) -> int:
    """The block's warps less the support warps (codegen/ops.py KernelConfig.block_threads): SUPPORT_WARPS, or a whole
    warpgroup where the consumers take its registers (the consumer threads are whole warpgroups)."""
    warps = block_threads // 32
    return warps - (WARPGROUP if warps % WARPGROUP == 0 else SUPPORT_WARPS)


@dataclass
class Build:
    """What the replay needs of an artifact: its table, ring and per-task bytes (list order)."""

    table: TaskTable
    ring: RingModel
    task_bytes: list[list[tuple[int, int]]]

    @staticmethod
    def load(artifact: Path) -> "Build":
        manifest = json.loads((artifact / "manifest.json").read_text())
        table = TaskTable.decode((artifact / manifest["files"]["task_table"]).read_bytes())
        r = manifest["ring"]
        ring = RingModel(r["slots"], r["records"], consumer_warps(manifest["block_threads"]), r["slot_bytes"])
        path = artifact / "task_bytes.json"
        if not path.exists():
            raise SystemExit(f"{artifact}: no task_bytes.json (built before every build wrote it: recompile it)")
        tb = json.loads(path.read_text())
        flat = list(zip(tb["weight_bytes"], tb["other_bytes"]))
        if len(flat) != table.num_tasks:
            raise SystemExit(f"{path}: {len(flat)} tasks, the table has {table.num_tasks}")
        task_bytes, i = [], 0
        for ts in table.lists:
            task_bytes.append(flat[i : i + len(ts)])
            i += len(ts)
        return Build(table, ring, task_bytes)

    def replay(self, costs: EngineCosts, context: int | None = None) -> Replay:
        return replay(self.table, self.task_bytes, self.ring, costs, context)


def _line_fit(xs: list[float], ys: list[float]) -> tuple[float, float] | None:
    """(intercept, slope) of the least-squares line, intercept and slope kept >= 0; None for < 3 points.
    Points of one x only give their time: (median, 0), right for that size alone."""
    if len(xs) < 3:
        return None
    if max(xs) - min(xs) <= 0.01 * max(max(xs), 1):
        return (statistics.median(ys), 0.0)
    a = np.stack([np.ones(len(xs)), np.asarray(xs, dtype=float)], axis=1)
    (b, m), *_ = np.linalg.lstsq(a, np.asarray(ys, dtype=float), rcond=None)
    if m <= 0:
        return (max(statistics.median(ys), 0.0), 0.0)
    return (max(b, 0.0), m)


def fit(build: Build, records: np.ndarray, fields: list[str], sm_stream: float, landed_s: float, base: EngineCosts,
        context: int | None = None) -> tuple[EngineCosts, dict]:
    """The constants of `build`'s recorded step (module docstring), recorded with every request at `context`
    tokens (default: the max context); `base` supplies fill_latency's start, the MLA decode's per-(row, head)
    time (its fixed part is fitted after that is taken off) and any constant the records cannot give (an op
    kind with too few tasks)."""
    col = {name: records[:, fields.index(name)].astype(float) * 1e-9 for name in
           ("start", "wait_done", "body_end", "produce_start", "produce_end", "ring_wait")}  # fmt: skip
    table = build.table
    plans = streamed_plans(table, build.ring.slot_bytes)
    chunk_rows = [mla_chunk_rows(v.params, context or v.params.max_len) if v.op == "mla_decode" else [] for v in table.variants]
    flat = [(s, k, t) for s, ts in enumerate(table.lists) for k, t in enumerate(ts)]
    task_bytes = [b for bs in build.task_bytes for b in bs]
    index = {(s, k): i for i, (s, k, _) in enumerate(flat)}
    last_signal: dict[int, int] = {}
    for i, (_, _, t) in enumerate(flat):
        if t.signal is not None and (t.signal not in last_signal or col["body_end"][i] > col["body_end"][last_signal[t.signal]]):
            last_signal[t.signal] = i
    handoffs, gaps, issue = [], [], []
    direct: dict[str, tuple[list[float], list[float]]] = {}
    streamed: dict[str, tuple[list[float], list[float]]] = {}
    for i, (s, k, t) in enumerate(flat):
        v = table.variants[t.opcode]
        body = col["body_end"][i] - col["wait_done"][i]
        nbytes = task_bytes[i][0] + task_bytes[i][1]
        if t.wait:
            signal = max(col["body_end"][last_signal[e]] for e in t.wait)
            if col["start"][i] < signal:
                handoffs.append(col["wait_done"][i] - signal)
        if k > 0:
            gaps.append(col["start"][i] - col["body_end"][index[(s, k - 1)]])
        plan = plans[t.opcode]
        if plan is None:
            if chunk_rows[t.opcode]:
                body -= chunk_rows[t.opcode][t.operands.get("chunk", 0)] * t.operands.get("head_count", 0) * base.mla_head_row
            xs, ys = direct.setdefault(v.op, ([], []))
            xs.append(nbytes)
            ys.append(body)
            continue
        fills = plan.task_fills(t.operands.get("row_count", 0))
        if fills >= 2 and t.weight_wait is None:
            issue.append((col["produce_end"][i] - col["produce_start"][i] - col["ring_wait"][i]) / fills)
        if col["produce_end"][i] + landed_s <= col["wait_done"][i] and fills <= build.ring.slots:
            fmt = "mxfp4" if getattr(v.params, "weight_format", "") == "mxfp4" else "bfloat16"
            xs, ys = streamed.setdefault(fmt, ([], []))
            # the replay's body: the busiest warp's fills at a warp's share of the rate (ir/replay.py)
            busiest = max(collections.Counter(plan.owners(t.operands.get("row_count", 0), build.ring.warps)).values())
            xs.append(busiest * task_bytes[i][0] / fills * build.ring.warps)
            ys.append(body)
    fitted_direct = dict(base.direct)
    for op, (xs, ys) in direct.items():
        line = _line_fit(xs, ys)
        if line is not None:
            fitted_direct[op] = (line[0], 1.0 / line[1] if line[1] > 0 else 1e15)
    consume, prologues = dict(base.consume), []
    for fmt, (xs, ys) in streamed.items():
        line = _line_fit(xs, ys)
        if line is not None and line[1] > 0:
            consume[fmt] = 1.0 / line[1]
            prologues.append(line[0])
    costs = replace(
        base,
        sm_stream=sm_stream,
        handoff=statistics.median(handoffs) if handoffs else base.handoff,
        task_overhead=statistics.median(gaps) if gaps else base.task_overhead,
        fill_issue=statistics.median(issue) if issue else base.fill_issue,
        direct=fitted_direct,
        consume=consume,
        prologue=statistics.median(prologues) if prologues else base.prologue,
    )
    wall = col["body_end"].max() - col["start"].min()
    best = min(FILL_LATENCIES, key=lambda lat: abs(build.replay(replace(costs, fill_latency=lat), context).step_s - wall))
    costs = replace(costs, fill_latency=best)
    report = {"recorded_step_s": wall, "handoffs": len(handoffs), "gaps": len(gaps), "issue_samples": len(issue),
              "direct_samples": {op: len(xs) for op, (xs, _) in direct.items()},
              "streamed_samples": {fmt: len(xs) for fmt, (xs, _) in streamed.items()}}  # fmt: skip
    return costs, report


def main() -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", type=Path, help="the profile build the timeline was recorded from")
    parser.add_argument("timeline", type=Path, help="bench/timeline.py's OUT_DIR for it (records.pt, summary.json)")
    parser.add_argument("--copy-tbps", type=float, default=4.24, help="the measured copy bandwidth, TB/s (default 4.24: H200, 2026-12-01)")
    parser.add_argument("--landed-us", type=float, default=2.0, help="streaming tasks whose fills were issued this long before the body fit consume/prologue")
    parser.add_argument("--json", type=Path, help="write the constants and the comparisons here")
    parser.add_argument("--replay", nargs="*", default=[], metavar="ARTIFACT=MEASURED_US", help="builds to predict with the fitted constants")
    args = parser.parse_args()

    from k3mk.ir.replay import H200_2026_12_03

    build = Build.load(args.artifact)
    rec = torch.load(args.timeline / "records.pt")
    records = rec["steps"][0].numpy()
    if len(records) != build.table.num_tasks:
        print(f"error: {args.timeline}/records.pt holds {len(records)} tasks, {args.artifact} has {build.table.num_tasks}", file=sys.stderr)
        return 2
    context = int(rec["positions"][0]) + 1 if "positions" in rec else None  # the recorded step's context
    sm_stream = args.copy_tbps * 1e12 / len(build.table.lists)
    costs, report = fit(build, records, rec["fields"], sm_stream, args.landed_us * 1e-6, H200_2026_12_03, context)
    own = build.replay(costs, context)
    summary = json.loads((args.timeline / "summary.json").read_text())["steps"][0]
    measured_shares = summary["cta_time_fraction"]
    out = {"costs": costs.to_json(), "fit": report,
           "profile_build": {"artifact": str(args.artifact), "recorded_step_us": report["recorded_step_s"] * 1e6,
                             "replayed_step_us": own.step_s * 1e6, "replayed_shares": own.shares(),
                             "recorded_shares": {"wait": measured_shares.get("wait"), "body": measured_shares.get("body"),
                                                 "producer_blocked": summary["producer_fraction"].get("ring_wait")}},
           "predictions": []}  # fmt: skip
    print(json.dumps(out["costs"], indent=1))
    p = out["profile_build"]
    print(f"{args.artifact}: replayed {p['replayed_step_us']:.0f} us, recorded {p['recorded_step_us']:.0f} us; shares replayed "
          f"{ {k: round(v, 3) for k, v in own.shares().items()} } recorded {p['recorded_shares']}")  # fmt: skip
    for item in args.replay:
        path, _, measured = item.partition("=")
        predicted = Build.load(Path(path)).replay(costs, context).step_s * 1e6
        row = {"artifact": path, "predicted_us": predicted, "measured_us": float(measured) if measured else None}
        out["predictions"].append(row)
        err = f" ({predicted / row['measured_us'] - 1:+.1%})" if row["measured_us"] else ""
        print(f"{path}: predicted {predicted:.0f} us, measured {measured or '-'} us{err}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
