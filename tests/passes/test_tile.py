"""passes/tile.py: every op kind has a tiling rule; the tasks of every node write each output element
exactly once; running the tasks one by one with their recipes (ir.tasks.execute / execute_collective)
computes what the interpreter computes, on random weights, state and inputs."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import random

import pytest
import torch

from k3mk.compiler.capture import capture
from k3mk.compiler.config import load_config
from k3mk.compiler.random_weights import random_weights
from k3mk.ir import collectives, fused, interpreter, ranks  # noqa: F401  (registers every op kind)
from k3mk.ir.graph import Graph, Role
from k3mk.ir.ops import OPS
from k3mk.ir.tasks import TaskGraph, buffer_name, byte_runs, execute, execute_collective
from k3mk.passes import tile as tile_pass
from k3mk.passes.fuse import fuse
from k3mk.passes.manager import Target
from k3mk.passes.tile import RULES, TileError, coverage_errors, missing_rules, split, task_count, tile, mla_decode_group_heads, mla_decode_head_groups
from k3mk.passes.tp_shard import tp_shard

MAX_CONTEXT = 8


CONFIGS = {"k3-tiny": lambda: load_config("k3-tiny"), "kimi-linear-small": lambda: load_config("kimi-linear-tiny")}


@functools.cache
def captured(name: str, batch: int) -> Graph:
    return capture(CONFIGS[name](), batch, MAX_CONTEXT, torch.float32)


@functools.cache
def graph_of(name: str, batch: int, tp: int, fused_: bool, num_sms: int = 8) -> tuple[Graph, Target]:
    """The captured graph of a config, sharded to `tp` ranks and fused when asked."""
    config = CONFIGS[name]()
    target = Target.for_arch(config, num_sms=num_sms, tp=tp, max_tokens=batch, max_context=MAX_CONTEXT, dtype=torch.float32)
    graph = captured(name, batch)
    if tp > 1:
        graph = tp_shard(graph, target)
    if fused_:
        graph = fuse(graph, target)
    return graph, target


def step_values(graph: Graph, seed: int, vocab: int) -> dict[str, torch.Tensor]:
    """Random token ids, positions and (non-zero) decode state."""
    gen = torch.Generator().manual_seed(seed)
    values = {}
    for t in graph.tensors.values():
        if t.name == "token_ids":
            values[t.name] = torch.randint(0, vocab, t.shape, generator=gen)
        elif t.name == "positions":
            values[t.name] = torch.randint(0, MAX_CONTEXT, t.shape, generator=gen)
        elif t.role == Role.STATE:
            values[t.name] = (0.5 * torch.randn(t.shape, generator=gen)).to(t.dtype)
    return values


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


# --- rules -----------------------------------------------------------------------------------------


def test_every_registered_op_kind_has_a_tiling_rule():
    assert missing_rules() == []
    assert {"all_reduce", "all_gather", "router", "mla_decode", "expert_gated_linear_mxfp4"} <= set(OPS)


def test_a_node_without_a_rule_is_an_error_naming_its_kind(monkeypatch):
    graph, target = graph_of("k3-tiny", 1, 1, False)
    monkeypatch.delitem(RULES, "kda_conv")
    with pytest.raises(TileError, match=r"node 'kda_conv': no tiling rule for op kind 'kda_conv'"):
        tile(graph, target)


def test_sizing_streams_32_kb_to_1_mb_per_task_and_fills_the_sms():
    assert task_count(10 * 1024, 132) == 1
    assert task_count(64 * 32 * 1024, 132) == 64  # small: one task per 32 KB
    assert task_count(100 * 2**20, 132) == 132  # large: one task per SM (776 KB each)
    assert task_count(2**30, 132) == 1056  # larger: <= 1 MB each, a multiple of the SMs
    rows = split(7168, 132, 8)
    assert rows[0] == (0, 56) and rows[-1][1] == 7168 and all(lo % 8 == 0 for lo, _ in rows)


def test_byte_runs_are_the_bytes_of_the_box():
    rng = random.Random(0)
    for _ in range(200):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 4)))
        box = tuple(sorted(rng.sample(range(s + 1), 2)) for s in shape)
        box = tuple((lo, hi) if lo < hi else (0, s) for (lo, hi), s in zip(box, shape))
        itemsize = rng.choice((1, 2, 4))
        flat = torch.arange(math.prod(shape)).reshape(shape)
        expected = sorted(b for e in flat[tuple(slice(lo, hi) for lo, hi in box)].flatten().tolist() for b in range(e * itemsize, (e + 1) * itemsize))
        runs = byte_runs(box, shape, itemsize)
        assert [b for lo, hi in runs for b in range(lo, hi)] == expected
        assert all(hi < lo2 for (_, hi), (lo2, _) in zip(runs, runs[1:]))  # disjoint, maximal


# --- coverage ----------------------------------------------------------------------------------------


CASES = [
    ("k3-tiny", 1, 1, False),  # the captured ops, unfused
    ("k3-tiny", 4, 1, True),
    ("k3-tiny", 2, 2, True),  # collectives
    ("kimi-linear-small", 1, 1, False),
    ("kimi-linear-small", 4, 1, True),
]


@pytest.mark.parametrize("name, batch, tp, fused_", CASES)
def test_tasks_write_every_output_element_exactly_once(name, batch, tp, fused_):
    graph, target = graph_of(name, batch, tp, fused_)
    tg = tile(graph, target)
    tg.verify()
    assert coverage_errors(tg) == []
    node_index = {n.name: i for i, n in enumerate(graph.nodes)}
    assert [node_index[t.node] for t in tg.tasks] == sorted(node_index[t.node] for t in tg.tasks)  # node order
    by_node: dict[str, list] = {}
    for t in tg.tasks:
        by_node.setdefault(t.node, []).append(t)
    for node, tasks in by_node.items():  # no task reads what another task of its node writes
        for a, b in itertools.permutations(tasks, 2):
            assert not any(r.overlaps(w) for r in a.reads for w in b.writes), (node, a.text(), b.text())


def test_coverage_check_finds_a_gap_and_an_overlap():
    graph, target = graph_of("k3-tiny", 1, 1, False)
    tg = tile(graph, target)
    linear = [t for t in tg.tasks if t.node == "linear"]
    dropped = TaskGraph(graph, [t for t in tg.tasks if t is not linear[0]])
    assert any("'linear'" in e and "elements written" in e for e in coverage_errors(dropped))
    doubled = TaskGraph(graph, [*tg.tasks[: linear[0].id], dataclasses.replace(linear[0], writes=linear[1].writes), *tg.tasks[linear[0].id + 1 :]])
    assert any("'linear'" in e and "overlapping" in e for e in coverage_errors(doubled))


# --- the recipes compute the graph ---------------------------------------------------------------------


def run_tasks(tg: TaskGraph, values: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every task in id order on each rank's memory (activations start as NaN: a task that needs data
    it does not declare cannot go unnoticed); the outputs and state assembled like ir.ranks.run."""
    graph = tg.graph
    tp = graph.meta.get("tp", 1)
    envs = [ranks.rank_inputs(graph, {**weights, **values}, r) for r in range(tp)]
    for env in envs:
        for t in graph.tensors.values():
            if t.role == Role.STATE:
                env[t.name] = env[t.name].clone()
            elif t.role in (Role.ACTIVATION, Role.OUTPUT):
                env[t.name] = torch.full(t.shape, float("nan") if t.dtype.is_floating_point else -1, dtype=t.dtype)
    for task in tg.tasks:
        if isinstance(task.op, collectives.Collective):
            execute_collective(task, graph, envs)
        else:
            for env in envs:
                execute(task, graph, env)
    out = {}
    for t in graph.tensors.values():
        if t.role in (Role.OUTPUT, Role.STATE_OUT):
            pieces = [env[buffer_name(graph, t.name)] for env in envs]
            out[t.alias or t.name] = t.shard.assemble(pieces) if t.shard else pieces[0]
    return out


