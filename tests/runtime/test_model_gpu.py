"""The WHOLE decode step as ONE megakernel launch per step (docs/megakernel.md "Whole-model results").

Artifacts are prebuilt on a CPU machine (`python tests/runtime/build_model_artifacts.py` -> artifacts_dev/
model_<name>_b<batch>, max_context 128) and run here with random bf16 weights (`random_weights`, clear
router margins), 64 greedy steps per case, batch 1 and 4, requests at staggered positions (3·b + t),
teacher-forced with the bf16 reference's greedy tokens so both see the same inputs at every step:
- exactly one kernel launch per step (the launch wrapper counts; torch.profiler lists every kernel);
- the kernel's token = the bf16 reference DecodeStep's greedy token at every step whose reference
  top-1 / top-2 logit gap is >= NEAR_TIE (logit units); steps below it are reported, not asserted;
- logits ||d|| / ||ref|| <= LOGIT_TOL against the bf16 reference (float32 reference reported too);
- the experts the kernel's router chose (read from the arena) = the bf16 reference's wherever the
  reference's top-k selection margin (k-th minus (k+1)-th biased score) is >= ROUTER_MARGIN.
Results go to $K3MK_RESULTS (JSON) when set.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "artifacts_dev"
STEPS = 64
MAX_CONTEXT = 128
NEAR_TIE = 0.05
LOGIT_TOL = 5e-2
ROUTER_MARGIN = 1e-2

pytestmark = pytest.mark.gpu
CASES = [("k3-tiny", 1), ("k3-tiny", 4), ("kl", 1), ("kl", 4), ("k3-tiny", 16), ("kl", 16)]
RESULTS: dict = {}


def kimi_linear_small():
    """A small Kimi-Linear-shaped config: 3 KDA + 1 MLA layer, hidden 256, 8 experts (top 2), bf16 experts."""
    import dataclasses

    from k3mk.compiler.config import load_config

    c = load_config("kimi-linear-48b-a3b")
    return c.replace(
        hidden_size=256, num_layers=4, vocab_size=2048, layer_kinds=("kda", "kda", "kda", "mla"), dense_intermediate_size=512,
        kda=dataclasses.replace(c.kda, num_heads=2, head_dim=64),
        mla=dataclasses.replace(c.mla, num_heads=2, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32),
        moe=dataclasses.replace(c.moe, num_experts=8, top_k=2, intermediate_size=128, routed_scaling_factor=2.446),
    )  # fmt: skip


def config_of(name: str):
    from k3mk.compiler.config import load_config

    return kimi_linear_small() if name == "kl" else load_config(name)


def _recording_step(config, weights, dtype):
    """The reference DecodeStep, recording each MoE layer's router ids and selection margin."""
    from k3mk.compiler.generate import build_decode_step
    from k3mk.compiler.ops import k3mk

    step = build_decode_step(config, weights, dtype)
    step.routed = []
    inner = step._moe

    def moe(i, x):
        moe_cfg, p = config.moe, f"model.layers.{i}.block_sparse_moe"
        logits = k3mk.linear(x, step.w(f"{p}.gate.weight"), True)
        ids, _ = k3mk.router_topk(logits, step.w(f"{p}.gate.e_score_correction_bias"), moe_cfg.top_k, moe_cfg.renormalize,
                                  moe_cfg.routed_scaling_factor)  # fmt: skip
        score = torch.sigmoid(logits.float()) + step.w(f"{p}.gate.e_score_correction_bias").float()
        top = score.topk(moe_cfg.top_k + 1, dim=-1).values
        step.routed.append((ids.clone(), (top[:, -2] - top[:, -1]).clone()))
        return inner(i, x)

    step._moe = moe
    return step


