"""bench/calibrate.py recovers the replay's constants from a timeline: the records here are the replay's
own timing of k3-tiny's table under known constants (every stamp as a profile build writes it), so a fit
that reads the stamps right gives back those constants and the same step."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from k3mk.bench.calibrate import FILL_LATENCIES, Build, fit
from k3mk.compiler.config import load_config
from k3mk.compiler.pipeline import compile_graph
from k3mk.ir.replay import H200_2026_12_03
from k3mk.ir.streaming import RingModel
from k3mk.passes.schedule import activation_bytes

FIELDS = ["start", "wait_done", "body_end", "smid", "epoch", "produce_start", "produce_end", "ring_wait", "issued_bytes"]


@pytest.fixture(scope="module")
def build() -> Build:
    em = compile_graph(load_config("k3-tiny"), 1, 2, 256, until="emit_task_table").output
    tg = em.task_graph
    task_bytes = [[(tg.tasks[i].weight_bytes, activation_bytes(tg.tasks[i], tg.graph)) for i in ids] for ids in em.graph_lists]
    return Build(em.table, RingModel(6, 16, 8), task_bytes)


def test_the_fit_recovers_the_constants_of_its_records(build):
    truth = dataclasses.replace(H200_2026_12_03, sm_stream=400e9, fill_latency=FILL_LATENCIES[3], fill_issue=0.13e-6,
                                handoff=0.9e-6, task_overhead=0.45e-6, prologue=0.6e-6, consume={"bfloat16": 55e9, "mxfp4": H200_2026_12_03.consume["mxfp4"]},
                                direct={"kda_recurrence": (1.7e-6, 19e9), "mla_decode": (0.8e-6, 31e9)})  # fmt: skip
    r = build.replay(truth)
    rows = [t for ts in r.times for t in ts]
    records = np.zeros((len(rows), len(FIELDS)), dtype=np.int64)
    for i, (start, wait_done, body_end, p0, p1, ring_wait) in enumerate(rows):
        stamps = dict(start=start, wait_done=wait_done, body_end=body_end, produce_start=p0, produce_end=p1, ring_wait=ring_wait)
        for name, value in stamps.items():
            records[i, FIELDS.index(name)] = round(value * 1e9)  # ns, as %globaltimer
    costs, report = fit(build, records, FIELDS, truth.sm_stream, 2.0e-6, H200_2026_12_03)
    ns = 2e-9  # the stamps' rounding
    assert costs.handoff == pytest.approx(truth.handoff, abs=ns) and report["handoffs"] > 10
    assert costs.task_overhead == pytest.approx(truth.task_overhead, abs=ns)
    assert costs.fill_issue == pytest.approx(truth.fill_issue, abs=ns) and report["issue_samples"] > 10
    sizes = {}  # the byte counts each op's tasks have (a fit is only asked to be right there)
    for ts, bs in zip(build.table.lists, build.task_bytes):
        for t, (w, o) in zip(ts, bs):
            sizes.setdefault(build.table.variants[t.opcode].op, set()).add(w + o)
    for op in ("kda_recurrence", "mla_decode"):
        for nbytes in sizes[op]:
            assert costs.direct_time(op, nbytes) == pytest.approx(truth.direct_time(op, nbytes), abs=4 * ns), op
    # k3-tiny's bf16 gemvs often have their fills in the ring before the body (its MXFP4 experts never do:
    # their producers wait for the router, so their consume rate stays the base's)
    assert costs.prologue == pytest.approx(truth.prologue, abs=4 * ns) and report["streamed_samples"]["bfloat16"] > 100
    assert costs.consume["bfloat16"] == pytest.approx(truth.consume["bfloat16"], rel=1e-2)
    assert costs.fill_latency == truth.fill_latency
    assert build.replay(costs).step_s == pytest.approx(r.step_s, rel=1e-3)


def test_a_manifests_block_gives_its_consumer_warps():
    """A build's block is its consumer warps and the support warps (the producer, waiter and signaller), or a whole
    support warpgroup where the consumers take its registers (codegen/ops.py KernelConfig.block_threads)."""
    from k3mk.bench.calibrate import consumer_warps
    from k3mk.codegen.ops import KernelConfig

    for config in (KernelConfig().for_batch(1), KernelConfig().for_batch(8), KernelConfig(threads=128).for_batch(1), KernelConfig(threads=384).for_batch(1)):
        assert consumer_warps(config.block_threads) == config.warps
