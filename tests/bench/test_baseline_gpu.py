"""GPU tests of the baseline decode step (bench/baseline.py, bench/baseline_kernels.py) against the
reference, with fresh random inputs (tests/bench/kernel_checks.py holds the checks and tolerances):

- every replacement op at small sizes (as the CPU interpreter test, here compiled) and at full width
  (Kimi Linear 48B and K3 dims, batch 1, 8 and 16): Triton kernels, the absorbed MLA, fla's fused recurrent
  KDA (both gate forms) and gated norm;
- the MoE, MLA and KDA layers of k3-tiny and kimi-linear-tiny against the reference's;
- the whole step on k3-tiny / kimi-linear-tiny: greedy tokens equal to the reference's wherever its
  top-1 / top-2 gap >= 0.05, for 8 teacher-forced steps; and the step captured in a CUDA graph replays
  like eager steps (same tokens, logits and states within 1e-3; bit-identity printed);
- the expert kernel's bandwidth at K3 size (printed, not asserted).

    python -m pytest -m gpu tests/bench -q -s
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import kernel_checks as C  # noqa: E402

from k3mk.ir import semantics  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
needs_fla = pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="needs fla-core (carried as a wheel: BENCHMARKS.md)")
BF16 = torch.bfloat16
NEAR_TIE = 0.05


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def test_small_cases():
    print(C.small_cases("cuda"))


@pytest.mark.parametrize("batch", [1, 8, 16])
def test_elementwise_kernels_full_width(batch):
    gen = _gen(batch)
    for dim in (7168, 2304, 1536, 512):
        C.check_rmsnorm(gen, BF16, rows=batch, dim=dim)
    C.check_act_mul(gen, BF16, shape=(batch, 6144))
    C.check_attn_res(gen, BF16, batch=batch, sources=9, dim=7168)
    C.check_kda_conv(gen, BF16, batch=batch, p=12288)
    C.check_kda_conv(gen, BF16, batch=batch, p=4096)


@pytest.mark.parametrize("experts,top_k,batch", [(64, 16, 8), (256, 8, 8), (896, 16, 4), (256, 8, 1), (896, 16, 16)])
def test_router_full_width(experts, top_k, batch):
    C.check_router_topk(_gen(experts), batch=batch, experts=experts, top_k=top_k)


@pytest.mark.parametrize("batch", [1, 8, 16])
@pytest.mark.parametrize("form", ["kimi-linear bf16 silu", "k3 mxfp4 situ", "k3 bf16 situ"])
def test_experts_full_width(form, batch):
    """The real expert shapes (fewer experts: the widths are what the kernel tiles)."""
    if form.startswith("kimi-linear"):
        shape = dict(experts=12, top_k=8, inter=1024, hidden=2304)
    else:
        shape = dict(experts=20, top_k=16, inter=3072, hidden=3584)
    print(C.check_experts(_gen(batch), BF16, batch=batch, mxfp4="mxfp4" in form, activation=form.split()[-1], **shape))


@pytest.mark.parametrize("heads,rows,window,batch", [(96, 8192, 8192, 2), (32, 4096, 1024, 8)])
def test_absorbed_mla_full_width(heads, rows, window, batch):
    print(C.check_mla_absorbed(_gen(heads), BF16, batch=batch, heads=heads, nope=128, rope=64, v_dim=128, rank=512, rows=rows, window=window))


@needs_fla
@pytest.mark.parametrize("heads,head_dim,lower_bound,batch", [(96, 128, -5.0, 1), (96, 128, -5.0, 8), (32, 128, None, 8), (4, 64, None, 3)])
def test_fla_kda_recurrence(heads, head_dim, lower_bound, batch):
    print(C.check_kda_recurrence(_gen(heads), batch=batch, heads=heads, head_dim=head_dim, lower_bound=lower_bound))


@needs_fla
@pytest.mark.parametrize("heads,head_dim", [(96, 128), (4, 64)])
def test_fla_gated_rmsnorm(heads, head_dim):
    print(C.check_gated_rmsnorm(_gen(heads), batch=8, heads=heads, head_dim=head_dim))


@needs_fla
@pytest.mark.parametrize("name", ["k3-tiny", "kimi-linear-tiny"])
def test_tiny_layers(name):
    gen = _gen(11)
    print(C.check_moe_layer(gen, name, batch=4), C.check_mla_layer(gen, name, batch=4), C.check_kda_layer(gen, name, batch=4))


def _step_setup(name: str, batch: int, rows: int = 40):
    config, weights, reference, baseline = C.model_with_weights(name, "cuda", BF16)
    state = C.random_state(_gen(batch), config, batch, rows, BF16)
    baseline.attention_window = rows
    return config, reference, baseline, state


@needs_fla
@pytest.mark.parametrize("name,batch", [("k3-tiny", 1), ("k3-tiny", 4), ("kimi-linear-tiny", 1), ("kimi-linear-tiny", 4)])
def test_step_matches_reference(name, batch):
    config, reference, baseline, state = _step_setup(name, batch)
    own = {n: t.clone() for n, t in state.items()}
    tokens = torch.randint(config.vocab_size, (batch,), generator=_gen(3), device="cuda")
    clear = mismatches = 0
    worst = 0.0
    with torch.no_grad():
        for t in range(8):
            positions = torch.tensor([20 + t + 2 * b for b in range(batch)], device="cuda")
            ref_logits, state = reference(tokens, positions, state)
            logits, new = baseline(tokens, positions, own)
            assert all(new[n] is own[n] for n in own), "the baseline must update its state in place"
            top = ref_logits.float().topk(2, dim=-1).values
            ok = (top[:, 0] - top[:, 1]) >= NEAR_TIE
            clear += int(ok.sum())
            mismatches += int(((semantics.argmax(logits) != semantics.argmax(ref_logits)) & ok).sum())
            worst = max(worst, C.rel(logits, ref_logits))
            tokens = semantics.argmax(ref_logits).long()
    print(f"{name} b{batch}: {mismatches} of {clear} clear tokens differ; logits rel max {worst:.2e}")
    assert clear > 0 and mismatches == 0
    assert worst <= C.LAYER_TOL


@needs_fla
def test_graph_replay_equals_eager():
    from k3mk.bench.megakernel_framework import graph_of

    batch, steps = 4, 6
    config, _, baseline, state = _step_setup("k3-tiny", batch)
    eager_state, graph_state = ({n: t.clone() for n, t in state.items()} for _ in range(2))
    gen = _gen(9)
    tokens = torch.randint(config.vocab_size, (steps + 1, batch), generator=gen, device="cuda")
    positions = torch.arange(steps + 1, device="cuda").view(-1, 1) + torch.arange(batch, device="cuda") + 10
    with torch.no_grad():
        eager = [baseline(tokens[t], positions[t], eager_state)[0].clone() for t in range(steps + 1)]
        tok, pos = tokens[0].clone(), positions[0].clone()
        out = {}
        graph = graph_of(lambda: out.update(logits=baseline(tok, pos, graph_state)[0]))  # runs step 0 once, then captures
        exact = True
        for t in range(1, steps + 1):
            tok.copy_(tokens[t])
            pos.copy_(positions[t])
            graph.replay()
            exact &= torch.equal(out["logits"], eager[t])
            assert torch.equal(semantics.argmax(out["logits"]), semantics.argmax(eager[t])), f"replay {t}: other tokens than eager"
            assert C.rel(out["logits"], eager[t]) <= 1e-3, f"replay {t}: logits differ from the eager step"
    exact &= all(torch.equal(graph_state[n], eager_state[n]) for n in state)
    print(f"graph replays {'bit-identical to' if exact else 'within 1e-3 of'} the eager steps")
    for n in state:
        assert C.rel(graph_state[n], eager_state[n]) <= 1e-3, n


@pytest.mark.parametrize("mxfp4", [False, True])
def test_expert_kernel_bandwidth_k3(mxfp4):
    """K3-size experts at batch 1: 16 experts' w1 + w3 (+ SiTU) then w2, three disjoint expert sets in turn
    so no run finds the previous one's weights in the L2. Printed: TB/s of the weight bytes."""
    from k3mk.bench import baseline_kernels as K

    gen = _gen(21)
    experts, top_k, inter, hidden = 48, 16, 3072, 3584
    (w1, s1), _ = C.random_experts(gen, experts, inter, hidden, mxfp4, BF16)
    (w3, s3), _ = C.random_experts(gen, experts, inter, hidden, mxfp4, BF16)
    (w2, s2), _ = C.random_experts(gen, experts, hidden, inter, mxfp4, BF16)
    x = C.randn(gen, 1, hidden, dtype=BF16)
    sets = [K.group_by_expert(torch.arange(i * top_k, (i + 1) * top_k, device="cuda", dtype=torch.int32).view(1, top_k)) for i in range(3)]
    a = torch.empty(top_k, inter, dtype=BF16, device="cuda").normal_(generator=gen)

    def nbytes(*tensors):  # one expert's bytes of each tensor, times the experts a run reads
        return top_k * sum(t[0].numel() * t.element_size() for t in tensors if t is not None)

    for name, run, moved in (("w1+w3+situ", lambda g: K.expert_gemv(x, g, top_k, w1, s1, w3, s3, "situ", 4.0, 25.0), nbytes(w1, s1, w3, s3)),
                             ("w2", lambda g: K.expert_gemv(a, g, top_k, w2, s2), nbytes(w2, s2))):  # fmt: skip
        for g in sets:
            run(g)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(30):
            run(sets[i % 3])
        end.record()
        end.synchronize()
        us = start.elapsed_time(end) * 1e3 / 30
        print(f"expert_gemv {'mxfp4' if mxfp4 else 'bf16'} {name}: {us:.1f} us, {moved / us / 1e6:.2f} TB/s")
