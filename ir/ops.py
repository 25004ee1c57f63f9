"""The closed op set of the Kimi K3 / Kimi Linear decode step (docs/ir.md).

One frozen dataclass per op kind. Its fields are the op's compile-time attributes; its tensor operands
and results are the node's inputs and outputs. Every op's numerics are `k3mk.ir.semantics.<name>`,
called as `fn(*tensor_inputs, *attributes)`; shapes and dtypes are inferred by running that same
function on meta tensors, so semantics and shape rules cannot drift apart.

Ops that passes introduce (fused forms, collectives, the absorbed MLA pieces) are registered here too,
each with its semantics; a pass or the capture that meets a kind not in `OPS` fails loudly.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from k3mk.ir import semantics

OPS: dict[str, type["Op"]] = {}


def register(cls: type["Op"]) -> type["Op"]:
    if cls.name in OPS:
        raise ValueError(f"op '{cls.name}' is registered twice")
    OPS[cls.name] = cls
    return cls


@dataclass(frozen=True)
class Op:
    """Base of every op. `name` is the op kind; `num_outputs` how many results it produces."""

    name: ClassVar[str] = ""
    num_outputs: ClassVar[int] = 1
    # The reference semantics; None means `k3mk.ir.semantics.<name>`. Ops defined outside ops.py
    # (fused forms, collectives) set it to their own function.
    semantics_fn: ClassVar[Any] = None
    variadic: ClassVar[bool] = False  # True: the leading inputs are one list operand (attn_res sources)
    # The input whose run-time values pick the weights a task streams (a routed expert's ids: its position
    # in the inputs, negative from the end); None: the weights are known at compile time. The producer
    # warp waits for that input's writers only (passes/build_events.py "weight waits").
    weight_index_input: ClassVar[int | None] = None

    def attributes(self) -> tuple[Any, ...]:
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    def evaluate(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Reference semantics: the function of the same name in ir/semantics.py."""
        fn = type(self).semantics_fn or getattr(semantics, self.name)
        args: tuple[Any, ...] = inputs
        if self.variadic:
            n = self.num_list_inputs(len(inputs))
            args = (list(inputs[:n]), *inputs[n:])
        out = fn(*args, *self.attributes())
        return out if isinstance(out, tuple) else (out,)

    def num_list_inputs(self, total: int) -> int:
        raise NotImplementedError

    def describe(self) -> str:
        """Stable one-line text of the kind and attributes, for the printer and IR dumps."""
        attrs = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))
        return f"{self.name}({attrs})" if attrs else self.name


def op(name: str, num_outputs: int = 1, semantics_fn: Any = None):
    """Class decorator that makes `cls` a frozen dataclass op of kind `name` and registers it."""

    def wrap(cls):
        cls.name = name
        cls.num_outputs = num_outputs
        if semantics_fn is not None:
            cls.semantics_fn = staticmethod(semantics_fn)
        return register(dataclass(frozen=True)(cls))

    return wrap


@op("embedding")
class Embedding(Op):
    """(table [V, d], ids [B]) -> [B, d]"""


@op("rmsnorm")
class RMSNorm(Op):
    """(x [B, n], weight [n]) -> [B, n]"""

    eps: float


@op("linear")
class Linear(Op):
    """(x [B, in], weight [out, in]) -> [B, out]; fp32: compute and return fp32 (router logits)."""

    fp32: bool


@op("add")
class Add(Op):
    """(a, b) -> a + b in a's dtype."""


@op("silu_mul")
class SiluMul(Op):
    """(gate, up) -> silu(gate) * up"""


@op("situ_mul")
class SituMul(Op):
    """(gate, up) -> SiTU(gate) * clamp(up), fp32 inside."""

    beta: float
    linear_beta: float | None


@op("kda_conv", num_outputs=4)
class KDAConv(Op):
    """(q, k, v [B, P], state [B, W-1, 3P], wq, wk, wv [P, 1, W]) -> (q', k', v', state')"""


@op("kda_gate")
class KDAGate(Op):
    """(f [B, P], A_log [H], dt_bias [P]) -> g [B, H, D] fp32"""

    num_heads: int
    lower_bound: float | None


@op("kda_recurrence", num_outputs=2)
class KDARecurrence(Op):
    """(q, k, v [B, P], g [B, H, D], beta_logits [B, H], state [B, H, V, K]) -> (o [B, P], state')"""


@op("gated_rmsnorm")
class GatedRMSNorm(Op):
    """(x [B, P], gate [B, P], weight [D]) -> [B, P]"""

    head_dim: int
    eps: float


@op("sigmoid_gate")
class SigmoidGate(Op):
    """(x, gate) -> x * sigmoid(gate)"""


@op("mla_latent")
class MLALatent(Op):
    """(c [B, rank + rope], weight [rank]) -> cache row [B, rank + rope]"""

    kv_lora_rank: int
    eps: float


@op("mla_cache_write")
class MLACacheWrite(Op):
    """(cache [B, T, C], row [B, C], positions [B]) -> cache'"""


@op("mla_attention")
class MLAAttention(Op):
    """(q [B, H*(nope+rope)], cache [B, T, C], positions [B], kv_b [H*(nope+v), rank]) -> [B, H*v]"""

    num_heads: int
    qk_nope: int
    qk_rope: int
    v_dim: int
    kv_lora_rank: int


@op("router_topk", num_outputs=2)
class RouterTopK(Op):
    """(logits [B, E] fp32, bias [E]) -> (ids [B, k] int32, weights [B, k] fp32)"""

    top_k: int
    renormalize: bool
    scaling: float


@op("expert_linear")
class ExpertLinear(Op):
    """(x [B, in] or [B, k, in], weight [E, out, in], ids [B, k]) -> [B, k, out]"""


@op("expert_linear_mxfp4")
class ExpertLinearMXFP4(Op):
    """(x, packed [E, out, in/2] u8, scale [E, out, in/32] u8, ids [B, k]) -> [B, k, out]"""


@op("moe_combine")
class MoECombine(Op):
    """(y [B, k, n], weights [B, k]) -> [B, n]"""


@op("attn_res")
class AttnRes(Op):
    """(*sources [B, d], norm_weight [d], proj_weight [1, d]) -> [B, d]"""

    eps: float
    variadic: ClassVar[bool] = True

    def num_list_inputs(self, total: int) -> int:
        return total - 2


@op("argmax")
class Argmax(Op):
    """(logits [B, V]) -> [B] int32"""


def infer(op: Op, inputs: list[tuple[tuple[int, ...], torch.dtype]]) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Output (shape, dtype) of `op` for inputs of the given (shape, dtype): the semantics run on meta."""
    return list(_infer(op, tuple((tuple(shape), dtype) for shape, dtype in inputs)))


@functools.lru_cache(maxsize=None)
def _infer(op: Op, inputs: tuple) -> tuple:
    # Cached: a 93-layer model repeats the same (op, operand types) thousands of times, and every
    # pass re-verifies the whole graph.
    metas = [torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in inputs]
    outs = op.evaluate(*metas)
    if len(outs) != op.num_outputs:
        raise ValueError(f"{op.name}: semantics returned {len(outs)} results, the op declares {op.num_outputs}")
    return tuple((tuple(o.shape), o.dtype) for o in outs)
