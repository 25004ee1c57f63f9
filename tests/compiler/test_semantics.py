"""Small direct tests of single ops of k3mk.ir.semantics (through the torch.ops.k3mk custom ops), each
against numbers worked out by hand from docs/kimi_k3_decode_spec.md. The whole-step checks live in
test_reference_k3.py; the MXFP4 byte format in test_mxfp4.py."""

from __future__ import annotations

import math

import pytest
import torch

from k3mk.compiler.ops import k3mk

F32 = torch.float32


def test_kda_conv_state_layout_and_tap_order():
    """Spec 3.2 / 8: state [B, W-1, 3P] holds the last W-1 raw inputs of q|k|v oldest first, and
    weight[:, 0, -1] multiplies the NEW token; output silu(conv) in the activation dtype."""
    P, W = 2, 4
    state = torch.tensor([[[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [10.0, 20.0, 30.0, 40.0, 50.0, 60.0], [100.0, 200.0, 300.0, 400.0, 500.0, 600.0]]])
    q, k, v = torch.tensor([[0.5, 0.25]]), torch.tensor([[-1.0, 2.0]]), torch.tensor([[7.0, 8.0]])
    taps = torch.tensor([1e-3, 1e-2, 1e-1, 1.0])  # oldest ... newest
    w = taps.expand(P, 1, W).contiguous()
    yq, yk, yv, new_state = k3mk.kda_conv(q, k, v, state, w, w, w)
    x = torch.cat([q, k, v], -1)[0]
    pre = 1e-3 * state[0, 0] + 1e-2 * state[0, 1] + 1e-1 * state[0, 2] + x
    torch.testing.assert_close(torch.cat([yq, yk, yv], -1)[0], torch.nn.functional.silu(pre))
    torch.testing.assert_close(new_state[0], torch.stack([state[0, 1], state[0, 2], x]))  # shift left, append


def test_kda_conv_batch_one_outputs_do_not_alias():
    """Regression: at B == 1 the q/k/v slices of one buffer are contiguous views, and a custom op's
    outputs may not alias each other (torch raised in eager mode before the fix)."""
    P = 4
    w = torch.randn(P, 1, 4)
    state = torch.randn(1, 3, 3 * P)
    outs = k3mk.kda_conv(torch.randn(1, P), torch.randn(1, P), torch.randn(1, P), state, w, w, w)
    ptrs = {t.untyped_storage().data_ptr() for t in outs}
    assert len(ptrs) == 4 and state.untyped_storage().data_ptr() not in ptrs


def test_kda_gate_forms():
    """Spec 3.2: K3 g = lb * sigmoid(exp(A_log[h]) * (f + dt_bias)); Kimi Linear g = -exp(A_log[h]) *
    softplus(f + dt_bias). A_log is one value per head (spec open question 3, majority reading)."""
    H, D = 2, 3
    f = torch.tensor([[0.1, -0.2, 0.3, 1.0, 2.0, -3.0]])
    dt = torch.tensor([0.5, 0.5, 0.5, -1.0, -1.0, -1.0])
    a_log = torch.tensor([0.0, math.log(2.0)])
    z = (f + dt).view(1, H, D)
    a = torch.tensor([1.0, 2.0]).view(H, 1)
    torch.testing.assert_close(k3mk.kda_gate(f, a_log, dt, H, -5.0), -5.0 * torch.sigmoid(a * z))
    torch.testing.assert_close(k3mk.kda_gate(f, a_log, dt, H, None), -a * torch.nn.functional.softplus(z))
    assert k3mk.kda_gate(f, a_log, dt, H, -5.0).dtype == F32


def test_kda_recurrence_one_step_by_hand():
    """Spec 3.2 for one head, K = V = 2, from a known state: decay per KEY channel (columns of the
    V x K state), delta rule with the L2-normalized key, o = S q_hat with q scaled by D^-0.5."""
    S0 = torch.tensor([[1.0, 2.0], [3.0, 4.0]])  # [V, K]
    q, k, v = torch.tensor([[3.0, 4.0]]), torch.tensor([[0.0, 2.0]]), torch.tensor([[1.0, -1.0]])
    g = torch.tensor([[[math.log(0.5), 0.0]]])  # key channel 0 halves, channel 1 keeps
    beta_logit = torch.tensor([[0.0]])  # beta 0.5
    o, S = k3mk.kda_recurrence(q, k, v, g, beta_logit, S0[None, None])
    kh = torch.tensor([0.0, 2.0]) / math.sqrt(4.0 + 1e-6)
    qh = torch.tensor([3.0, 4.0]) / math.sqrt(25.0 + 1e-6) * 2**-0.5
    Sd = S0 * torch.tensor([0.5, 1.0])  # columns scaled
    u = 0.5 * (torch.tensor([1.0, -1.0]) - Sd @ kh)
    S_ref = Sd + torch.outer(u, kh)
    torch.testing.assert_close(S[0, 0], S_ref)
    torch.testing.assert_close(o[0], S_ref @ qh)


def test_gated_rmsnorm_order():
    """Spec 3.2: per head, normalize -> times weight -> times sigmoid(gate), all fp32."""
    x = torch.tensor([[1.0, 2.0, 3.0, -4.0]])
    gate = torch.tensor([[0.0, 1.0, -1.0, 2.0]])
    w = torch.tensor([2.0, 0.5])
    y = k3mk.gated_rmsnorm(x, gate, w, 2, 1e-5)
    h0 = torch.tensor([1.0, 2.0]) / math.sqrt(2.5 + 1e-5) * w * torch.sigmoid(torch.tensor([0.0, 1.0]))
    h1 = torch.tensor([3.0, -4.0]) / math.sqrt(12.5 + 1e-5) * w * torch.sigmoid(torch.tensor([-1.0, 2.0]))
    torch.testing.assert_close(y[0], torch.cat([h0, h1]))


def test_rmsnorm_rounds_before_the_gain():
    """Spec 7: KimiRMSNorm = w * (x.float() * rsqrt(mean(x^2) + eps)).to(dtype): in bf16 the normalized
    value is rounded BEFORE the multiply by the gain."""
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    w = (1 + 0.3 * torch.randn(64, generator=torch.Generator().manual_seed(1))).to(torch.bfloat16)
    y = k3mk.rmsnorm(x, w, 1e-5)
    xf = x.float()
    expect = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    assert y.dtype == torch.bfloat16 and torch.equal(y, expect)


def test_attn_res_by_hand():
    """Spec 6: softmax over sources of <RMSNorm(source) (no gain), norm_w * proj_w>, mixing the
    UN-normalized sources; one source is the identity."""
    a = torch.tensor([[3.0, 4.0]])
    b = torch.tensor([[-1.0, 1.0]])
    nw, pw = torch.tensor([1.0, 2.0]), torch.tensor([[0.5, 0.25]])
    q = nw * pw[0]  # [0.5, 0.5]
    ra = a / math.sqrt(12.5 + 1e-5)
    rb = b / math.sqrt(1.0 + 1e-5)
    p = torch.softmax(torch.stack([(ra * q).sum(), (rb * q).sum()]), 0)
    torch.testing.assert_close(k3mk.attn_res([a, b], nw, pw, 1e-5), p[0] * a + p[1] * b)
    torch.testing.assert_close(k3mk.attn_res([a], nw, pw, 1e-5), a)


def test_situ_by_hand():
    """Spec 5.1: beta*tanh(g/beta)*sigmoid(g) * linear_beta*tanh(u/linear_beta); no clamp without linear_beta."""
    g, u = torch.tensor([[2.0, -30.0]]), torch.tensor([[50.0, 1.0]])
    a = 4.0 * torch.tanh(g / 4.0) * torch.sigmoid(g)
    torch.testing.assert_close(k3mk.situ_mul(g, u, 4.0, 25.0), a * 25.0 * torch.tanh(u / 25.0))
    torch.testing.assert_close(k3mk.situ_mul(g, u, 4.0, None), a * u)


def test_mla_latent_and_cache_write():
    """Spec 4.3: cache row = RMSNorm(c_kv) (eps 1e-6) || k_pe untouched; each request's row lands at its
    own position, every other row is unchanged."""
    c = torch.tensor([[3.0, 4.0, 7.0], [1e-3, 1e-3, -2.0]])
    w = torch.tensor([1.0, 2.0])
    row = k3mk.mla_latent(c, w, 2, 1e-6)
    torch.testing.assert_close(row[0], torch.tensor([3.0 / math.sqrt(12.5 + 1e-6), 8.0 / math.sqrt(12.5 + 1e-6), 7.0]))
    torch.testing.assert_close(row[1, :2], torch.tensor([1e-3, 2e-3]) / math.sqrt(1e-6 + 1e-6))
    cache = torch.randn(2, 4, 3)
    new = k3mk.mla_cache_write(cache, row, torch.tensor([2, 0]))
    torch.testing.assert_close(new[0, 2], row[0])
    torch.testing.assert_close(new[1, 0], row[1])
    keep = torch.ones(2, 4, dtype=torch.bool)
    keep[0, 2] = keep[1, 0] = False
    assert torch.equal(new[keep], cache[keep])


def test_mla_attention_masks_positions_and_scale():
    """Spec 4.2: a request at position p attends to rows 0..p only (junk after is ignored), scores scaled
    by (nope + rope)^-0.5 with the rope part from one shared head."""
    H, nope, rope, vd, R = 1, 2, 1, 2, 2
    kv_b = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 0.0], [0.0, 3.0]])  # [H*(nope+v), R]: k_nope = c, v = (2c0, 3c1)
    cache = torch.tensor([[[1.0, 0.0, 0.5], [0.0, 1.0, -1.0], [99.0, 99.0, 99.0]]])
    q = torch.tensor([[1.0, 2.0, 4.0]])
    o = k3mk.mla_attention(q, cache, torch.tensor([1]), kv_b, H, nope, rope, vd, R)
    s = torch.tensor([1.0 + 4.0 * 0.5, 2.0 + 4.0 * -1.0]) * 3**-0.5
    p = torch.softmax(s, 0)
    torch.testing.assert_close(o[0], p[0] * torch.tensor([2.0, 0.0]) + p[1] * torch.tensor([0.0, 3.0]))


