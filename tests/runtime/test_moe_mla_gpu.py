"""GPU tests of the MoE and MLA op templates (tests/runtime/moe_mla_cases.py): each case runs 3 steps
inside the persistent kernel with fresh random inputs against k3mk.ir.semantics / k3mk.ir.fused:
router ids bit for bit (+ the tie rule), routing weights to 1e-5; expert outputs (bf16, MXFP4) and the
MoE block stage by stage (each stage against the reference fed with the KERNEL's previous outputs) and
end to end; the MLA decode stage by stage (cache row, q absorb, per-chunk o / lse, LSE merge + W_UV)
and end to end, with the latent cache evolving in place over the steps. Plus the K3-size MXFP4 expert
GEMV bandwidth. $K3MK_RESULTS (a file) receives every measured error and timing as JSON lines.

Artifacts come prebuilt: python tests/runtime/build_megakernel_cases.py <case ...>."""

from __future__ import annotations

import json
import os
import sys
import zlib
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from megakernel_cases import all_cases, artifacts_dir  # noqa: E402
from moe_mla_cases import MoeMlaCase  # noqa: E402

from k3mk.ir import fused, semantics  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CASES = {n: c for n, c in all_cases().items() if isinstance(c, MoeMlaCase)}
OP_CASES = [n for n, c in CASES.items() if c.kind != "bench" and not c.meta.get("bench")]
MLA_BENCH_CASES = [n for n, c in CASES.items() if c.kind == "mla" and c.meta.get("bench")]
BENCH_CASES = [n for n, c in CASES.items() if c.kind == "bench"]
# Tuning sweeps: artifacts <case>@<suffix> built with --config slot_bytes=S --config gemv_unroll=U --suffix <suffix>
BENCH_SUFFIXES = [s for s in os.environ.get("K3MK_BENCH_SUFFIXES", "").split(",") if s]
BENCH_ARTIFACTS = BENCH_CASES + [f"{n}@{s}" for n in BENCH_CASES for s in BENCH_SUFFIXES]
BF16_TOLERANCE = 1e-2  # ||out - ref|| / ||ref||, as the framework's op tests
FP32_TOLERANCE = 1e-4


@pytest.fixture(autouse=True, scope="module")
def _exact_reference():
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_tf32 = False
    yield


def record(entry: dict) -> None:
    print(json.dumps(entry))
    path = os.environ.get("K3MK_RESULTS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")


def load(name: str):
    from k3mk.runtime import Megakernel

    path = artifacts_dir() / name
    if not (path / "manifest.json").exists():
        pytest.skip(f"no artifact at {path}: run tests/runtime/build_megakernel_cases.py {name}")
    case = CASES[name.split("@")[0]]
    assert (path / "task_table.bin").read_bytes() == case.builder.table().encode(), f"{path} is stale: rebuild it"
    return case, Megakernel(path)