def assert_tasks_compute(tg: TaskGraph, name: str, batch: int, seed: int) -> None:
    """The tasks of `tg`, run one by one, give what ir.ranks runs of its graph give, on random weights and inputs."""
    config = CONFIGS[name]()
    weights = random_weights(config, 0, torch.float32)
    values = step_values(captured(name, batch), seed, config.vocab_size)
    expected = ranks.run(tg.graph, {**weights, **values})
    got = run_tasks(tg, values, weights)
    for key, ref in expected.items():
        assert (rel(got[key], ref) < 1e-6) if ref.is_floating_point() else torch.equal(got[key], ref), key


@pytest.mark.parametrize("name, batch, tp, fused_", [("k3-tiny", 2, 1, False), ("k3-tiny", 2, 2, True), ("kimi-linear-small", 3, 1, True)])
def test_running_the_tasks_computes_the_graph(name, batch, tp, fused_):
    graph, target = graph_of(name, batch, tp, fused_)
    config = CONFIGS[name]()
    weights = random_weights(config, 0, torch.float32)
    values = step_values(captured(name, batch), 1, config.vocab_size)  # whole state: ranks take their pieces
    expected = ranks.run(graph, {**weights, **values}) if tp > 1 else interpreter.run(graph, {**weights, **values})
    got = run_tasks(tile(graph, target), values, weights)
    assert set(got) == set(expected)
    for key, ref in expected.items():
        if ref.is_floating_point():
            assert rel(got[key], ref) < 1e-6, key
        else:
            assert torch.equal(got[key], ref), key


