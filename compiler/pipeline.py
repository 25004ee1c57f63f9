"""The compile driver: capture the reference decode step for a target and run the pass pipeline on it
as far as it is written (passes/manager.py), then summarize what came out; plus `run_compile`, the
pipeline part of `k3mk compile` (compiler/cli.py declares its options, checks them and serves cached
artifacts, compiler/artifact_cache.py). The target's limits are checked before the capture
(compiler/limits.py).

Stages that do not exist yet are reported as such, never guessed: the summary says which numbers
need which pass.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from k3mk.compiler import limits
from k3mk.compiler.artifact_cache import SUMMARY_FILE
from k3mk.compiler.capture import capture
from k3mk.compiler.config import ModelConfig
from k3mk.compiler.limits import CompileError, StateSize, format_bytes
from k3mk.ir.graph import Graph, Role
from k3mk.ir.tasks import TaskGraph
from k3mk.passes import manager
from k3mk.passes.manager import ARCHS, PIPELINE, PassRecord, PipelineRun, Target, available, pass_name, run_pipeline
from k3mk.passes.tp_shard import TPError, check_divisible


@dataclass
class CompileResult:
    target: Target
    captured: Graph
    capture_seconds: float
    run: PipelineRun
    sharded: Graph  # after tp_shard, before fusion: the op kinds the roofline knows (the captured graph if it did not run)
    state: StateSize  # the decode state of one rank
    missing: list[str] = field(default_factory=list)  # passes of the pipeline not written yet
    skipped: list[str] = field(default_factory=list)  # written passes after `until`

    @property
    def output(self) -> Graph | TaskGraph:
        return self.run.output

    @property
    def graph(self) -> Graph:
        """The last IR graph (the one the tasks implement, once there are tasks)."""
        out = self.output
        out = getattr(out, "task_graph", out)  # an EmittedTable: the task graph it came from
        return out.graph if isinstance(out, TaskGraph) else out


def make_target(config: ModelConfig, tp: int, max_tokens: int, max_context: int, dtype: torch.dtype, arch: str) -> Target:
    """The compile target, checked before the (slow) capture, limits included (compiler/limits.py):
    the errors name the option or the config field."""
    if arch not in ARCHS:
        raise CompileError(f"--arch {arch}: unknown (known: {', '.join(ARCHS)})")
    if tp < 1:
        raise CompileError(f"--tp must be at least 1, found {tp}")
    try:
        check_divisible(config, tp)
    except TPError as e:
        raise CompileError(f"--tp {tp}: {e}") from None
    limits.check_tokens(max_tokens)
    limits.check_context(config, tp, max_tokens, max_context, arch)
    return Target.for_arch(config, arch, tp=tp, max_tokens=max_tokens, max_context=max_context, dtype=dtype)


def compile_graph(
    config: ModelConfig,
    tp: int = 1,
    max_tokens: int = 1,
    max_context: int = 4096,
    dtype: torch.dtype = torch.bfloat16,
    arch: str = "sm_90a",
    dump_dir: str | Path | None = None,
    progress: Callable[[str], None] | None = None,
    until: str | None = None,
) -> CompileResult:
    """Capture one decode step of `max_tokens` tokens and run every pass written so far (with
    `until`, none after that one), verifying (and with `dump_dir`, dumping) after each. `progress`
    receives one line per finished stage."""
    target = make_target(config, tp, max_tokens, max_context, dtype, arch)
    written = available(PIPELINE)
    try:
        passes = written if until is None else [p for p in manager.until(until) if p in written]
    except ValueError as e:
        raise CompileError(f"--until {until}: {e}") from None
    missing = [pass_name(p) for p in PIPELINE[len(written) :]]
    skipped = [pass_name(p) for p in written[len(passes) :]]
    say = progress or (lambda line: None)
    state = limits.state_size(config, tp, max_tokens, max_context)
    say(f"decode state per rank: {state.text()}")
    start = time.perf_counter()
    graph = capture(config, max_tokens, max_context, dtype)
    seconds = time.perf_counter() - start
    say(f"capture: {len(graph.nodes)} nodes in {seconds:.2f} s")
    kept = {"tp_shard": graph}

    def on_pass(record: PassRecord, x) -> None:
        say(f"{record.name}: {record.size} in {record.seconds:.2f} s (verify {record.verify_seconds:.2f} s)")
        if record.name in kept:
            kept[record.name] = x

    run = run_pipeline(graph, target, passes, dump_dir, on_pass)
    if missing:
        say(f"not written yet: {', '.join(missing)}")
    return CompileResult(target, graph, seconds, run, kept["tp_shard"], state, missing, skipped)


def summary(result: CompileResult, replayed=None) -> str:
    """What the compile produced so far: stages with timings and sizes, per-rank bytes and collectives,
    tasks and bytes per SM, the predicted step time (`replayed`: the replay of the kernel being built;
    default: with the default kernel options) and the roofline at NOMINAL bandwidth."""
    t, graph = result.target, result.graph
    lines = [
        f"k3mk compile {t.config.name}: tp={t.tp} max_tokens={t.max_tokens} max_context={t.max_context} "
        f"dtype={str(t.dtype).removeprefix('torch.')} arch={t.arch} ({t.device_name}, {t.num_sms} SMs)",
        "stages:",
        f"  {'capture':16s} {result.capture_seconds:8.2f} s  {len(result.captured.nodes)} nodes",
    ]
    for record in result.run.records:
        lines.append(f"  {record.name:16s} {record.seconds:8.2f} s  {record.size} (verify {record.verify_seconds:.2f} s)")
    lines += [f"  {name:16s} not run (until {result.run.records[-1].name if result.run.records else 'capture'})" for name in result.skipped]
    lines += [f"  {name:16s} not written yet" for name in result.missing]

    weights = graph.by_role(Role.WEIGHT)
    split = sum(w.nbytes for w in weights if w.shard is not None)
    replicated = sum(w.nbytes for w in weights if w.shard is None)
    lines.append(f"weights stored per rank: {format_bytes(split + replicated)} ({format_bytes(split)} split, {format_bytes(replicated)} replicated)")
    lines.append(f"decode state per rank: {result.state.text()}")
    counts: dict[str, list[int]] = {}
    for n in graph.nodes:
        if n.op.name in ("all_reduce", "all_gather"):
            counts.setdefault(n.op.name, []).append(sum(graph.tensors[o].nbytes for o in n.outputs))
    if counts:
        lines.append("collectives per step: " + ", ".join(f"{k} x{len(v)} ({format_bytes(sum(v))} results)" for k, v in sorted(counts.items())))

    out = getattr(result.output, "task_graph", result.output)
    tg = out if isinstance(out, TaskGraph) else None
    if tg is not None and tg.sm_lists:
        per_sm = [len(ts) for ts in tg.sm_lists]
        sm_bytes = tg.meta.get("sm_bytes") or [sum(tg.tasks[i].weight_bytes for i in ts) for ts in tg.sm_lists]
        lines.append(f"tasks per SM: min {min(per_sm)} / mean {statistics.mean(per_sm):.1f} / max {max(per_sm)} ({len(tg.tasks)} tasks)")
        lines.append(f"bytes per SM: min {format_bytes(min(sm_bytes))} / mean {format_bytes(statistics.mean(sm_bytes))} / max {format_bytes(max(sm_bytes))}")
    else:
        lines.append("tasks and bytes per SM: not available (needs tile ... schedule)")
    predicted = tg.meta.get("predicted_step_s") if tg is not None else None
    lines.append(f"placement cost model's step time (schedule): {predicted * 1e6:.1f} us" if predicted else "placement cost model's step time: not available (needs schedule)")
    replayed = replayed or replayed_step(result.output, t)
    if replayed is not None:
        sh = replayed.shares()
        lines.append(f"predicted step time (streaming replay, ir/replay.py {REPLAY_COSTS_NAME}, every request at the max context): "
                     f"{replayed.step_s * 1e6:.1f} us "
                     f"(consumers waiting {sh['consumer_wait']:.0%}, in bodies {sh['body']:.0%}; producers blocked on a full ring {sh['producer_blocked']:.0%})")  # fmt: skip
    lines.append(_roofline(result.sharded, t))
    return "\n".join(lines) + "\n"


def replayed_step(output, target: Target, kernel_options: dict[str, int] | None = None):
    """The replay of an emitted table on the kernel the build makes of it (ir/replay.py), or None where its
    constants do not apply (they are the H200's) or nothing was emitted."""
    from k3mk.codegen.ops import KernelConfig, ring_layout
    from k3mk.ir.replay import H200_2026_12_03, replay
    from k3mk.ir.streaming import RingModel
    from k3mk.passes.emit_task_table import EmittedTable
    from k3mk.passes.schedule import activation_bytes

    if not isinstance(output, EmittedTable) or target.arch != "sm_90a":
        return None
    config = KernelConfig(**(kernel_options or {}))
    ring = ring_layout(output.table.variants, config)
    tg = output.task_graph
    task_bytes = [[(tg.tasks[i].weight_bytes, activation_bytes(tg.tasks[i], tg.graph)) for i in ids] for ids in output.graph_lists]
    return replay(output.table, task_bytes, RingModel(ring.slots, ring.records, config.warps, ring.slot_bytes), H200_2026_12_03)


REPLAY_COSTS_NAME = "H200_2026_12_03"


def _roofline(graph: Graph, target: Target) -> str:
    try:
        from k3mk.passes.schedule import roofline_bytes
    except ModuleNotFoundError:
        return "roofline: not available (needs passes/schedule.py roofline_bytes)"
    roof = roofline_bytes(graph)
    return (
        f"roofline per rank at NOMINAL bandwidth {target.bandwidth / 1e12:.1f} TB/s ({target.device_name} datasheet, not measured): "
        f"{format_bytes(roof['total'])} per step ({format_bytes(roof['weights'])} weights, {format_bytes(roof['experts'])} routed experts, "
        f"{format_bytes(roof['state'])} state) -> {roof['total'] / target.bandwidth * 1e6:.1f} us"
    )


def rank_view(graph: Graph, rank: int) -> str:
    """What rank `rank` loads and owns: the slice of every split weight, state and output."""
    tp = graph.meta.get("tp", 1)
    lines = [f"rank {rank} of {tp}:"]
    replicated = 0
    for role in (Role.WEIGHT, Role.STATE, Role.OUTPUT):
        for tensor in sorted(graph.by_role(role), key=lambda x: x.name):
            s = tensor.shard
            if s is None:
                replicated += role == Role.WEIGHT
                continue
            full = tensor.shape[s.dim] * s.parts
            ranges = ", ".join(f"{start}:{stop}" for start, stop in s.ranges(full, rank))
            lines.append(f"  {role.value} {tensor.name}: dim {s.dim} [{ranges}] of {full}")
    lines.append(f"  ({replicated} weights replicated on every rank)")
    return "\n".join(lines) + "\n"


# --- `k3mk compile` ----------------------------------------------------------------------------------


def compile_artifact(
    config: ModelConfig,
    tp: int = 1,
    max_tokens: int = 1,
    max_context: int = 4096,
    arch: str = "sm_90a",
    out_dir: str | Path = "artifact",
    *,
    dtype: torch.dtype = torch.bfloat16,
    progress: Callable[[str], None] | None = None,
    result: CompileResult | None = None,
    profile: bool = False,
    kernel_options: dict[str, int] | None = None,
    replayed=None,
) -> Path:
    """The whole compile: capture, every pass through emit_task_table, then the CuTe DSL build of the
    table's ONE megakernel (codegen/build.py) into `out_dir`: cubin, task table, generated source, the
    IR after capture / fusion and the task schedule as text, and manifest.json with the compile target
    (docs/megakernel.md "Artifact directory") and the cost model's bytes per task (task_bytes.json). `profile`:
    a profile build (per-task timestamps). `kernel_options`: KernelConfig tuning fields; `replayed`: the
    replay of this build's kernel if the caller has it (replayed_step). Returns the artifact directory."""
    import hashlib
    import json

    from k3mk.codegen.build import build
    from k3mk.codegen.ops import KernelConfig
    from k3mk.passes.emit_task_table import EmittedTable
    from k3mk.passes.schedule import activation_bytes

    say = progress or (lambda line: None)
    if result is None:
        limits.check_kernel_shapes(config, tp, max_tokens, max_context)
        result = compile_graph(config, tp, max_tokens, max_context, dtype, arch, None, say)
    emitted = result.output
    if not isinstance(emitted, EmittedTable):
        raise CompileError(f"the pipeline stopped before emit_task_table (missing: {', '.join(result.missing) or 'none'})")
    t0 = time.perf_counter()
    replayed = replayed or replayed_step(emitted, result.target, kernel_options)
    graph = emitted.task_graph.graph
    kinds = sorted({n.op.name for n in graph.nodes})
    weight_format = "mxfp4" if any("mxfp4" in k for k in kinds) else "bfloat16"
    kv = [t for t in graph.by_role(Role.STATE) if t.name.endswith("kv_cache")]
    meta = {
        "model": config.name,
        "config_hash": graph.meta.get("config") or hashlib.sha256(repr(config).encode()).hexdigest()[:16],
        "tp": tp,
        "max_tokens": max_tokens,
        "max_context": max_context,
        "activation_dtype": str(dtype).removeprefix("torch."),
        "weight_format": weight_format,
        "kv_dtype": str(kv[0].dtype).removeprefix("torch.") if kv else None,
        "state_layouts": {st.name: {"dtype": st.dtype, "shape": list(st.shape), "layout": st.layout} for st in emitted.table.states},
        "step_inputs": {b.name: {"dtype": b.dtype, "shape": list(b.shape)} for b in emitted.table.buffers if b.role == "input"},
        "step_outputs": {b.name: {"dtype": b.dtype, "shape": list(b.shape)} for b in emitted.table.buffers if b.role == "output"},
        "fusions": graph.meta.get("fusions", []),
        "predicted_step_s": replayed.step_s if replayed is not None else None,
    }
    if tp > 1:  # which piece of each full weight / state / output rank r binds or returns (k3mk.runtime.tp)
        meta["tp_shards"] = {t.name: {"dim": t.shard.dim, "parts": t.shard.parts, "groups": t.shard.groups}
                             for t in graph.tensors.values() if t.shard is not None and t.role in (Role.WEIGHT, Role.STATE, Role.OUTPUT)}  # fmt: skip
    files = {
        "ir_captured.txt": result.captured.text() if hasattr(result.captured, "text") else str(result.captured),
        "ir_fused.txt": graph.text() if hasattr(graph, "text") else str(graph),
        "schedule.txt": emitted.text(),
        SUMMARY_FILE: summary(result, replayed),
    }
    # the cost model's bytes per task, table order (EmittedTable.graph_lists): what a profile
    # build's timeline and the replay with other constants (bench/calibrate.py) need
    tasks = [emitted.task_graph.tasks[i] for ids in emitted.graph_lists for i in ids]
    files["task_bytes.json"] = json.dumps({"weight_bytes": [t.weight_bytes for t in tasks],
                                           "other_bytes": [activation_bytes(t, graph) for t in tasks]})  # fmt: skip
    out = build(emitted.table, out_dir, arch=arch, sm_count=result.target.num_sms, config=KernelConfig(profile=profile, **(kernel_options or {})), meta=meta,
                extra_files=files)  # fmt: skip
    say(f"build: {out} in {time.perf_counter() - t0:.1f} s")
    return out


def run_compile(args: argparse.Namespace, config: ModelConfig, artifact: Path | None = None) -> int:
    """The pipeline part of `k3mk compile` (k3mk/compiler/cli.py checks the options first and serves
    cached artifacts): progress to stderr, the summary (and --show-rank's view) to stdout; with
    `artifact`, the artifact is built there (`compile_artifact`)."""
    progress = lambda line: print(f"k3mk: {line}", file=sys.stderr, flush=True)  # noqa: E731
    if artifact is not None:
        limits.check_kernel_shapes(config, args.tp, args.max_tokens, args.max_context)  # the template limits, before the passes
        result = compile_graph(config, args.tp, args.max_tokens, args.max_context, torch.bfloat16, args.arch, args.dump, progress)
        replayed = replayed_step(result.output, result.target, dict(args.kernel_option))
        print(summary(result, replayed), end="")
        compile_artifact(config, args.tp, args.max_tokens, args.max_context, args.arch, artifact, progress=progress, result=result,
                         profile=args.profile, kernel_options=dict(args.kernel_option), replayed=replayed)  # fmt: skip
        return 0
    # Without an artifact nothing needs the binary table: stop after the schedule and its deadlock check.
    # Nor the op templates: a width they cannot generate is noted, not refused (the analysis is still valid).
    until = args.until or "check_deadlock"
    result = compile_graph(config, args.tp, args.max_tokens, args.max_context, torch.bfloat16, args.arch, args.dump, progress, until)
    try:
        limits.check_kernel_shapes(config, args.tp, args.max_tokens, args.max_context)
    except CompileError as e:
        progress(f"note: no megakernel can be built for this target (--out would refuse it): {e}")
    print(summary(result), end="")
    if args.show_rank is not None:
        print(rank_view(result.graph, args.show_rank), end="")
    return 0
