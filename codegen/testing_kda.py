"""Test mode for the KDA-side Kimi ops: `TableBuilder` methods (mixed into codegen/testing.py's
TableBuilder) for the fused GEMV epilogues (ir/fused.py: gated_linear, linear_residual,
linear_sigmoid_gate, linear_kda_gate, linear_gated_rmsnorm, the fp32 linear), kda_conv,
kda_recurrence and attn_res. Each method emits the tasks of one op and registers its reference step,
computed with k3mk.ir.semantics / k3mk.ir.fused exactly as the IR defines the op.

Decode state (the KDA conv and recurrent states) is a pointer-table entry bound by name, like a weight,
and is updated in place: the builder records its name in `self.states`; a reference step reads the
state from the environment if an earlier op of the same table updated it, else from the bound tensors,
and stores the new state in the environment under the state's name.
"""

from __future__ import annotations

from typing import Sequence

import torch

from k3mk.ir import fused, semantics
from k3mk.ir.ops import SiluMul, SituMul
from k3mk.ir.task_table import AttnResParams, GemvParams, KdaConvParams, KdaRecurrenceParams, MAX_ATTN_RES_SOURCES

RESIDUAL_OPERANDS = ("residual", "residual2", "residual3", "residual4")


def _state(env: dict, weights: dict, name: str) -> torch.Tensor:
    return env[name] if name in env else weights[name]