def _router_id_views(mk):
    """Arena views of each MoE layer's router ids in Megakernel `mk` (task order = layer order), None where
    the arena reuses the bytes later in the step (the ids are then overwritten before we can read them)."""
    from k3mk.ir.task_table import TaskTable

    table = TaskTable.decode(mk.manifest.read_file("task_table"))
    routers = {}  # one per router: a router GEMV's tiles all name its ids (any of their labels orders the layers)
    for tasks in table.lists:
        for t in tasks:
            if table.writes_expert_ids(t):
                routers[t.operands["ids"]] = (int(t.label.split()[0][1:]), t.operands["ids"], table.variants[t.opcode].params)
    views = []
    for _, offset, p in sorted(routers.values()):
        nbytes = p.batch * p.top_k * 4
        overlapping = [b for b in table.buffers if b.offset < offset + nbytes and offset < b.offset + b.nbytes]
        ok = len(overlapping) == 1
        views.append(mk.arena[offset : offset + nbytes].view(torch.int32).view(p.batch, p.top_k) if ok else None)
    return views


def artifact_or_skip(name: str, batch: int) -> Path:
    """The prebuilt whole-model artifact; skips without CUDA or when it was not built."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    art = ARTIFACTS / f"model_{name}_b{batch}"
    if not (art / "manifest.json").exists():
        pytest.skip(f"{art} not built (tests/runtime/build_model_artifacts.py)")
    return art


def run_acceptance(config, batch, weights, model_step, id_views, launches_per_step: int) -> dict:
    """STEPS greedy steps of `model_step(tokens, positions) -> (next_tokens [batch], logits [batch, vocab])`
    teacher-forced with the bf16 reference's tokens (module docstring), `launches_per_step` kernel launches
    each; then the free-running step time and the kernels torch.profiler sees in 3 steps. The record."""
    from k3mk.ir import semantics
    from k3mk.runtime import megakernel as mk_module

    dev = torch.device("cuda")
    weights32 = {k: (v.float() if v.dtype == torch.bfloat16 else v) for k, v in weights.items()}
    ref = _recording_step(config, weights, torch.bfloat16)
    ref32 = _recording_step(config, weights32, torch.float32)
    state = ref.new_state(batch, MAX_CONTEXT, device=dev)
    state32 = ref32.new_state(batch, MAX_CONTEXT, device=dev)

    launches = []
    real_launch = mk_module.launch_cooperative

    def counting_launch(*a, **k):
        launches.append(1)
        return real_launch(*a, **k)

    mk_module.launch_cooperative = counting_launch
    gen = torch.Generator().manual_seed(batch)
    tokens = torch.randint(0, config.vocab_size, (batch,), generator=gen).to(dev)
    pos0 = torch.arange(batch, device=dev) * 3
    rec = {"steps": STEPS, "token_mismatch_clear": 0, "token_mismatch_near_tie": 0, "near_tie_steps": 0,
           "first_near_tie": None, "logit_rel_bf16": [], "logit_rel_f32": [], "ref_bf16_vs_f32": [],
           "router_checked": 0, "router_mismatch": 0, "router_unclear": 0, "router_layers_unreadable": 0}  # fmt: skip
    try:
        with torch.no_grad():
            for t in range(STEPS):
                positions = pos0 + t
                ref.routed.clear()
                ref32.routed.clear()
                logits, state = ref(tokens, positions, state)
                logits32, state32 = ref32(tokens, positions, state32)
                before = len(launches)
                next_tokens, got = model_step(tokens, positions)
                assert len(launches) - before == launches_per_step
                torch.cuda.synchronize()
                got = got.float().clone().to(dev)
                ref_f, ref32_f = logits.float(), logits32.float()
                rec["logit_rel_bf16"].append(float((got - ref_f).norm() / ref_f.norm()))
                rec["logit_rel_f32"].append(float((got - ref32_f).norm() / ref32_f.norm()))
                rec["ref_bf16_vs_f32"].append(float((ref_f - ref32_f).norm() / ref32_f.norm()))
                top2 = ref_f.topk(2, dim=-1).values
                gap = top2[:, 0] - top2[:, 1]
                want = semantics.argmax(logits).to(torch.int32)
                for b in range(batch):
                    same = int(next_tokens[b]) == int(want[b])
                    if gap[b] < NEAR_TIE:
                        rec["near_tie_steps"] += 1
                        rec["first_near_tie"] = t if rec["first_near_tie"] is None else rec["first_near_tie"]
                        rec["token_mismatch_near_tie"] += not same
                    else:
                        rec["token_mismatch_clear"] += not same
                for layer, (ids, margin) in enumerate(ref.routed):
                    view = id_views[layer] if layer < len(id_views) else None
                    if view is None:
                        rec["router_layers_unreadable"] += 1
                        continue
                    for b in range(batch):
                        if margin[b] < ROUTER_MARGIN:
                            rec["router_unclear"] += 1
                            continue
                        rec["router_checked"] += 1
                        rec["router_mismatch"] += sorted(view[b].tolist()) != sorted(ids[b].tolist())
                tokens = want.long()
        # step time: free-running (the kernel's own int32 tokens fed back)
        tok = next_tokens.clone()
        p32 = (pos0 + STEPS).to(torch.int32)
        for _ in range(5):
            tok.copy_(model_step(tok, p32)[0])
        torch.cuda.synchronize()
        n = 50
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            tok.copy_(model_step(tok, p32)[0])
        end.record()
        torch.cuda.synchronize()
        rec["step_us"] = start.elapsed_time(end) * 1e3 / n
        try:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    model_step(tok, p32)
                for device in range(torch.cuda.device_count()):  # every rank's kernels, under tensor parallelism
                    torch.cuda.synchronize(device)
            kernels = [e.name for e in prof.events() if e.device_type.name == "CUDA" and "memcpy" not in e.name.lower()
                       and "memset" not in e.name.lower()]  # fmt: skip
            rec["profiler_kernels_3_steps"] = sorted(set(kernels)), len(kernels)
        except Exception as e:  # noqa: BLE001 (CUPTI may be unavailable)
            rec["profiler_kernels_3_steps"] = f"profiler failed: {e}"
    finally:
        mk_module.launch_cooperative = real_launch
    rec["launches"] = len(launches)
    rec["max_logit_rel_bf16"] = max(rec["logit_rel_bf16"])
    rec["max_logit_rel_f32"] = max(rec["logit_rel_f32"])
    rec["max_ref_bf16_vs_f32"] = max(rec["ref_bf16_vs_f32"])
    return rec


def report_and_check(key: str, rec: dict, launches_per_step: int) -> None:
    """Record the case (and write $K3MK_RESULTS), then the acceptance asserts."""
    RESULTS[key] = rec
    out = os.environ.get("K3MK_RESULTS")
    if out:
        Path(out).write_text(json.dumps(RESULTS, indent=1))
    print(key, {k: v for k, v in rec.items() if not isinstance(v, list)}, file=sys.stderr)
    assert rec["token_mismatch_clear"] == 0
    assert rec["router_mismatch"] == 0
    assert rec["max_logit_rel_bf16"] <= LOGIT_TOL
    if isinstance(rec["profiler_kernels_3_steps"], tuple):
        names, count = rec["profiler_kernels_3_steps"]
        assert count == 3 * launches_per_step and all("k3mk_megakernel" in n for n in names), names


@pytest.mark.parametrize("name,batch", CASES)
def test_whole_model_one_launch_per_step(name, batch):
    art = artifact_or_skip(name, batch)
    from k3mk.compiler.random_weights import random_weights
    from k3mk.runtime.model import DecodeModel

    config = config_of(name)
    weights = random_weights(config, 0, torch.bfloat16, device=torch.device("cuda"))
    model = DecodeModel(art, weights)
    assert model.batch == batch and model.max_context == MAX_CONTEXT
    # exactly the one launch (the per-request finite check after it is test_nonfinite_gpu.py's)
    step = lambda tokens, positions: model.step(tokens, positions, check_finite=False)  # noqa: E731
    rec = run_acceptance(config, batch, weights, step, _router_id_views(model.mk), launches_per_step=1)
    report_and_check(f"{name}_b{batch}", rec, launches_per_step=1)
