"""The pass pipeline in order, the compile target, and the tiny manager that runs them.

Every pass is a function `(x, target) -> x'` in its own file `passes/<name>.py`, named like the file.
`x` is an `ir.graph.Graph` up to `fuse` and an `ir.tasks.TaskGraph` from `tile` on. After every pass
the manager calls `x.verify()`, and with a dump directory writes `x.text()` to `NN_<pass>.txt`
(`00_capture.txt` is the input), so a broken invariant is caught at the pass that broke it.

Passes are looked up lazily by name: the pipeline is complete on paper while some passes are still
being written, and `available()` gives the prefix that exists (DESIGN.md, "Data flow").
"""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from k3mk.compiler.config import ModelConfig

# (name, nominal bandwidth bytes/s, dense bf16 flop/s, SMs) per arch; datasheet figures, used only by
# the cost model and the roofline printed at compile time (DESIGN.md, "Benchmark method").
ARCHS: dict[str, tuple[str, float, float, int]] = {
    "sm_90a": ("H200", 4.8e12, 0.989e15, 132),
    "sm_100a": ("B200/GB200", 8.0e12, 2.25e15, 148),
    "sm_103a": ("B300/GB300", 8.0e12, 2.5e15, 148),
}


@dataclass(frozen=True)
class Target:
    """What one compile is for (DESIGN.md, "The compile target"). The rank is NOT part of it: one
    artifact serves every rank of a TP group, the rank is a run-time parameter."""

    config: ModelConfig
    tp: int = 1
    max_tokens: int = 1  # tokens per step: requests x (1 + draft tokens)
    max_context: int = 4096
    dtype: torch.dtype = torch.bfloat16
    arch: str = "sm_90a"
    num_sms: int = 132
    bandwidth: float = 4.8e12  # NOMINAL HBM bytes/s (not measured)
    flop_rate: float = 0.989e15  # dense bf16 flop/s
    device_name: str = "H200"
    event_latency: float = 1.0e-6  # producer signal -> waiting SM sees it (measured 1.02 us/hop on an H200, docs/megakernel.md)
    # per task, not overlapped: the engine's fixed part of a small task (H200, ir/replay.py H200_2026_12_03: a
    # streaming task's prologue / epilogue / barrier 3.1 us, kda_conv 5.3, mla_decode 2.4). At the old 0.3 us guess
    # the schedule piled a layer's small tasks (kda_conv, MLA decode) 4 deep on one SM once the shared expert's down
    # projection left the MoE critical path (+2.2% on Kimi Linear b1, BENCHMARKS.md 2026-12-03 evening); the
    # replay of 1.5 us: Kimi Linear b1 -3.9%, K3 proxy b1 / b4 -0.7% / -1.4%, Kimi Linear b4 +0.8%
    task_overhead: float = 1.5e-6

    @staticmethod
    def for_arch(config: ModelConfig, arch: str = "sm_90a", **fields: Any) -> "Target":
        """The target with `arch`'s datasheet numbers; `fields` override any of them."""
        if arch not in ARCHS:
            raise ValueError(f"unknown arch '{arch}' (known: {', '.join(ARCHS)})")
        name, bandwidth, flops, sms = ARCHS[arch]
        defaults = dict(num_sms=sms, bandwidth=bandwidth, flop_rate=flops, device_name=name)
        return Target(config=config, arch=arch, **{**defaults, **fields})


Pass = Callable[[Any, Target], Any]


@dataclass(frozen=True)
class LazyPass:
    """`passes/<name>.py`'s function `<name>`, imported on first call."""

    name: str

    @property
    def __name__(self) -> str:  # so a LazyPass and a plain function print alike
        return self.name

    def load(self) -> Pass:
        return getattr(importlib.import_module(f"k3mk.passes.{self.name}"), self.name)

    def exists(self) -> bool:
        try:
            self.load()
        except ModuleNotFoundError as e:
            if e.name != f"k3mk.passes.{self.name}":
                raise  # the pass exists but imports something missing: a real error
            return False
        return True

    def __call__(self, x: Any, target: Target) -> Any:
        return self.load()(x, target)


PIPELINE: list[LazyPass] = [
    LazyPass(name)
    # check_deadlock after schedule: the per-SM lists (program order + events) must complete.
    for name in ("tp_shard", "fuse", "tile", "plan_memory", "build_events", "check_events", "schedule", "check_deadlock", "emit_task_table")
]


def available(passes: list = PIPELINE) -> list:
    """The longest prefix of `passes` whose modules exist (the rest are not written yet)."""
    out = []
    for p in passes:
        if isinstance(p, LazyPass) and not p.exists():
            break
        out.append(p)
    return out


def until(name: str, passes: list = PIPELINE) -> list:
    """`passes` up to and including the one called `name`."""
    names = [pass_name(p) for p in passes]
    if name not in names:
        raise ValueError(f"no pass '{name}' in the pipeline ({', '.join(names)})")
    return passes[: names.index(name) + 1]


def pass_name(p: Pass) -> str:
    return getattr(p, "__name__", type(p).__name__)


@dataclass
class PassRecord:
    name: str
    seconds: float  # the pass alone
    verify_seconds: float
    size: str  # "N nodes" of a Graph, "N tasks" of a TaskGraph


def size(x: Any) -> str:
    return f"{len(x.tasks)} tasks" if hasattr(x, "tasks") else f"{len(x.nodes)} nodes"


@dataclass
class PipelineRun:
    output: Any  # what the last pass returned
    records: list[PassRecord] = field(default_factory=list)


def run_pipeline(
    x: Any,
    target: Target,
    passes: list = PIPELINE,
    dump_dir: str | Path | None = None,
    on_pass: Callable[[PassRecord, Any], None] | None = None,
) -> PipelineRun:
    """Run `passes` in order on `x`, verifying after each; dump `NN_<pass>.txt` into `dump_dir`.
    `on_pass(record, x)` is called after each pass (progress printing, per-pass checks in tests)."""
    dump = Path(dump_dir) if dump_dir is not None else None
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
        (dump / "00_capture.txt").write_text(x.text())
    run = PipelineRun(x)
    for number, p in enumerate(passes, start=1):
        name = pass_name(p)
        start = time.perf_counter()
        x = p(x, target)
        middle = time.perf_counter()
        try:
            x.verify()
        except Exception as e:
            e.add_note(f"(verifying the output of pass '{name}')")
            raise
        record = PassRecord(name, middle - start, time.perf_counter() - middle, size(x))
        run.records.append(record)
        if dump is not None:
            (dump / f"{number:02d}_{name}.txt").write_text(x.text())
        if on_pass is not None:
            on_pass(record, x)
    run.output = x
    return run