class KdaOpsMixin:
    """Methods of codegen.testing.TableBuilder (which provides buffer/weight/event/_opcode/_emit/_steps)."""

    # ---- the GEMV family (one "gemv" variant per epilogue) -------------------------------------
    def _gemv_tasks(self, params: GemvParams, operands: dict, *, tiles: int, wait: tuple[int, ...], name: str) -> int:
        from k3mk.codegen.testing import _split

        opcode = self._opcode("gemv", params)
        ev = self.event(name)
        for i, (begin, count) in enumerate(_split(params.out_features, tiles)):
            self._emit(opcode, {**operands, "row_begin": begin, "row_count": count, "batch_stride": params.out_features},
                       wait, ev, f"{name}[{i}]", None)  # fmt: skip
        return ev

    def _gemv_common(self, x, weight: int, norm_weight: int | None, eps: float) -> tuple[int, int, int, dict]:
        batch, k = x.shape
        n = self.weights[weight].shape[0]
        operands = {"x": x.offset, "weight": weight}
        if norm_weight is not None:
            operands["norm_weight"] = norm_weight
        return batch, k, n, operands

    def _xs(self, env: dict, weights: dict, x, norm_weight: int | None) -> list[torch.Tensor]:
        """fused.py's norm-prologue operand group: [x] or [x, norm_weight]."""
        return [env[x.name]] if norm_weight is None else [env[x.name], weights[self.weights[norm_weight].name]]

    def linear_fp32(self, x, weight: int, out, *, tiles: int, wait: tuple[int, ...] = (), norm_weight: int | None = None,
                    eps: float = 1e-6, name: str = "linear_fp32") -> int:  # fmt: skip
        """out fp32 [B, n] = xn @ W.T unrounded: semantics.linear(fp32=True) / fused.rmsnorm_linear(fp32=True)."""
        batch, k, n, operands = self._gemv_common(x, weight, norm_weight, eps)
        params = GemvParams(k, n, batch, rmsnorm=norm_weight is not None, eps=eps, out_dtype="float32")
        ev = self._gemv_tasks(params, {**operands, "out": out.offset}, tiles=tiles, wait=wait, name=name)
        w_name = self.weights[weight].name

        def step(env, weights):
            xs = self._xs(env, weights, x, norm_weight)
            if norm_weight is None:
                env[out.name] = semantics.linear(xs[0], weights[w_name], fp32=True)
            else:
                env[out.name] = fused.rmsnorm_linear(xs[0], xs[1], weights[w_name], eps, True)

        self._steps.append(step)
        return ev

    def linear_residual(self, x, weight: int, out, residuals: Sequence, *, tiles: int, wait: tuple[int, ...] = (),
                        name: str = "linear_residual") -> int:  # fmt: skip
        """out = r_n + (... + (r_1 + x W^T)), one bf16 rounding per add (fused.linear_residual)."""
        batch, k, n, operands = self._gemv_common(x, weight, None, 0.0)
        params = GemvParams(k, n, batch, residuals=len(residuals))
        operands.update({RESIDUAL_OPERANDS[i]: r.offset for i, r in enumerate(residuals)})
        ev = self._gemv_tasks(params, {**operands, "out": out.offset}, tiles=tiles, wait=wait, name=name)
        w_name, r_names = self.weights[weight].name, [r.name for r in residuals]
        self._steps.append(lambda env, w: env.__setitem__(out.name, fused.linear_residual([env[r] for r in r_names], env[x.name], w[w_name])))
        return ev

    def gated_linear(self, x, weight_gate: int, weight_up: int, out, activation: SiluMul | SituMul, *, tiles: int,
                     wait: tuple[int, ...] = (), norm_weight: int | None = None, eps: float = 1e-6,
                     name: str = "gated_linear") -> int:  # fmt: skip
        """out = act(bf16(xn Wg^T), bf16(xn Wu^T)) (fused.gated_linear; SiLU or SiTU, spec 5.1)."""
        batch, k, n, operands = self._gemv_common(x, weight_gate, norm_weight, eps)
        if isinstance(activation, SituMul):
            params = GemvParams(k, n, batch, rmsnorm=norm_weight is not None, eps=eps, epilogue="situ_mul",
                                beta=activation.beta, linear_beta=activation.linear_beta)  # fmt: skip
        else:
            params = GemvParams(k, n, batch, rmsnorm=norm_weight is not None, eps=eps, epilogue="silu_mul")
        operands.update({"weight_up": weight_up, "out": out.offset})
        ev = self._gemv_tasks(params, operands, tiles=tiles, wait=wait, name=name)
        g_name, u_name = self.weights[weight_gate].name, self.weights[weight_up].name
        norm_eps = eps if norm_weight is not None else None

        def step(env, weights):
            xs = self._xs(env, weights, x, norm_weight)
            env[out.name] = fused.gated_linear(xs, weights[g_name], weights[u_name], norm_eps, activation)

        self._steps.append(step)
        return ev

    def linear_sigmoid_gate(self, x, weight: int, o, out, *, tiles: int, wait: tuple[int, ...] = (),
                            norm_weight: int | None = None, eps: float = 1e-6, name: str = "linear_sigmoid_gate") -> int:  # fmt: skip
        """out = o * sigmoid(xn W^T) in bf16 (fused.linear_sigmoid_gate, spec 4.2)."""
        batch, k, n, operands = self._gemv_common(x, weight, norm_weight, eps)
        params = GemvParams(k, n, batch, rmsnorm=norm_weight is not None, eps=eps, epilogue="sigmoid_gate")
        ev = self._gemv_tasks(params, {**operands, "o": o.offset, "out": out.offset}, tiles=tiles, wait=wait, name=name)
        w_name = self.weights[weight].name
        norm_eps = eps if norm_weight is not None else None

        def step(env, weights):
            env[out.name] = fused.linear_sigmoid_gate(self._xs(env, weights, x, norm_weight), weights[w_name], env[o.name], norm_eps)

        self._steps.append(step)
        return ev

    def linear_kda_gate(self, x, weight: int, a_log: int, dt_bias: int, out, *, num_heads: int, lower_bound: float | None,
                        tiles: int, wait: tuple[int, ...] = (), norm_weight: int | None = None, eps: float = 1e-6,
                        name: str = "linear_kda_gate") -> int:  # fmt: skip
        """out fp32 [B, H, D] = kda_gate(xn W^T) (fused.linear_kda_gate, spec 3.2)."""
        batch, k, n, operands = self._gemv_common(x, weight, norm_weight, eps)
        params = GemvParams(k, n, batch, rmsnorm=norm_weight is not None, eps=eps, epilogue="kda_gate", out_dtype="float32",
                            head_dim=n // num_heads, lower_bound=lower_bound)  # fmt: skip
        operands.update({"a_log": a_log, "dt_bias": dt_bias, "out": out.offset})
        ev = self._gemv_tasks(params, operands, tiles=tiles, wait=wait, name=name)
        w_name, a_name, dt_name = self.weights[weight].name, self.weights[a_log].name, self.weights[dt_bias].name
        norm_eps = eps if norm_weight is not None else None

        def step(env, weights):
            xs = self._xs(env, weights, x, norm_weight)
            env[out.name] = fused.linear_kda_gate(xs, weights[w_name], weights[a_name], weights[dt_name], norm_eps, num_heads, lower_bound)

        self._steps.append(step)
        return ev

    def linear_gated_rmsnorm(self, x, weight: int, o, o_norm_weight: int, out, *, head_dim: int, o_eps: float, tiles: int,
                             wait: tuple[int, ...] = (), norm_weight: int | None = None, eps: float = 1e-6,
                             name: str = "linear_gated_rmsnorm") -> int:  # fmt: skip
        """out = gated_rmsnorm(o, xn W^T) per head (fused.linear_gated_rmsnorm, spec 3.2 o_norm)."""
        batch, k, n, operands = self._gemv_common(x, weight, norm_weight, eps)
        params = GemvParams(k, n, batch, rmsnorm=norm_weight is not None, eps=eps, epilogue="gated_rmsnorm",
                            head_dim=head_dim, o_eps=o_eps)  # fmt: skip
        operands.update({"o": o.offset, "o_norm_weight": o_norm_weight, "out": out.offset})
        ev = self._gemv_tasks(params, operands, tiles=tiles, wait=wait, name=name)
        w_name, onw_name = self.weights[weight].name, self.weights[o_norm_weight].name
        norm_eps = eps if norm_weight is not None else None

        def step(env, weights):
            xs = self._xs(env, weights, x, norm_weight)
            env[out.name] = fused.linear_gated_rmsnorm(xs, weights[w_name], env[o.name], weights[onw_name], norm_eps, head_dim, o_eps)

        self._steps.append(step)
        return ev

    # ---- KDA ------------------------------------------------------------------------------------
    def kda_conv(self, q, k, v, state: int, weight_q: int, weight_k: int, weight_v: int, out_q, out_k, out_v, *,
                 channel_tile: int, wait: tuple[int, ...] = (), name: str = "kda_conv") -> int:  # fmt: skip
        """semantics.kda_conv; one task per `channel_tile` channels (the tile pass uses one head)."""
        batch, channels = q.shape
        width = self.weights[weight_q].shape[-1]
        opcode = self._opcode("kda_conv", KdaConvParams(channels, batch, width))
        ev = self.event(name)
        base = {"q": q.offset, "k": k.offset, "v": v.offset, "out_q": out_q.offset, "out_k": out_k.offset,
                "out_v": out_v.offset, "state": state, "weight_q": weight_q, "weight_k": weight_k, "weight_v": weight_v}  # fmt: skip
        for i, c0 in enumerate(range(0, channels, channel_tile)):
            count = min(channel_tile, channels - c0)
            self._emit(opcode, {**base, "channel_begin": c0, "channel_count": count}, wait, ev, f"{name}[{i}]", None)
        s_name = self.weights[state].name
        self.states.append(s_name)
        wq, wk, wv = (self.weights[i].name for i in (weight_q, weight_k, weight_v))

        def step(env, weights):
            yq, yk, yv, new_state = semantics.kda_conv(env[q.name], env[k.name], env[v.name], _state(env, weights, s_name),
                                                       weights[wq], weights[wk], weights[wv])  # fmt: skip
            env[out_q.name], env[out_k.name], env[out_v.name], env[s_name] = yq, yk, yv, new_state

        self._steps.append(step)
        return ev

    def kda_recurrence(self, q, k, v, g, beta, state: int, out, *, value_tiles: int = 1, wait: tuple[int, ...] = (),
                       name: str = "kda_recurrence") -> int:  # fmt: skip
        """semantics.kda_recurrence; tasks per (head, value rows) as passes/tile.py makes them."""
        from k3mk.codegen.testing import _split

        batch, heads, v_dim, k_dim = self.weights[state].shape
        tiles = _split(v_dim, value_tiles)
        opcode = self._opcode("kda_recurrence", KdaRecurrenceParams(heads, k_dim, batch, value_rows=max(vc for _, vc in tiles)))
        ev = self.event(name)
        base = {"q": q.offset, "k": k.offset, "v": v.offset, "g": g.offset, "beta": beta.offset, "out": out.offset, "state": state}
        for h in range(heads):
            for j, (v0, vc) in enumerate(tiles):
                self._emit(opcode, {**base, "head": h, "value_begin": v0, "value_count": vc}, wait, ev, f"{name}[{h}.{j}]", None)
        s_name = self.weights[state].name
        self.states.append(s_name)

        def step(env, weights):
            o, new_state = semantics.kda_recurrence(env[q.name], env[k.name], env[v.name], env[g.name], env[beta.name],
                                                    _state(env, weights, s_name))  # fmt: skip
            env[out.name], env[s_name] = o, new_state

        self._steps.append(step)
        return ev

    # ---- attention residual (spec 6) --------------------------------------------------------------
    def attn_res(self, sources: Sequence, norm_weight: int, proj_weight: int, out, *, eps: float = 1e-5, tasks: int = 1,
                 wait: tuple[int, ...] = (), name: str = "attn_res") -> int:  # fmt: skip
        from k3mk.codegen.testing import _split

        assert 1 <= len(sources) <= MAX_ATTN_RES_SOURCES
        batch, dim = out.shape
        opcode = self._opcode("attn_res", AttnResParams(dim, batch, len(sources), eps))
        ev = self.event(name)
        base = {"out": out.offset, "norm_weight": norm_weight, "proj_weight": proj_weight}
        base.update({f"source{i}": s.offset for i, s in enumerate(sources)})
        for i, (b0, bc) in enumerate(_split(batch, tasks)):
            self._emit(opcode, {**base, "batch_begin": b0, "batch_count": bc}, wait, ev, f"{name}[{i}]", None)
        names = [s.name for s in sources]
        nw, pw = self.weights[norm_weight].name, self.weights[proj_weight].name
        self._steps.append(lambda env, w: env.__setitem__(out.name, semantics.attn_res([env[s] for s in names], w[nw], w[pw], eps)))
        return ev
