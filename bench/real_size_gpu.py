"""A FULL-size decode step (TP1, any batch and max context: kimi-linear-48b-a3b, k3-proxy-16l, ...; the
model is the artifact's) as one megakernel on the GPU against the bf16 reference DecodeStep, both on the
SAME random weight tensors generated on the GPU (`random_weights(..., device="cuda")`, ~98 GB for Kimi
Linear 48B; `build_decode_step` assigns them, DecodeModel binds them).

    python bench/real_size_gpu.py ARTIFACT_DIR [OUT_JSON]

Teacher-forced with the reference's greedy tokens for 64 steps: 32 at the start of the context and 32
at its end (the cache rows between stay zero in both). Every request (batch row) starts from its own
token, and row b runs `b` positions behind row 0, so the requests cover different cache lengths in the
same step. Compared per row: tokens (where the reference's top-1 / top-2 gap is clear: above 0.05 AND
above 2 bf16 ULPs at the top logit, since each of the two bf16-rounded logits may sit one ULP off in
a second bf16 computation), logits
||d|| / ||ref|| and the experts each router_topk task chose (read from the arena) against the
reference's wherever its selection margin is >= 0.01. Then step times: the kernel (50 free-running
steps) and the reference (10 steps), near the start and the end of the context.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch

ROUTER_MARGIN = 1e-2
HALF = 32  # teacher-forced steps at each end of the context


def main(art: str, out: str | None) -> None:
    from k3mk.compiler.generate import clear_mask
    from k3mk.bench.model_configs import artifact_config
    from k3mk.compiler.generate import build_decode_step
    from k3mk.compiler.ops import k3mk
    from k3mk.compiler.random_weights import random_weights
    from k3mk.ir import semantics
    from k3mk.ir.task_table import TaskTable
    from k3mk.runtime.model import DecodeModel

    rec: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    manifest = json.loads((Path(art) / "manifest.json").read_text())
    batch, ctx = manifest["max_tokens"], manifest["max_context"]
    if ctx < 2 * HALF + batch:
        raise SystemExit(f"{art}: max_context {ctx} is too short for {2 * HALF} steps at batch {batch}")
    rec.update(batch=batch, max_context=ctx)
    config = artifact_config(manifest, str(art))
    rec["model"] = manifest["model"]
    dev = torch.device("cuda")
    t0 = time.perf_counter()
    weights = random_weights(config, 0, torch.bfloat16, device=dev)
    torch.cuda.synchronize()
    rec["weights_s"] = time.perf_counter() - t0
    rec["weights_gb"] = sum(w.numel() * w.element_size() for w in weights.values()) / 1e9
    ref = build_decode_step(config, weights, torch.bfloat16)
    routed: list = []
    inner = ref._moe

    def moe(i, x):  # record each MoE layer's ids and top-k selection margin
        m, p = config.moe, f"model.layers.{i}.block_sparse_moe"
        logits = k3mk.linear(x, ref.w(f"{p}.gate.weight"), True)
        ids, _ = k3mk.router_topk(logits, ref.w(f"{p}.gate.e_score_correction_bias"), m.top_k, m.renormalize, m.routed_scaling_factor)
        score = torch.sigmoid(logits.float()) + ref.w(f"{p}.gate.e_score_correction_bias").float()
        top = score.topk(m.top_k + 1, dim=-1).values
        routed.append((ids.clone(), (top[:, -2] - top[:, -1]).clone()))
        return inner(i, x)

    before = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    model = DecodeModel(art, weights)
    rec["load_s"] = time.perf_counter() - t0
    # binding is by pointer: what the model adds is its state, arena and tables, never weight bytes
    rec["model_added_gb"] = (torch.cuda.memory_allocated() - before) / 1e9
    rec["model_states_gb"] = sum(t.numel() * t.element_size() for t in model.states.values()) / 1e9
    rec["weights_shared"] = all(model.mk._weights[n].data_ptr() == weights[n].data_ptr() for n in model.mk._weights)
    table = TaskTable.decode(model.mk.manifest.read_file("task_table"))
    # one per router (a router GEMV's tiles all name its ids; any of their labels orders the layers)
    routers = sorted({t.operands["ids"]: (int(t.label.split()[0][1:]), t.operands["ids"], table.variants[t.opcode].params)
                      for ts in table.lists for t in ts if table.writes_expert_ids(t)}.values())  # fmt: skip
    id_views = [model.mk.arena[o : o + p.batch * p.top_k * 4].view(torch.int32).view(p.batch, p.top_k) for _, o, p in routers]
    rec["routers"] = len(id_views)
    state = ref.new_state(batch, ctx, device=dev)
    rec["gpu_mem_gb_after_setup"] = torch.cuda.memory_allocated() / 1e9
    tokens = torch.tensor([1234 + 977 * b for b in range(batch)], device=dev) % config.vocab_size
    lag = torch.arange(batch, device=dev)  # row b runs b positions behind row 0
    steps = [*range(batch - 1, batch - 1 + HALF), *range(ctx - HALF, ctx)]
    rec.update(steps=len(steps), token_mismatch_clear=0, token_mismatch_near_tie=0, near_tie_steps=0, logit_rel=[], gaps=[], mismatches=[],
               router_checked=0, router_mismatch=0, router_unclear=0)  # fmt: skip
    ref._moe = moe
    with torch.no_grad():
        for pos in steps:
            positions = pos - lag
            routed.clear()
            logits, state = ref(tokens, positions, state)
            next_tokens, got = model.step(tokens, positions)
            torch.cuda.synchronize()
            want = semantics.argmax(logits).to(torch.int32)
            top2 = logits.float().topk(2, dim=-1).values
            clear_rows = clear_mask(logits)
            for b in range(batch):
                got_b, ref_b = got[b].float(), logits[b].float()
                rec["logit_rel"].append(float((got_b - ref_b).norm() / ref_b.norm()))
                gap = float(top2[b, 0] - top2[b, 1])
                rec["gaps"].append(gap)
                same = int(next_tokens[b]) == int(want[b])
                ulp = 2.0 ** (math.floor(math.log2(abs(float(top2[b, 0])))) - 7)  # bf16 spacing at the top logit
                clear = bool(clear_rows[b])
                if not same:  # what the flip looked like: the reference's gap vs the kernel's error on those logits
                    t1, t2 = int(want[b]), int(next_tokens[b])
                    rec["mismatches"].append({"step": (len(rec["gaps"]) - 1) // batch, "row": b, "position": int(positions[b]),
                                              "ref_gap": gap, "ref_gap_bf16_ulps": gap / ulp,
                                              "ref": [float(ref_b[t1]), float(ref_b[t2])], "kernel": [float(got_b[t1]), float(got_b[t2])]})  # fmt: skip
                if not clear:
                    rec["near_tie_steps"] += 1
                    rec["token_mismatch_near_tie"] += not same
                else:
                    rec["token_mismatch_clear"] += not same
                for layer, (ids, margin) in enumerate(routed):
                    if margin[b] < ROUTER_MARGIN:
                        rec["router_unclear"] += 1
                        continue
                    rec["router_checked"] += 1
                    rec["router_mismatch"] += sorted(id_views[layer][b].tolist()) != sorted(ids[b].tolist())
            tokens = want.long()
        ref._moe = inner
        for pos in (HALF + batch, ctx - 8):
            p32 = (pos - lag).to(torch.int32)
            tok = next_tokens.clone()
            for _ in range(3):
                tok.copy_(model.step(tok, p32, check_finite=False)[0])
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(50):
                tok.copy_(model.step(tok, p32, check_finite=False)[0])  # the launch alone, as before the check existed
            end.record()
            torch.cuda.synchronize()
            rec[f"kernel_step_us_pos{pos}"] = start.elapsed_time(end) * 1e3 / 50
            t64 = tok.long()
            p64 = p32.long()
            for _ in range(2):
                ref(t64, p64, state)
            torch.cuda.synchronize()
            start.record()
            for _ in range(10):
                ref(t64, p64, state)
            end.record()
            torch.cuda.synchronize()
            rec[f"ref_step_us_pos{pos}"] = start.elapsed_time(end) * 1e3 / 10
    rec["max_logit_rel"] = max(rec["logit_rel"])
    rec["mean_logit_rel"] = sum(rec["logit_rel"]) / len(rec["logit_rel"])
    print(json.dumps({k: v for k, v in rec.items() if not isinstance(v, list)}, indent=1))
    print("logit_rel", [f"{x:.2e}" for x in rec["logit_rel"]])
    print("gaps", [f"{x:.3f}" for x in rec["gaps"]])
    print("mismatches", rec["mismatches"])
    if out:
        with open(out, "w") as f:
            json.dump(rec, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