def test_an_add_of_several_rows_is_tiled_in_contiguous_pieces(monkeypatch):
    """Task table format 3's add takes one contiguous range: with several rows and several pieces (Kimi K3's TP adds of
    the all-reduced residual stream at 16 tokens: 229 KB, 14 pieces), each piece is columns of one row. Pieces made
    small here so that k3-tiny's TP2 adds at batch 4 split; the tasks still compute the graph."""
    monkeypatch.setattr(tile_pass, "ELEMENTWISE_BYTES", 64)
    name, batch = "k3-tiny", 4
    graph, target = graph_of(name, batch, 2, True)
    tg = tile(graph, target)
    assert coverage_errors(tg) == []
    adds = [t for t in tg.tasks if t.op is not None and t.op.name == "add"]
    assert adds and len(adds) > len({t.node for t in adds}) * batch  # several rows, several column pieces of each
    for t in adds:
        (out,) = t.results
        assert len(byte_runs(out.boxes[0], graph.tensors[out.tensor].shape, 1)) == 1, out.text()
    assert_tasks_compute(tg, name, batch, seed=2)


def test_tiles_fill_the_sms_of_a_large_target():
    """At K3-like widths a GEMV gets a multiple of the SM count and the KDA recurrence splits heads."""
    graph, _ = graph_of("k3-tiny", 1, 1, True)
    target = Target.for_arch(load_config("k3-tiny"), num_sms=4)
    tg = tile(graph, target)
    per_node: dict[str, int] = {}
    for t in tg.tasks:
        per_node[t.node] = per_node.get(t.node, 0) + 1
    lm_head = next(n for n in graph.nodes if "lm_head.weight" in n.inputs)
    assert per_node[lm_head.name] % 4 == 0  # 4096 x 512 fp32 = 8 MB: 8 tiles of 1 MB
    kda = next(n for n in graph.nodes if n.op.name == "kda_recurrence")
    assert per_node[kda.name] == 4  # 4 heads, one SM each
    assert tile_pass.MAX_TILE_BYTES >= max(t.weight_bytes for t in tg.tasks if t.node == lm_head.name)


@pytest.mark.parametrize("num_sms, tiles, rows", [(24, 24, 11), (12, 11, 24)])
def test_gemv_and_combine_tiles_round_to_8_rows_unless_that_idles_sms(monkeypatch, num_sms, tiles, rows):
    """A GEMV's and an expert combine's row tiles come in multiples of 8 rows unless that loads the stage's busiest SM
    a quarter more than tiles of any rows (Kimi Linear's 2304 rows on 132 SMs: 128 tiles of 18, not 96 of 24). 256 rows
    on 24 SMs: 24 tiles of <= 11 (rounded: 16 of 16); on 12 SMs 11 of 24 stay (any rows: 12 of 22, 9% less). The uneven
    tiles compute the graph."""
    monkeypatch.setattr(tile_pass, "MIN_TILE_BYTES", 64)  # every node large enough to take every SM
    name, batch = "kimi-linear-small", 2
    graph, _ = graph_of(name, batch, 1, True)
    tg = tile(graph, Target.for_arch(CONFIGS[name](), num_sms=num_sms, max_tokens=batch, max_context=MAX_CONTEXT, dtype=torch.float32))
    assert coverage_errors(tg) == []
    sizes: dict[str, list[int]] = {}
    kinds = set()
    for t in tg.tasks:
        if t.op is not None and t.op.name in ("linear_residual", "expert_linear_combine"):
            (out,) = t.results
            lo, hi = out.boxes[0][1]
            sizes.setdefault(t.node, []).append(hi - lo)
            kinds.add(t.op.name)
    assert kinds == {"linear_residual", "expert_linear_combine"}
    assert all(len(s) == tiles and max(s) == rows and sum(s) == 256 for s in sizes.values()), sizes
    assert_tasks_compute(tg, name, batch, seed=3)


def test_mla_decode_head_groups_are_8_heads_at_batch_1_and_16_above():
    # Kimi Linear's 32 heads, K3's 96, and a count that does not divide: contiguous groups, none over the batch's size
    for heads in (32, 96, 40):
        for batch, size in ((1, 8), (2, 16), (4, 16)):
            groups = mla_decode_head_groups(heads, batch)
            assert groups[0][0] == 0 and groups[-1][1] == heads
            assert all(h1 == h0b for (_, h1), (h0b, _) in zip(groups, groups[1:]))  # contiguous
            assert len(groups) == math.ceil(heads / size) == math.ceil(heads / mla_decode_group_heads(batch))
            assert max(h1 - h0 for h0, h1 in groups) <= size