def test_mla_attention_ignores_non_finite_junk_rows():
    """Rows after a request's position may hold anything (a cache allocated with torch.empty): NaN and
    inf there must not reach the output."""
    gen = torch.Generator().manual_seed(3)
    H, nope, rope, vd, R = 2, 4, 2, 3, 4
    kv_b = torch.randn(H * (nope + vd), R, generator=gen)
    q = torch.randn(2, H * (nope + rope), generator=gen)
    cache = torch.randn(2, 5, R + rope, generator=gen)
    pos = torch.tensor([1, 3])
    clean = k3mk.mla_attention(q, cache, pos, kv_b, H, nope, rope, vd, R)
    dirty = cache.clone()
    dirty[0, 2:] = float("nan")
    dirty[1, 4] = float("inf")
    torch.testing.assert_close(k3mk.mla_attention(q, dirty, pos, kv_b, H, nope, rope, vd, R), clean)


def test_argmax_ties_lowest():
    assert k3mk.argmax(torch.tensor([[1.0, 3.0, 3.0, 0.0]])).tolist() == [1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sigmoid_gate_in_activation_dtype(dtype):
    """Spec 4.2: the MLA output gate multiplies in the model dtype."""
    x, g = torch.randn(2, 8).to(dtype), torch.randn(2, 8)
    y = k3mk.sigmoid_gate(x, g)
    assert y.dtype == dtype and torch.equal(y, x * torch.sigmoid(g.to(dtype)))
