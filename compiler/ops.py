"""The `k3mk::*` torch custom ops that the reference decode step is written in.

Each op IS one function of `k3mk.ir.semantics` (its numerics; the schema comes from its signature)
plus a shape-only fake implementation, so `torch.export` keeps every op as ONE graph node and the
full K3 captures on meta tensors. Capture maps these nodes 1:1 onto IR ops.
"""

from __future__ import annotations

import torch

from k3mk.ir import semantics as sem

F32, I32 = torch.float32, torch.int32


def _new(like, *shape, dtype=None):
    return like.new_empty(shape, dtype=dtype or like.dtype)


def _same(x, *_):
    return torch.empty_like(x)


# op name -> fake (shape/dtype) implementation; the real one is k3mk.ir.semantics.<name>
FAKES = {
    "embedding": lambda table, ids: _new(table, ids.shape[0], table.shape[1]),
    "rmsnorm": _same,
    "linear": lambda x, w, fp32=False: _new(x, x.shape[0], w.shape[0], dtype=F32 if fp32 else x.dtype),
    "add": _same,
    "silu_mul": _same,
    "situ_mul": _same,
    "kda_conv": lambda q, k, v, state, wq, wk, wv: tuple(torch.empty_like(t) for t in (q, k, v, state)),
    "kda_gate": lambda f, a_log, dt_bias, heads, lb: _new(f, f.shape[0], heads, f.shape[1] // heads, dtype=F32),
    "kda_recurrence": lambda q, k, v, g, b, state: (torch.empty_like(q), torch.empty_like(state)),
    "gated_rmsnorm": _same,
    "sigmoid_gate": _same,
    "mla_latent": _same,
    "mla_cache_write": _same,
    "mla_attention": lambda q, cache, pos, kv_b, heads, nope, rope, v_dim, rank: _new(q, q.shape[0], heads * v_dim),
    "router_topk": lambda logits, bias, k, renorm, scale: (
        _new(logits, logits.shape[0], k, dtype=I32),
        _new(logits, logits.shape[0], k, dtype=F32),
    ),
    "expert_linear": lambda x, w, ids: _new(x, ids.shape[0], ids.shape[1], w.shape[1]),
    "expert_linear_mxfp4": lambda x, packed, scale, ids: _new(x, ids.shape[0], ids.shape[1], packed.shape[1]),
    "moe_combine": lambda y, w: _new(y, y.shape[0], y.shape[2]),
    "attn_res": lambda sources, nw, pw, eps: torch.empty_like(sources[0]),
    "argmax": lambda logits: _new(logits, logits.shape[0], dtype=I32),
}


def _register() -> None:
    for name, fake in FAKES.items():
        if hasattr(torch.ops.k3mk, name) if hasattr(torch.ops, "k3mk") else False:
            continue
        op = torch.library.custom_op(f"k3mk::{name}", getattr(sem, name), mutates_args=())
        op.register_fake(fake)


_register()
k3mk = torch.ops.k3mk
