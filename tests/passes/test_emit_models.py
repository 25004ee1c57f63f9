"""The whole decode step of k3-tiny and a small Kimi Linear config, lowered to task table format 3 and
executed FROM THE TABLE (ir/table_exec.py: opcodes, params, operand words, pointer table, events), the
same bytes the GPU runs: bit for bit the interpreter on the fused graph, states included, over 2 steps;
and the artifact build of the whole k3-tiny table (one kernel, sm_90a cubin) with its manifest."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from k3mk.compiler.capture import capture
from k3mk.compiler.random_weights import random_weights
from k3mk.ir import interpreter
from k3mk.ir.graph import Role
from k3mk.ir.table_exec import TableExecutor
from k3mk.ir.task_table import FORMAT_VERSION, OP_KINDS, TaskTable
from k3mk.passes.emit_task_table import LOWER
from k3mk.passes.manager import PIPELINE, Target, run_pipeline

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from test_model_gpu import config_of  # noqa: E402  (the GPU test's configs: k3-tiny, kimi-linear-small)

BF16 = torch.bfloat16
MAX_CONTEXT = 64


def emitted(name: str, batch: int):
    config = config_of(name)
    graph = capture(config, batch, MAX_CONTEXT, BF16)
    target = Target.for_arch(config, max_tokens=batch, max_context=MAX_CONTEXT, dtype=BF16)
    return config, graph, run_pipeline(graph, target, PIPELINE).output


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("name", ["k3-tiny", "kl"])
def test_table_executes_bit_for_bit_like_the_interpreter(name, batch):
    config, captured, out = emitted(name, batch)
    table = TaskTable.decode(out.data)  # what the GPU loads
    assert table == out.table
    graph = out.task_graph.graph
    kinds = {t.op.name for t in out.task_graph.tasks}
    assert kinds <= set(LOWER)
    assert {b.name: b.role for b in table.buffers if b.role != "activation"} == {
        "token_ids": "input", "positions": "input", "logits": "output", "next_tokens": "output"}  # fmt: skip
    assert table.buffer("token_ids").dtype == "int32" and table.buffer("positions").dtype == "int32"
    assert [s.name for s in table.states] == sorted(t.name for t in graph.by_role(Role.STATE))
    weights = random_weights(config, 0, BF16)
    gen = torch.Generator().manual_seed(batch)
    state = {t.name: (0.5 * torch.randn(t.shape, generator=gen)).to(t.dtype) for t in graph.by_role(Role.STATE)}
    ex = TableExecutor(table, weights, {k: v.clone() for k, v in state.items()})
    tokens = torch.randint(0, config.vocab_size, (batch,), generator=gen)
    positions = torch.randint(0, MAX_CONTEXT - 2, (batch,), generator=gen)
    for step in range(2):
        inputs = {"token_ids": tokens, "positions": positions + step}
        expected = interpreter.run(graph, {**weights, **inputs, **state})
        ex.step(inputs)
        assert torch.equal(ex.buffer("logits"), expected["logits"])
        assert torch.equal(ex.buffer("next_tokens"), expected["next_tokens"])
        for k in state:
            assert torch.equal(ex.pointers[table.state_id(k)], expected[k]), k
            state[k] = expected[k]
        tokens = expected["next_tokens"].long()


def test_format_2_operands():
    """State operands index the pointer table after the weights; embedding tiles rows."""
    _, _, out = emitted("k3-tiny", 4)
    table = out.table
    assert FORMAT_VERSION == 3 and "batch_begin" in OP_KINDS["embedding"].operands
    nw = len(table.weights)
    for tasks in table.lists:
        for t in tasks:
            v = table.variants[t.opcode]
            for name in ("state", "cache"):
                if name in OP_KINDS[v.op].operands and v.op != "nop":
                    assert nw <= t.operands[name] < nw + len(table.states)
            if v.op == "embedding":
                assert t.operands.get("batch_count") == 1
    assert sorted({table.variants[t.opcode].op for ts in table.lists for t in ts}) == sorted(
        ["gemv", "embedding", "argmax", "kda_conv", "kda_recurrence", "attn_res", "router", "expert_gated", "expert_combine",
         "mla_latent", "nop", "mla_q_absorb", "mla_decode", "mla_v_up"])  # fmt: skip


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_whole_k3_tiny_artifact(tmp_path, arch):
    """The whole k3-tiny table is ONE kernel: it compiles to an sm_90a / sm_100a cubin (about 14 s uncached
    on this 2-core machine, then cached by source) and the manifest carries the compile target."""
    pytest.importorskip("cutlass")
    from k3mk.compiler.pipeline import compile_artifact

    out = compile_artifact(config_of("k3-tiny"), 1, 1, MAX_CONTEXT, arch, tmp_path / "art")
    m = json.loads((out / "manifest.json").read_text())
    assert (out / m["files"]["cubin"]).read_bytes()[:4] == b"\x7fELF" and m["arch"] == arch
    assert f".target {arch}" in (out / m["files"]["ptx"]).read_text()
    for key in ("task_table_format", "k3mk_version", "cutlass_dsl_version", "arch", "sm_count", "tp", "max_tokens", "max_context",
                "weight_format", "kv_dtype", "state_layouts", "config_hash", "params", "buffers", "weights", "states"):  # fmt: skip
        assert key in m, key
    assert m["task_table_format"] == 3 and m["weight_format"] == "mxfp4" and m["kv_dtype"] == "bfloat16"
    assert m["kernel_name"] == "k3mk_megakernel_0" and m["tp"] == 1 and m["max_context"] == MAX_CONTEXT
    for role in ("task_table", "source", "ir_captured.txt", "ir_fused.txt", "schedule.txt"):
        assert (out / m["files"][role]).exists()