def measure(got: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Finite entries compared (and the -inf pattern checked equal by the caller where it matters)."""
    g, r = got.double(), ref.to(got.dtype).double()
    finite = torch.isfinite(r)
    diff = (g - r).abs()[finite]
    rf = r[finite]
    return {
        "rel": (diff.norm() / rf.norm().clamp_min(1e-30)).item() if diff.numel() else 0.0,
        "max_abs": diff.max().item() if diff.numel() else 0.0,
        "max_ref": rf.abs().max().item() if rf.numel() else 0.0,
    }


class Checker:
    def __init__(self, name: str):
        self.name, self.failures, self.worst = name, [], {}

    def close(self, key: str, got: torch.Tensor, ref: torch.Tensor, tol: float, step: int) -> None:
        if got.shape != ref.shape:
            self.failures.append(f"step {step}: {key} shape {tuple(got.shape)} != {tuple(ref.shape)}")
            return
        if got.is_floating_point() and got.isnan().any():
            self.failures.append(f"step {step}: {key} has {int(got.isnan().sum())} NaNs")
            return
        if got.is_floating_point() and not torch.equal(torch.isinf(got), torch.isinf(ref.to(got.dtype))):
            self.failures.append(f"step {step}: {key} -inf pattern differs")
        m = measure(got, ref)
        if key not in self.worst or m["rel"] > self.worst[key]["rel"]:
            self.worst[key] = m
        if not m["rel"] < tol:
            self.failures.append(f"step {step}: {key} rel error {m['rel']:.2e} >= {tol:.0e} (max abs {m['max_abs']:.2e} of {m['max_ref']:.2e})")

    def exact(self, key: str, got: torch.Tensor, ref: torch.Tensor, step: int) -> None:
        ok = got.shape == ref.shape and torch.equal(got, ref.to(got.dtype))
        self.worst.setdefault(key, {"rel": 0.0, "exact": True})
        if not ok:
            self.worst[key] = {"rel": float("nan"), "exact": False}
            self.failures.append(f"step {step}: {key} differs:\n got {got.tolist()}\n ref {ref.tolist()}")

    def fail(self, msg: str) -> None:
        self.failures.append(msg)


def _weights_for_scales(weights: dict, base: str) -> tuple[str | None, str | None]:
    return (f"{base}_packed", f"{base}_scale") if f"{base}_packed" in weights else (base, None)


def _expert_linear(x, weights, base: str, ids):
    w, s = _weights_for_scales(weights, base)
    if s is None:
        return semantics.expert_linear(x, weights[w], ids)
    return semantics.expert_linear_mxfp4(x, weights[w], weights[s], ids)


def check_step(case: MoeMlaCase, mk, inputs: dict, weights: dict, before: dict, ck: Checker, step: int) -> None:
    ref_weights = {**weights, **before}
    if case.kind == "router":
        ref = case.builder.reference({k: v.cpu() for k, v in inputs.items()}, {k: v.cpu() for k, v in ref_weights.items()})
        ck.exact("ids", mk.buffer("ids").cpu(), ref["ids"], step)
        ck.close("topk_weights", mk.buffer("topk_weights").cpu(), ref["topk_weights"], 1e-5, step)
        if case.meta.get("ties"):
            for row in mk.buffer("ids").cpu().tolist():
                if sorted(row[:3]) != [1, 20, 33] or row.index(20) > row.index(33) or row[3] != 5:
                    ck.fail(f"step {step}: tie rule broken: {row} (want a permutation of 1, 20, 33 with 20 before 33, then 5)")
        return
    ref = case.builder.reference(inputs, ref_weights)
    if case.kind in ("expert_gated", "expert_combine", "bench"):
        ck.close("y", mk.buffer("y"), ref["y"], BF16_TOLERANCE, step)
        return
    if case.kind == "moe_graph":
        ids, tw, h = mk.buffer("ids"), mk.buffer("topk_weights"), mk.buffer("h")
        ck.exact("ids", ids, ref["ids"], step)
        ck.close("topk_weights", tw, ref["topk_weights"], 1e-5, step)
        x = inputs["x"]
        gate, up = _expert_linear(x, weights, "w1", ids), _expert_linear(x, weights, "w3", ids)
        ck.close("h (kernel ids)", h, semantics.situ_mul(gate, up, 4.0, 25.0), BF16_TOLERANCE, step)
        y_stage = semantics.moe_combine(_expert_linear(h, weights, "w2", ids), tw)
        ck.close("y (kernel h, ids, weights)", mk.buffer("y"), y_stage, BF16_TOLERANCE, step)
        ck.close("y (end to end)", mk.buffer("y"), ref["y"], BF16_TOLERANCE, step)
        return
    if case.kind == "mla":
        m = case.meta
        cache = weights["cache"]
        pos = inputs["positions"].long()
        written = torch.zeros(cache.shape[:2], dtype=torch.bool, device=cache.device)
        written[torch.arange(cache.shape[0], device=cache.device), pos] = True
        if not torch.equal(cache[~written], before["cache"][~written]):
            ck.fail(f"step {step}: cache rows other than positions changed")
        ck.close("cache row", cache[written], ref["cache"][written], BF16_TOLERANCE, step)
        ck.exact("cache k_pe", cache[written][:, m["rank"]:], ref["cache"][written][:, m["rank"]:], step)
        ck.close("q_abs", mk.buffer("q_abs"), ref["q_abs"], BF16_TOLERANCE, step)
        o_ref, lse_ref = fused.mla_decode(mk.buffer("q_abs"), cache, inputs["positions"], m["rank"], m["chunks"], m["min_rows"], m["scale"])
        ck.close("o (kernel q_abs, cache)", mk.buffer("o"), o_ref, FP32_TOLERANCE, step)
        ck.close("lse (kernel q_abs, cache)", mk.buffer("lse"), lse_ref, FP32_TOLERANCE, step)
        out_stage = fused.mla_v_up(mk.buffer("o"), mk.buffer("lse"), weights["kv_b"], m["heads"], m["nope"], m["v_dim"])
        ck.close("out (kernel o, lse)", mk.buffer("out"), out_stage, BF16_TOLERANCE, step)
        ck.close("o (end to end)", mk.buffer("o"), ref["o"], BF16_TOLERANCE, step)
        ck.close("out (end to end)", mk.buffer("out"), ref["out"], BF16_TOLERANCE, step)
        return
    raise AssertionError(case.kind)


def run_case(name: str, steps: int = 3):
    case, mk = load(name)
    seed = zlib.crc32(name.split("@")[0].encode())
    gen_dev = torch.Generator(device="cuda").manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    weights = case.weights(gen_dev, "cuda")
    mk.bind_weights(weights)
    ck = Checker(name)
    states = list(dict.fromkeys(case.builder.states))
    for step in range(1, steps + 1):
        inputs = {k: v.cuda() for k, v in case.inputs(gen, weights, step - 1).items()}
        for k, v in inputs.items():
            mk.buffer(k).copy_(v)
        before = {s: weights[s].clone() for s in states}
        mk.step()
        torch.cuda.synchronize()
        check_step(case, mk, inputs, weights, before, ck, step)
    if mk.epoch != steps:
        ck.fail(f"epoch {mk.epoch} != {steps}")
    if mk.events.tolist() != [steps * c for c in case.builder.table().counter_steps()]:
        ck.fail(f"event counters {mk.events.tolist()}")
    return case, mk, weights, ck


@pytest.mark.parametrize("name", OP_CASES)
def test_case_matches_semantics(name):
    _, _, _, ck = run_case(name)
    record({"case": name, "worst": ck.worst, "failures": ck.failures})
    assert not ck.failures, "\n".join(ck.failures)


# Profile builds of grouped expert cases (`build_megakernel_cases.py --config profile=true --suffix prof <case>`): the
# bytes each task's producer issued, against the model of the grouping (ir/streaming.py routing_units, combine_rounds).
GROUPED_COUNT_CASES = ["expert_gated_bf16_silu_b4", "expert_gated_bf16_silu_b4_same", "expert_gated_bf16_silu_b4_k12",
                       "expert_combine_bf16_b4_same", "expert_combine_bf16_residuals_b4_k12"]  # fmt: skip


@pytest.mark.parametrize("name", GROUPED_COUNT_CASES)
def test_grouped_experts_stream_each_distinct_expert_once(name):
    """At batch > 1 a step streams each distinct expert's rows once (FillPlan.grouped): per task, the producer issues
    its experts' rows (expert_gated: its units in routing_units; expert_combine: one fill per expert and round of
    8 pairs, combine_rounds) x row bytes, and the whole step the distinct experts' bytes (the combine: plus the
    experts that straddle two rounds), not one expert per (request, slot). Correct outputs on the way (run_case)."""
    from k3mk.codegen.ops import KernelConfig
    from k3mk.ir.streaming import combine_rounds, fill_plan, routing_units, task_units
    from k3mk.runtime import abi

    path = artifacts_dir() / f"{name}@prof"
    if not (path / "manifest.json").exists():
        pytest.skip(f"{path} not built (build_megakernel_cases.py --config profile=true --suffix prof {name})")
    case, mk, _, ck = run_case(f"{name}@prof")
    assert not ck.failures, "\n".join(ck.failures)
    table = case.builder.table()
    issued = mk.profile_records()[:, abi.PROFILE_FIELDS.index("issued_bytes")].tolist()
    ids = mk.buffer("ids").cpu().tolist()
    warps = KernelConfig().warps  # the case builds' consumer warps
    per_row = {"expert_gated": lambda t: len(task_units(ids, t.operands.get("slot", 0))), "expert_combine": lambda t: sum(map(len, combine_rounds(ids, warps)))}
    got = rows = 0
    for index, task in enumerate(t for tasks in table.lists for t in tasks):
        variant = table.variants[task.opcode]
        if variant.op not in per_row:
            continue
        plan = fill_plan(variant.op, variant.params)
        assert plan.grouped, (name, plan)
        row_bytes = sum(st.bytes(plan.in_features) for st in plan.streams)
        expected = per_row[variant.op](task) * task.operands["row_count"] * row_bytes  # (operands equal to 0 are not stored)
        assert issued[index] == expected, f"task {index} ({task.operands}): issued {issued[index]} B, the grouping streams {expected}"
        got, rows = got + issued[index], rows + task.operands["row_count"]
    distinct = len(routing_units(ids))
    assert distinct < len(ids) * len(ids[0])  # the routing repeated some expert: the count means something
    if variant.op == "expert_gated":
        assert got == distinct * variant.params.out_features * row_bytes  # the distinct experts' bytes, once
    else:
        assert got == sum(map(len, combine_rounds(ids, warps))) * rows * row_bytes < len(ids) * len(ids[0]) * rows * row_bytes


def captured_step(mk) -> torch.cuda.CUDAGraph:
    """One warm-up step on a side stream (as torch asks before capture), then the step captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        mk.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mk.step()
    return graph


