"""The pass manager: runs passes in order, verifies after each, dumps and times them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from k3mk.compiler.capture import capture
from k3mk.compiler.config import load_config
from k3mk.ir.graph import Graph, IRError
from k3mk.passes import manager
from k3mk.passes.manager import PIPELINE, LazyPass, Target, available, run_pipeline, until


@pytest.fixture(scope="module")
def graph() -> Graph:
    return capture(load_config("k3-tiny"), 1, 16, torch.float32)


def rename_meta(g: Graph, target: Target) -> Graph:
    out = g.copy()
    out.meta["tp"] = target.tp
    return out


def break_shape(g: Graph, target: Target) -> Graph:
    out = g.copy()
    out.tensors["logits"] = dataclasses.replace(out.tensors["logits"], shape=(1, 7))
    return out


def test_pipeline_order_is_the_design_order():
    assert [p.name for p in PIPELINE] == [
        "tp_shard", "fuse", "tile", "plan_memory", "build_events", "check_events", "schedule", "check_deadlock", "emit_task_table",
    ]


def test_runs_passes_in_order_and_dumps(graph, tmp_path):
    seen = []
    run = run_pipeline(graph, Target(load_config("k3-tiny"), tp=2), [rename_meta, rename_meta], tmp_path, lambda r, x: seen.append(r.name))
    assert run.output.meta["tp"] == 2 and graph.meta.get("tp") is None
    assert seen == ["rename_meta", "rename_meta"] and [r.name for r in run.records] == seen
    assert all(r.seconds >= 0 and r.verify_seconds >= 0 for r in run.records)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["00_capture.txt", "01_rename_meta.txt", "02_rename_meta.txt"]
    assert "tp=2" in (tmp_path / "01_rename_meta.txt").read_text()


def test_verifies_after_every_pass_and_names_the_pass(graph):
    with pytest.raises(IRError, match="logits") as info:
        run_pipeline(graph, Target(load_config("k3-tiny")), [rename_meta, break_shape])
    assert "break_shape" in "".join(getattr(info.value, "__notes__", []))


def test_available_is_a_prefix_and_until_cuts():
    assert until("fuse") == PIPELINE[:2]
    with pytest.raises(ValueError, match="no pass 'nope'"):
        until("nope")
    assert available([rename_meta, LazyPass("not_written_yet"), rename_meta]) == [rename_meta]


def test_target_for_arch_uses_nominal_datasheet_numbers():
    config = load_config("k3-tiny")
    h200, b200 = Target.for_arch(config, "sm_90a"), Target.for_arch(config, "sm_100a", tp=8)
    assert (h200.bandwidth, h200.num_sms) == (4.8e12, 132)
    assert (b200.bandwidth, b200.tp) == (8e12, 8)
    with pytest.raises(ValueError, match="unknown arch 'sm_42'"):
        Target.for_arch(config, "sm_42")
    assert manager.ARCHS["sm_90a"][0] == "H200"
