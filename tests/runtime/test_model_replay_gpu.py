"""The whole-model decode step captured in a CUDA graph and replayed 1,000 times equals the eager launch
step by step (docs/megakernel.md "Sanitizers and graph replay").

Two DecodeModel instances of the same artifact (artifacts_dev/model_k3-tiny_b<batch>, built by
tests/runtime/build_model_artifacts.py) share the same random bf16 weights and start from identical
(zeroed) decode states; one is launched eagerly, the other's `mk.step()` is captured once in a
torch.cuda.CUDAGraph and replayed. Both get the same token ids / positions at every step (the eager
model's greedy tokens fed back; positions 3·b + t mod max_context, so 1,000 steps wrap the MLA cache
while the KDA state keeps accumulating). Asserted: next tokens and logits bit-identical at every step
(no drift), every decode state tensor equal at the end, the epoch advanced by one per replay, and
torch.profiler lists exactly one kernel (k3mk_megakernel*) per replayed step.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_model_gpu import artifact_or_skip, config_of  # noqa: E402

pytestmark = pytest.mark.gpu
STEPS = 1000


# The full-size cases run where their artifacts were built (k3mk compile --model kimi-linear-48b-a3b --out
# artifacts_dev/model_kimi-linear-48b-a3b_b1, likewise k3-proxy-16l and batch 4, where the routed experts are grouped
# by expert at run time): ~98 / ~41 GB of weights on the GPU, shared by both models.
@pytest.mark.parametrize("name,batch", [("k3-tiny", 1), ("k3-tiny", 4), ("kimi-linear-48b-a3b", 1), ("k3-proxy-16l", 1),
                                        ("kimi-linear-48b-a3b", 4), ("k3-proxy-16l", 4)])  # fmt: skip
def test_whole_model_graph_replay_equals_eager(name, batch):
    art = artifact_or_skip(name, batch)
    from k3mk.compiler.random_weights import random_weights
    from k3mk.runtime.model import DecodeModel

    config = config_of(name)
    dev = torch.device("cuda")
    weights = random_weights(config, 0, torch.bfloat16, device=dev)
    eager = DecodeModel(art, weights)
    replay = DecodeModel(art, weights)
    ctx = eager.max_context
    for n in eager.states:
        assert torch.equal(eager.states[n], replay.states[n])

    gen = torch.Generator().manual_seed(batch)
    tok = torch.randint(0, config.vocab_size, (batch,), generator=gen).to(torch.int32).to(dev)
    pos0 = (torch.arange(batch, device=dev) * 3).to(torch.int32)
    # static graph inputs: copied into the replay model's arena by D2D copies outside the graph
    r_tok, r_pos = replay.buffer("token_ids"), replay.buffer("positions")
    r_next, r_logits = replay.buffer("next_tokens"), replay.buffer("logits")

    with torch.no_grad():
        # step 0 eagerly on both (also the warm-up torch recommends before capture, on a side stream)
        e_next, e_logits = eager.step(tok, pos0)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            r_tok.copy_(tok)
            r_pos.copy_(pos0)
            replay.mk.step()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        assert torch.equal(e_next, r_next) and torch.equal(e_logits, r_logits), "step 0 (both eager) differs"
        tok = e_next.clone()

        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replay.mk.step()
        torch.cuda.synchronize()
        epoch0 = replay.mk.epoch

        tok_bad = logit_bad = 0
        first_bad = None
        for t in range(1, STEPS + 1):
            pos = (pos0 + t) % ctx
            e_next, e_logits = eager.step(tok, pos)
            r_tok.copy_(tok)
            r_pos.copy_(pos)
            graph.replay()
            same_tok = torch.equal(e_next, r_next)
            same_logits = torch.equal(e_logits, r_logits)
            tok_bad += not same_tok
            logit_bad += not same_logits
            if first_bad is None and not (same_tok and same_logits):
                first_bad = t
            tok = e_next.clone()
        torch.cuda.synchronize()
        assert replay.mk.epoch == epoch0 + STEPS
        state_bad = [n for n in eager.states if not torch.equal(eager.states[n], replay.states[n])]
        finite = bool(torch.isfinite(e_logits.float()).all())

        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()
        kernels = [e.name for e in prof.events() if e.device_type.name == "CUDA" and "memcpy" not in e.name.lower()
                   and "memset" not in e.name.lower()]  # fmt: skip

        n = 200
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        replay_us = start.elapsed_time(end) * 1e3 / n

    print(f"{name} b{batch}: {STEPS} graph replays vs eager: token mismatches {tok_bad}, logits mismatches {logit_bad}, "
          f"first {first_bad}, states differing {state_bad}, logits finite {finite}; profiler over 3 replays: "
          f"{len(kernels)} kernels {sorted(set(kernels))}; graph replay {replay_us:.1f} us/step", file=sys.stderr)  # fmt: skip
    assert tok_bad == 0 and logit_bad == 0, (tok_bad, logit_bad, first_bad)
    assert not state_bad, state_bad
    assert len(kernels) == 3 and all("k3mk_megakernel" in k for k in kernels), kernels