@pytest.mark.parametrize("name", BENCH_ARTIFACTS)
def test_bench_expert_bandwidth(name):
    case, mk, weights, ck = run_case(name, steps=1)
    num_experts = weights[("w1" if case.meta["form"] == "gated" else "w2") + ("_packed" if "mxfp4" in name else "")].shape[0]
    batch, top_k = mk.buffer("ids").shape
    gen = torch.Generator().manual_seed(3)
    if batch == 1:
        perm = torch.randperm(num_experts, generator=gen)
        id_sets = [perm[i * top_k : (i + 1) * top_k].view(1, top_k).to(torch.int32).cuda() for i in range(num_experts // top_k)]
    else:  # each request its own experts, as independent routing gives (a grouped step streams the distinct ones)
        id_sets = [torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(batch)]).to(torch.int32).cuda() for _ in range(4)]

    def step_bytes(ids) -> int:
        return case.meta["weight_bytes"] if batch == 1 else len(set(ids.flatten().tolist())) * case.meta["expert_bytes"]

    same_bytes = step_bytes(mk.buffer("ids"))
    alternating_bytes = sum(step_bytes(ids) for ids in id_sets) / len(id_sets)
    graph = captured_step(mk)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    n = 50
    times = {}
    for mode in ("same experts", "alternating experts (+ a 64 B copy)", "copy only"):
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        start.record()
        for i in range(n):
            if mode != "same experts":
                mk.buffer("ids").copy_(id_sets[i % len(id_sets)])
            if mode != "copy only":
                graph.replay()
        end.record()
        torch.cuda.synchronize()
        times[mode] = start.elapsed_time(end) * 1000 / n
    t = times["alternating experts (+ a 64 B copy)"] - times["copy only"]
    entry = {"case": name, "worst": ck.worst, "failures": ck.failures, "weight_bytes": same_bytes, "weight_bytes_alternating": alternating_bytes,
             "us_per_step": times, "us_alternating_minus_copy": t,
             "TB_per_s_same": same_bytes / times["same experts"] / 1e6,
             "TB_per_s_alternating": alternating_bytes / t / 1e6,
             "registers": json.loads((artifacts_dir() / name / "manifest.json").read_text())["compile"]["registers"]}  # fmt: skip
    record(entry)
    assert not ck.failures, "\n".join(ck.failures)


@pytest.mark.parametrize("name", MLA_BENCH_CASES)
def test_bench_mla_decode_step(name):
    """The whole absorbed MLA decode of one layer (latent + cache write, q absorb, chunked decode, merge +
    W_UV) at K3's dims over the full cache; correctness checked as the op cases, then timed."""
    case, mk, weights, ck = run_case(name, steps=1)
    graph = captured_step(mk)
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    n = 20
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    m = case.meta
    kv_bytes = m["max_len"] * (m["rank"] + m["rope"]) * 2
    weight_bytes = weights["kv_b"].numel() * 2
    us = start.elapsed_time(end) * 1000 / n
    record({"case": name, "worst": ck.worst, "failures": ck.failures, "us_per_step": us, "kv_cache_bytes": kv_bytes,
            "kv_b_bytes": weight_bytes, "registers": json.loads((artifacts_dir() / name / "manifest.json").read_text())["compile"]["registers"]})
    assert not ck.failures, "\n".join(ck.failures)
